// Engine allocator: every tensor's bytes are counted per category (current and peak), so that benchmarks and
// reports can state memory from the engine's own accounting rather than from the OS.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace sg {

// New categories go at the end: the C ABI numbers them in this order.
enum class MemCategory : int {
  kWeights = 0, kGrads, kOptimizer, kActivations, kKVCache, kKVGrad, kLogits, kWorkspace,
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

// Elements and bytes of a tensor shape, computed with overflow checks: INVALID_ARGUMENT for a negative dimension,
// RESOURCE_EXHAUSTED when the count does not fit in int64 (the message gives the shape).
absl::StatusOr<int64_t> CheckedNumel(const std::vector<int64_t>& shape);
absl::StatusOr<int64_t> CheckedBytes(DType dtype, const std::vector<int64_t>& shape);
// a * b and a + b for non-negative sizes; false on overflow.
bool CheckedMul(int64_t a, int64_t b, int64_t* out);
bool CheckedAdd(int64_t a, int64_t b, int64_t* out);

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

// A dense, row-major tensor whose storage is owned (shared) and counted by a MemoryTracker.
class Tensor {
 public:
  Tensor() = default;
  // On the tracker's device (CPU without a tracker). Throws OutOfMemory when the size overflows or (CPU) exceeds
  // HostAvailableBytes(), before allocating, or when the allocation fails; MemoryLimitExceeded past the tracker's
  // limit.
  static Tensor Empty(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape);
  static Tensor Zeros(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape);

  bool defined() const { return static_cast<bool>(storage_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  MemCategory category() const { return category_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }
  void* raw() const { return storage_.get(); }
  template <typename T> T* data() const { return static_cast<T*>(storage_.get()); }
  void SetZero();
  void Reset() { storage_.reset(); }
  // Rows [begin, end) along the first dimension: a view that shares (and keeps alive) the storage, counted once.
  Tensor Rows(int64_t begin, int64_t end) const;

 private:
  std::shared_ptr<void> storage_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCPU;
  MemCategory category_ = MemCategory::kWorkspace;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
};

// Host memory, 64-byte aligned, for CPU tensors. Blocks of at least kHostCacheMinBytes are cached when freed
// (per size class, 8 classes per doubling) and handed out again, so that a step does not page-fault fresh memory
// for every activation: glibc serves such blocks with mmap/munmap. The blocks it holds plus those in use stay within
// 1.25x the peak of the blocks in use (cached blocks are freed, largest first, to stay within it); smaller blocks go
// straight to malloc. Thread-safe. SG_HOST_CACHE=0 (environment) turns the cache off, and so does an
// AddressSanitizer build (a reused block would hide a use after free). MemoryTracker counts tensor bytes, never
// cached ones.
//
// True in an AddressSanitizer build (GCC's -fsanitize=address defines the first, clang answers the second).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif
// Blocks from this size up are cached: below it malloc's own arenas already reuse memory without page faults (a
// larger threshold left faults in every step; docs/cpu.md).
constexpr size_t kHostCacheMinBytes = size_t{256} << 10;
void* HostAllocate(size_t bytes);  // throws std::bad_alloc
void HostDeallocate(void* p);
bool HostCacheEnabled();
struct HostCacheStats {
  int64_t cached_bytes = 0, cached_blocks = 0;  // free blocks the cache holds
  int64_t in_use_bytes = 0, peak_in_use_bytes = 0;  // blocks of cacheable size handed out (size classes' bytes)
  int64_t limit_bytes = 0;  // in use + cached stay within this: 1.25x peak_in_use_bytes
  int64_t hits = 0, misses = 0;  // allocations of cacheable size served from the cache / by malloc
  int64_t evictions = 0;          // cached blocks freed to stay within the bound
  // The fewest cached bytes since ResetHostCacheWindow: cached_bytes then minus this is what the window took from
  // the cache (resident memory that a process RSS delta does not show, e.g. a benchmark step's).
  int64_t window_low_cached_bytes = 0;
};
HostCacheStats GetHostCacheStats();
// Frees every cached block and restarts the peak from the blocks in use (e.g. when a model is destroyed).
void ReleaseHostCache();
void ResetHostCacheWindow();

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

// Host access to memory of device d. Only CPU memory is host-addressable: host code reads or writes a CUDA
// tensor through these copies (meta memory has no bytes: they copy nothing).
inline bool HostAddressable(Device d) { return d == Device::kCPU; }
void CopyToHost(Device d, void* dst, const void* src, size_t bytes);
void CopyFromHost(Device d, void* dst, const void* src, size_t bytes);
void CopyOnDevice(Device d, void* dst, const void* src, size_t bytes);
// Whole tensors: t.nbytes() bytes; CopyTensor needs equal sizes on one device.
void CopyToHost(const Tensor& t, void* dst);
void CopyFromHost(const Tensor& t, const void* src);
void CopyTensor(const Tensor& dst, const Tensor& src);
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
// The tensor's values as a host vector (T the tensor's element type).
template <typename T>
std::vector<T> HostCopy(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  CopyToHost(t, v.data());
  return v;
}
// The tensor's bytes for host code to read: its own memory when host-addressable, else a host copy appended to
// *copies (valid while it is).
const void* HostBytes(const Tensor& t, std::vector<std::vector<char>>* copies);
// Fills t from host code: fill(dst) writes t.nbytes() bytes at dst, which is t's own memory when host-addressable,
// else a host buffer copied into t when fill succeeds.
absl::Status FillFromHost(const Tensor& t, const std::function<absl::Status(void*)>& fill);
// dst[i] = v, stored as dtype's f32, f64 or bf16.
inline void StoreAs(DType dtype, void* dst, int64_t i, double v) {
  if (dtype == DType::kF64) static_cast<double*>(dst)[i] = v;
  else if (dtype == DType::kBF16) static_cast<uint16_t*>(dst)[i] = F32ToBF16(static_cast<float>(v));
  else static_cast<float*>(dst)[i] = static_cast<float>(v);
}
// t[i] = value(i) (a double, stored as t's f32, f64 or bf16) for every element, computed by host code in index
// order: in place on the CPU, else into a host buffer copied into t after.
template <typename F>
void SetFromHost(const Tensor& t, F value) {
  const bool direct = HostAddressable(t.device());
  std::vector<char> host(direct ? 0 : t.nbytes());
  char* dst = direct ? static_cast<char*>(t.raw()) : host.data();
  for (int64_t i = 0; i < t.numel(); ++i) StoreAs(t.dtype(), dst, i, value(i));
  if (!direct) CopyFromHost(t, host.data());
}
// Runs f on t's bytes in host memory: t's own when host-addressable, else a host copy of them, copied back into t
// when f succeeds and write_back is set (e.g. a collective over a device's tensor).
absl::Status WithHostBytes(const Tensor& t, bool write_back, const std::function<absl::Status(void*)>& f);

}  // namespace sg
