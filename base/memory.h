// The engine's memory accounting: every tensor's bytes are counted per category (current and peak), so that
// benchmarks and reports can state memory from the engine's own accounting rather than from the OS. Also the memory
// errors, the per-device allocation hooks and the copies between host memory and a device's. Tensors themselves:
// base/tensor.h.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace sg {

// New categories go at the end: the C ABI numbers them in this order.
enum class MemCategory : int {
  kWeights = 0,
  kGrads,
  kOptimizer,
  kActivations,
  kKVCache,
  kKVGrad,
  kLogits,
  kWorkspace,
  kMasterWeights,  // fp32 master copies of trainable bf16 weights (bf16 storage); the AdamW moments are kOptimizer
  kCount
};
constexpr int kNumMemCategories = static_cast<int>(MemCategory::kCount);
const char* MemCategoryName(MemCategory c);

struct MemorySnapshot {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};  // peak of each category on its own
  int64_t total_current = 0;
  int64_t total_peak = 0;  // peak of the sum (not the sum of per-category peaks)
  // Per-category bytes at the moment total_peak was reached.
  std::array<int64_t, kNumMemCategories> at_total_peak{};
  // The same peaks since the last MemoryTracker::ResetWindow() (e.g. of one training step), independent of
  // ResetPeak: a report can follow per-step peaks while total_peak stays the run's.
  std::array<int64_t, kNumMemCategories> window_peak{};
  int64_t window_total_peak = 0;
};

// One point of a memory timeline: the bytes in use per category right after the index-th allocation or release
// since the timeline started.
struct MemoryEvent {
  int64_t index = 0;
  std::array<int64_t, kNumMemCategories> current{};
};

// Thrown when an allocation would take the tracked total past MemoryTracker's limit.
struct MemoryLimitExceeded : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Thrown by Tensor::Empty when a tensor cannot be had: its size overflows, it is larger than the memory available,
// or the allocator fails. A std::bad_alloc whose what() gives the bytes asked and available.
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// Memory this process can still take on the host: MemAvailable, lowered to the cgroup's remaining limit when
// there is one. -1 when unknown.
int64_t HostAvailableBytes();

// Inside a catch block: the status of the exception being handled. Out of memory (std::bad_alloc, a tracker's
// limit) is RESOURCE_EXHAUSTED with the bytes asked (when known) and available; a std::system_error (I/O,
// std::ios_base::failure) the code its errno maps to; anything else INTERNAL. Messages start with `op`.
absl::Status StatusOfCurrentException(const std::string& op);

// Counts bytes; thread-safe. One tracker per model/engine instance.
class MemoryTracker {
 public:
  MemoryTracker() = default;
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;
  // A model's tracker outlives its tensors: when a CPU one ends, the host cache's blocks (now holding that model's
  // memory too) go back to the system (ReleaseHostCache).
  ~MemoryTracker();
  // Adds bytes; throws MemoryLimitExceeded (counting nothing) if that would pass the limit.
  void Add(MemCategory c, int64_t bytes);
  void Sub(MemCategory c, int64_t bytes);
  MemorySnapshot Snapshot() const;
  // Restart peak tracking from the current state (e.g. at the start of a benchmark step).
  void ResetPeak();
  // Restarts the window peaks (MemorySnapshot::window_peak) from the current state.
  void ResetWindow();
  // Caps the tracked total in bytes (0 = no cap): a step that would need more fails instead of allocating.
  void set_limit(int64_t bytes) { limit_ = bytes; }
  // Where the tensors counted by this tracker live (one model, one device); set before the first allocation.
  void set_device(Device d) { device_ = d; }
  Device device() const { return device_; }
  int64_t limit() const { return limit_; }

  // Timeline: while on, every Add/Sub appends a MemoryEvent (a point before the first, index 0, holds the state
  // at the start); past max_events further events are counted but not kept. Off (the default) costs one branch.
  void StartTimeline(int64_t max_events = 1 << 18);
  // Stops recording and returns the events; *dropped (if not null) gets how many were not kept.
  std::vector<MemoryEvent> StopTimeline(int64_t* dropped = nullptr);

 private:
  void RecordLocked();
  mutable std::atomic_flag lock_ = ATOMIC_FLAG_INIT;
  MemorySnapshot s_;
  int64_t limit_ = 0;
  Device device_ = Device::kCPU;
  bool timeline_on_ = false;
  int64_t timeline_max_ = 0, timeline_events_ = 0;
  std::vector<MemoryEvent> timeline_;
};

// Device memory hooks: the CUDA backend registers these; CPU uses aligned host memory.
struct DeviceAllocator {
  void* (*alloc)(size_t bytes) = nullptr;
  void (*free)(void* p) = nullptr;
  void (*memset_zero)(void* p, size_t bytes) = nullptr;
  // Copies between the device's memory and host memory, and within the device's memory. to_host and from_host
  // return when the copy is done (after the device's earlier work: they report its faults); on_device may not.
  void (*to_host)(void* dst, const void* src, size_t bytes) = nullptr;
  void (*from_host)(void* dst, const void* src, size_t bytes) = nullptr;
  void (*on_device)(void* dst, const void* src, size_t bytes) = nullptr;
};
void RegisterDeviceAllocator(Device d, DeviceAllocator a);
// The hooks of device d: CPU's and meta's built in, others as registered (alloc is null where none is).
const DeviceAllocator& DeviceAllocatorOf(Device d);

// Host access to memory of device d. Only CPU memory is host-addressable: host code reads or writes a CUDA
// tensor through these copies (meta memory has no bytes: they copy nothing).
inline bool HostAddressable(Device d) { return d == Device::kCPU; }
void CopyToHost(Device d, void* dst, const void* src, size_t bytes);
void CopyFromHost(Device d, void* dst, const void* src, size_t bytes);
void CopyOnDevice(Device d, void* dst, const void* src, size_t bytes);
// count elements at p in d's memory, readable by host code: p itself when host-addressable, else a host copy made
// in *copy.
template <typename T>
const T* HostReadable(Device d, const T* p, int64_t count, std::vector<T>* copy) {
  if (HostAddressable(d)) return p;
  copy->resize(static_cast<size_t>(count));
  CopyToHost(d, copy->data(), p, static_cast<size_t>(count) * sizeof(T));
  return copy->data();
}
// How many copies between host memory and a device's memory (not host-addressable, not meta) this process has made
// through CopyToHost and CopyFromHost, the only way host code reaches a device's tensors. Each waits for the
// device; tests check with these counts that a chunk's work makes none.
struct HostCopyCounts {
  int64_t to_host = 0, from_host = 0;
};
HostCopyCounts DeviceHostCopies();

}  // namespace sg
