#include "core/expert_offload.h"

#include <algorithm>
#include <stdexcept>

namespace sg {

ExpertOffload::ExpertOffload(MemoryTracker& mem, const CopyEngine& copies,
                             const std::vector<std::vector<Tensor>>& layers)
    : copies_(copies), slots_(std::min<size_t>(kSlots, layers.size())) {
  if (!copies_.alloc_host || !copies_.copy_async || !copies_.wait)
    throw std::invalid_argument("--offload_experts: the device's backend has no copy engine");
  if (layers.empty()) throw std::invalid_argument("--offload_experts: no expert weights to offload");
  for (const Tensor& w : layers[0]) {
    offsets_.push_back(slot_bytes_);
    slot_bytes_ += static_cast<int64_t>(w.nbytes());
  }
  // The home of a meta model's weights has no bytes either (meta's alloc_host allocates none).
  const Device home_device = mem.device() == Device::kMeta ? Device::kMeta : Device::kCPU;
  for (const std::vector<Tensor>& layer : layers) {
    std::vector<Tensor>& homes = homes_.emplace_back();
    for (const Tensor& w : layer) {
      void* p = copies_.alloc_host(w.nbytes());
      homes.push_back(Tensor::Adopt(p, copies_.free_host, home_device, w.category(), w.dtype(), w.shape()));
      CopyToHost(w.device(), p, w.raw(), w.nbytes());
      host_bytes_ += static_cast<int64_t>(w.nbytes());
    }
  }
  const DType dtype = layers[0][0].dtype();
  for (Slot& s : slots_)
    s.memory =
        Tensor::Empty(&mem, MemCategory::kWeights, dtype, {slot_bytes_ / static_cast<int64_t>(DTypeSize(dtype))});
}

ExpertOffload::~ExpertOffload() { copies_.wait(kLane); }

ExpertOffload::Slot* ExpertOffload::Find(int layer) {
  for (Slot& s : slots_)
    if (s.layer == layer) return &s;
  return nullptr;
}

ExpertOffload::Slot& ExpertOffload::Fetch(int layer, int keep) {
  if (Slot* s = Find(layer)) return *s;
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
