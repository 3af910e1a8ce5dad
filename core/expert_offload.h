// Expert weight offload: the frozen expert weights of every MoE layer (its fused gate_up and down, most of a MoE
// model's bytes) live in host memory (pinned on CUDA), and the device holds a ring of kSlots layers' worth of them:
// the layer computing and the one the schedule visits next, fetched on a lane of the device's copy engine (the
// mechanism of KV offload, core/kv_offload.h) while the first computes. The kernels read the same bits from a slot
// as from the parameter, so results are bit-identical to a run without offload.
#pragma once

#include <cstdint>
#include <vector>

#include "base/memory.h"
#include "base/tensor.h"
#include "kernels/backend.h"

namespace sg {

class ExpertOffload {
 public:
  static constexpr int kSlots = 2;
  // A lane of its own: waiting for an expert fetch does not wait for KV pages in flight (KvOffload's lanes 0, 1).
  static constexpr int kLane = 2;

  // The slots, made at the first visit, are counted in `mem` as weights.
  ExpertOffload(MemoryTracker& mem, const CopyEngine& copies);
  ~ExpertOffload();  // waits for the fetches in flight
  ExpertOffload(const ExpertOffload&) = delete;
  ExpertOffload& operator=(const ExpertOffload&) = delete;

  // The next MoE layer's expert weights on the device (every layer's alike in shapes and dtype): copies their values
  // home and returns the host tensors that replace them (their device memory goes with the caller's last reference),
  // so that a model moving its layers one by one as it creates them never holds more than one layer's on the device.
  const std::vector<Tensor>& AddLayer(const std::vector<Tensor>& weights);

  int layers() const { return static_cast<int>(homes_.size()); }
  const Tensor& home(int layer, int i) const { return homes_[layer][i]; }
  // Before MoE layer `layer` computes: makes its weights resident (waiting for their fetch, or fetching them now)
  // and starts fetching those of `next` (-1: none), the layer the schedule visits after it. Returns where weight i
  // of `layer` is on the device at [i], valid until two other layers have been visited.
  std::vector<WeightView> Visit(int layer, int next);

  // The homes may have changed (a checkpoint read into the parameters): every layer is fetched afresh.
  void Forget() {
    for (Slot& s : slots_) s.layer = -1;
  }

  int64_t host_bytes() const { return host_bytes_; }
  int64_t fetched_bytes() const { return fetched_bytes_; }  // host to device so far
  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Slot {
    int layer = -1;  // -1: empty
    int64_t last_use = 0;
    Tensor memory;
  };
  // The slot that holds (or is being fetched) `layer`, fetching it into the least recently used slot other than
  // keep's when it is in none.
  Slot& Fetch(int layer, int keep);
  Slot* Find(int layer);

  MemoryTracker& mem_;
  CopyEngine copies_;
  std::vector<std::vector<Tensor>> homes_;
  std::vector<int64_t> offsets_;  // of each weight of a layer in a slot
  std::vector<Slot> slots_;
  bool fetching_ = false;  // fetches issued and not waited for
  int64_t clock_ = 0, slot_bytes_ = 0, host_bytes_ = 0, fetched_bytes_ = 0;
};

}  // namespace sg
