#include "core/expert_offload.h"

#include <algorithm>
#include <stdexcept>

namespace sg {

ExpertOffload::ExpertOffload(MemoryTracker& mem, const CopyEngine& copies) : mem_(mem), copies_(copies) {
  if (!copies_.alloc_host || !copies_.copy_async || !copies_.wait)
    throw std::invalid_argument("--offload_experts: the device's backend has no copy engine");
}

const std::vector<Tensor>& ExpertOffload::AddLayer(const std::vector<Tensor>& weights) {
  if (homes_.empty())
    for (const Tensor& w : weights) {
      offsets_.push_back(slot_bytes_);
      slot_bytes_ += static_cast<int64_t>(w.nbytes());
    }
  // The home of a meta model's weights has no bytes either (meta's alloc_host allocates none).
  const Device home_device = mem_.device() == Device::kMeta ? Device::kMeta : Device::kCPU;
  std::vector<Tensor>& homes = homes_.emplace_back();
  for (const Tensor& w : weights) {
    void* p = copies_.alloc_host(w.nbytes());
    homes.push_back(Tensor::Adopt(p, copies_.free_host, home_device, w.category(), w.dtype(), w.shape()));
    CopyToHost(w.device(), p, w.raw(), w.nbytes());
    host_bytes_ += static_cast<int64_t>(w.nbytes());
  }
  return homes;
}

ExpertOffload::~ExpertOffload() { copies_.wait(kLane); }

ExpertOffload::Slot* ExpertOffload::Find(int layer) {
  for (Slot& s : slots_)
    if (s.layer == layer) return &s;
  return nullptr;
}

ExpertOffload::Slot& ExpertOffload::Fetch(int layer, int keep) {
  if (Slot* s = Find(layer)) return *s;
  if (slots_.empty()) {  // made at the first visit, so that a model moving its layers as it creates them holds none
    const DType dtype = homes_[0][0].dtype();
    slots_.resize(std::min<size_t>(kSlots, homes_.size()));
    for (Slot& s : slots_)
      s.memory =
          Tensor::Empty(&mem_, MemCategory::kWeights, dtype, {slot_bytes_ / static_cast<int64_t>(DTypeSize(dtype))});
  }
  Slot* victim = nullptr;
  for (Slot& s : slots_)
    if ((keep < 0 || s.layer != keep) && (!victim || s.last_use < victim->last_use)) victim = &s;
  // A copy into a slot waits for the compute issued before it, which may still read the layer it held.
  char* dst = static_cast<char*>(victim->memory.raw());
  for (size_t i = 0; i < homes_[layer].size(); ++i) {
    const Tensor& h = homes_[layer][i];
    copies_.copy_async(dst + offsets_[i], h.raw(), h.nbytes(), kLane);
    fetched_bytes_ += static_cast<int64_t>(h.nbytes());
  }
  victim->layer = layer;
  fetching_ = true;
  return *victim;
}

std::vector<WeightView> ExpertOffload::Visit(int layer, int next) {
  Slot& s = Fetch(layer, /*keep=*/-1);
  s.last_use = ++clock_;
  if (fetching_) copies_.wait(kLane);  // every fetch issued so far, this layer's among them
  fetching_ = false;
  if (next >= 0 && next != layer) Fetch(next, /*keep=*/layer);
  std::vector<WeightView> views;
  for (size_t i = 0; i < homes_[layer].size(); ++i)
    views.push_back({static_cast<const char*>(s.memory.raw()) + offsets_[i], homes_[layer][i].dtype()});
  return views;
}

}  // namespace sg
