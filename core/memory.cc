#include "core/memory.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace sg {

const char* MemCategoryName(MemCategory c) {
  static constexpr const char* kNames[] = {"weights", "grads",   "optimizer", "activations",
                                                "kv_cache", "kv_grad", "logits",    "workspace"};
  int i = static_cast<int>(c);
  return i >= 0 && i < kNumMemCategories ? kNames[i] : "?";
}

namespace {
struct SpinGuard {
  explicit SpinGuard(std::atomic_flag& f) : f_(f) {
    while (f_.test_and_set(std::memory_order_acquire)) {}
  }
  ~SpinGuard() { f_.clear(std::memory_order_release); }
  std::atomic_flag& f_;
};

void* HostAlloc(size_t bytes) {
  // 64-byte alignment for SIMD and to keep tensors off each other's cache lines.
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::bad_alloc();
  return p;
}
void HostFree(void* p) { std::free(p); }
void HostZero(void* p, size_t bytes) { std::memset(p, 0, bytes); }

DeviceAllocator g_allocators[2] = {{HostAlloc, HostFree, HostZero}, {}};
}  // namespace

void RegisterDeviceAllocator(Device d, DeviceAllocator a) { g_allocators[static_cast<int>(d)] = a; }

void MemoryTracker::Add(MemCategory c, int64_t bytes) {
  SpinGuard g(lock_);
  if (limit_ > 0 && s_.total_current + bytes > limit_)
    throw MemoryLimitExceeded(absl::StrCat("memory limit of ", limit_, " bytes exceeded: ", bytes, " bytes of ",
                                           MemCategoryName(c), " requested with ", s_.total_current, " in use"));
  int i = static_cast<int>(c);
  s_.current[i] += bytes;
  if (s_.current[i] > s_.peak[i]) s_.peak[i] = s_.current[i];
  s_.total_current += bytes;
  if (s_.total_current > s_.total_peak) {
    s_.total_peak = s_.total_current;
    s_.at_total_peak = s_.current;
  }
  if (s_.current[i] > s_.window_peak[i]) s_.window_peak[i] = s_.current[i];
  if (s_.total_current > s_.window_total_peak) s_.window_total_peak = s_.total_current;
  if (timeline_on_) RecordLocked();
}

void MemoryTracker::Sub(MemCategory c, int64_t bytes) {
  SpinGuard g(lock_);
  s_.current[static_cast<int>(c)] -= bytes;
  s_.total_current -= bytes;
  if (timeline_on_) RecordLocked();
}

void MemoryTracker::RecordLocked() {
  const int64_t index = timeline_events_++;
  if (static_cast<int64_t>(timeline_.size()) < timeline_max_) timeline_.push_back({index, s_.current});
}

void MemoryTracker::StartTimeline(int64_t max_events) {
  SpinGuard g(lock_);
  timeline_.clear();
  timeline_max_ = max_events < 1 ? 1 : max_events;
  timeline_events_ = 0;
  timeline_on_ = true;
  RecordLocked();  // index 0: the state at the start
}

std::vector<MemoryEvent> MemoryTracker::StopTimeline(int64_t* dropped) {
  SpinGuard g(lock_);
  timeline_on_ = false;
  if (dropped) *dropped = timeline_events_ - static_cast<int64_t>(timeline_.size());
  std::vector<MemoryEvent> out;
  out.swap(timeline_);
  return out;
}

MemorySnapshot MemoryTracker::Snapshot() const {
  SpinGuard g(lock_);
  return s_;
}

void MemoryTracker::ResetPeak() {
  SpinGuard g(lock_);
  s_.peak = s_.current;
  s_.total_peak = s_.total_current;
  s_.at_total_peak = s_.current;
}

void MemoryTracker::ResetWindow() {
  SpinGuard g(lock_);
  s_.window_peak = s_.current;
  s_.window_total_peak = s_.total_current;
}

Tensor Tensor::Empty(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape) {
  const Device device = tracker ? tracker->device() : Device::kCPU;
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.category_ = cat;
  t.numel_ = 1;
  for (int64_t s : shape) t.numel_ *= s;
  t.shape_ = std::move(shape);
  const int64_t bytes = t.numel_ * static_cast<int64_t>(DTypeSize(dtype));
  const DeviceAllocator& a = g_allocators[static_cast<int>(device)];
  if (!a.alloc)
    throw std::runtime_error("no allocator for the model's device (this build lacks its backend: --config=cuda)");
  if (tracker) tracker->Add(cat, bytes);  // first: over the limit, nothing is allocated
  void* p;
  try {
    p = a.alloc(static_cast<size_t>(bytes));
  } catch (...) {
    if (tracker) tracker->Sub(cat, bytes);
    throw;
  }
  void (*release)(void*) = a.free;
  t.storage_ = std::shared_ptr<void>(p, [tracker, cat, bytes, release](void* q) {
    release(q);
    if (tracker) tracker->Sub(cat, bytes);
  });
  return t;
}

Tensor Tensor::Zeros(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Empty(tracker, cat, dtype, std::move(shape));
  t.SetZero();
  return t;
}

Tensor Tensor::Rows(int64_t begin, int64_t end) const {
  Tensor t = *this;
  const int64_t row = shape_.empty() || shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.shape_[0] = end - begin;
  t.numel_ = (end - begin) * row;
  t.storage_ = std::shared_ptr<void>(storage_, static_cast<char*>(storage_.get()) + begin * row * DTypeSize(dtype_));
  return t;
}

void Tensor::SetZero() {
  if (storage_) g_allocators[static_cast<int>(device_)].memset_zero(storage_.get(), nbytes());
}

}  // namespace sg
