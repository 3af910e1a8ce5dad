#include "core/memory.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <ios>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <system_error>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/io/file.h"

namespace sg {

const char* MemCategoryName(MemCategory c) {
  static constexpr const char* kNames[] = {"weights",  "grads",   "optimizer", "activations",   "kv_cache",
                                           "kv_grad",  "logits",  "workspace", "master_weights"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kNumMemCategories, "name every category");
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

void* HostAlloc(size_t bytes) { return HostAllocate(bytes); }
void HostFree(void* p) { HostDeallocate(p); }
void HostZero(void* p, size_t bytes) { std::memset(p, 0, bytes); }

// Meta tensors own no memory (core/dtype.h's MetaAddress); the meta op table never dereferences them.
void* MetaAlloc(size_t) { return MetaAddress(); }
void MetaFree(void*) {}
void MetaZero(void*, size_t) {}

void HostMemmove(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memmove(dst, src, bytes);
}
void MetaCopy(void*, const void*, size_t) {}

DeviceAllocator g_allocators[kNumDevices] = {{HostAlloc, HostFree, HostZero, HostMemmove, HostMemmove, HostMemmove},
                                             {},
                                             {MetaAlloc, MetaFree, MetaZero, MetaCopy, MetaCopy, MetaCopy}};

const DeviceAllocator& AllocatorOf(Device d) {
  const DeviceAllocator& a = g_allocators[static_cast<int>(d)];
  if (!a.to_host) throw std::runtime_error("no allocator for the device (this build lacks its backend: --config=cuda)");
  return a;
}

// Allocations at least this large first check that the host has the memory: overcommit would otherwise grant them
// and the OOM killer end the process when the pages are touched. Smaller ones are not worth reading /proc for.
constexpr int64_t kCheckedAllocationBytes = int64_t{64} << 20;

// A number from a "Key:   123 kB" line of /proc/meminfo, in bytes; -1 if absent.
int64_t MeminfoBytes(const std::string& meminfo, const std::string& key) {
  const size_t at = meminfo.find("\n" + key + ":");
  if (at == std::string::npos) return -1;
  std::istringstream line(meminfo.substr(at + key.size() + 2, 64));
  int64_t kib = -1;
  line >> kib;
  return kib < 0 ? -1 : kib * 1024;
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// The cgroup v2 limit left to this process: memory.max - memory.current; -1 without a limit.
int64_t CgroupAvailableBytes() {
  const std::string self = ReadSmallFile("/proc/self/cgroup");  // "0::/some/path"
  const size_t at = self.find("0::");
  if (at == std::string::npos) return -1;
  std::string dir = self.substr(at + 3);
  dir = dir.substr(0, dir.find('\n'));
  const std::string base = absl::StrCat("/sys/fs/cgroup", dir == "/" ? "" : dir);
  int64_t max = 0, current = 0;
  std::string max_text = ReadSmallFile(base + "/memory.max"), current_text = ReadSmallFile(base + "/memory.current");
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(max_text), &max) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(current_text), &current))
    return -1;  // "max" (no limit) or no cgroup v2
  return max > current ? max - current : 0;
}

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

std::string AvailableText() {
  const int64_t available = HostAvailableBytes();
  return available < 0 ? "unknown" : absl::StrCat(available);
}

bool CacheOnFromEnvironment() {
  const char* v = std::getenv("SG_HOST_CACHE");
  if (!v || !*v || std::string_view(v) == "1") return !kAddressSanitizer;
  if (std::string_view(v) == "0") return false;
  std::fprintf(stderr, "error: SG_HOST_CACHE=%s: expected 0 (cache off) or 1 (on, the default)\n", v);
  std::exit(2);
}

// 64-byte alignment for SIMD and to keep tensors off each other's cache lines.
void* AlignedAlloc(size_t bytes) { return std::aligned_alloc(64, bytes); }

// The size class of a block of at least kHostCacheMinBytes: rounded up to an eighth of the power of two at or below
// it, so a class wastes at most 12.5% and a step's chunk tensors of nearby sizes share blocks.
size_t SizeClass(size_t bytes) {
  const int top = 63 - __builtin_clzll(bytes);
  const size_t step = size_t{1} << (top - 3);
  return (bytes + step - 1) / step * step;
}

class HostBlockCache {
 public:
  void* Allocate(size_t bytes) {
    const size_t size = SizeClass(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest cached block of this class up to twice it: memory already held beats evicting and faulting in.
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      void* p = it->second.back();
      const size_t got = it->first;
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      cached_ -= static_cast<int64_t>(got);
      low_cached_ = std::min(low_cached_, cached_);
      --cached_blocks_;
      ++hits_;
      HandOutLocked(p, got);
      return p;
    }
    // Blocks in use plus cached ones stay within the limit: evict (largest first) to make room for this one.
    const int64_t in_use_after = in_use_ + static_cast<int64_t>(size);
    evictions_ += FreeCachedLocked(std::max<int64_t>(0, LimitLocked(std::max(peak_, in_use_after)) - in_use_after));
    void* p = AlignedAlloc(size);
    if (!p && cached_ > 0) {  // what the cache holds may be what the allocator lacks
      evictions_ += FreeCachedLocked(0);
      p = AlignedAlloc(size);
    }
    if (!p) throw std::bad_alloc();
    ++misses_;
    HandOutLocked(p, size);
    return p;
  }

  // False when p did not come from Allocate.
  bool Deallocate(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_use_blocks_.find(p);
    if (it == in_use_blocks_.end()) return false;
    const size_t size = it->second;
    in_use_blocks_.erase(it);
    in_use_ -= static_cast<int64_t>(size);
    free_[size].push_back(p);
    cached_ += static_cast<int64_t>(size);
    ++cached_blocks_;
    return true;
  }

  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    FreeCachedLocked(0);
    peak_ = in_use_;
  }

  HostCacheStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    HostCacheStats s;
    s.cached_bytes = cached_;
    s.cached_blocks = cached_blocks_;
    s.in_use_bytes = in_use_;
    s.peak_in_use_bytes = peak_;
    s.limit_bytes = LimitLocked(peak_);
    s.hits = hits_;
    s.misses = misses_;
    s.evictions = evictions_;
    s.window_low_cached_bytes = low_cached_;
    return s;
  }

  void ResetWindow() {
    std::lock_guard<std::mutex> lock(mu_);
    low_cached_ = cached_;
  }

 private:
  // Room above the peak in use: with the limit at the peak itself, blocks of other classes and larger blocks reused
  // for smaller tensors make a bench-cpu step at T=4096 miss (and page-fault) ~30 blocks a round; with a quarter,
  // none (it settles at 1.14x).
  static int64_t LimitLocked(int64_t peak) { return peak + peak / 4; }

  void HandOutLocked(void* p, size_t size) {
    in_use_blocks_[p] = size;
    in_use_ += static_cast<int64_t>(size);
    peak_ = std::max(peak_, in_use_);
  }
  // Frees cached blocks, largest first, until at most `keep` bytes stay cached; returns how many it freed.
  int64_t FreeCachedLocked(int64_t keep) {
    int64_t freed = 0;
    for (; cached_ > keep; ++freed) {
      auto it = std::prev(free_.end());
      std::free(it->second.back());
      it->second.pop_back();
      cached_ -= static_cast<int64_t>(it->first);
      low_cached_ = std::min(low_cached_, cached_);
      --cached_blocks_;
      if (it->second.empty()) free_.erase(it);
    }
    return freed;
  }

  std::mutex mu_;
  std::unordered_map<void*, size_t> in_use_blocks_;  // handed-out blocks and their class sizes
  std::map<size_t, std::vector<void*>> free_;        // class size -> cached blocks
  int64_t in_use_ = 0, peak_ = 0, cached_ = 0, cached_blocks_ = 0, hits_ = 0, misses_ = 0, evictions_ = 0;
  int64_t low_cached_ = 0;  // the fewest cached bytes since ResetWindow
};

HostBlockCache& TheHostCache() {
  static HostBlockCache* cache = new HostBlockCache;  // never destroyed: tensors may be freed during static teardown
  return *cache;
}
}  // namespace

bool HostCacheEnabled() {
  static const bool on = CacheOnFromEnvironment();
  return on;
}

void* HostAllocate(size_t bytes) {
  const size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (rounded < bytes) throw std::bad_alloc();  // wrapped
  if (rounded >= kHostCacheMinBytes && HostCacheEnabled()) return TheHostCache().Allocate(rounded);
  void* p = AlignedAlloc(rounded);
  if (!p) throw std::bad_alloc();
  return p;
}

void HostDeallocate(void* p) {
  if (!p) return;
  if (HostCacheEnabled() && TheHostCache().Deallocate(p)) return;
  std::free(p);
}

HostCacheStats GetHostCacheStats() { return HostCacheEnabled() ? TheHostCache().Stats() : HostCacheStats{}; }

void ReleaseHostCache() {
  if (HostCacheEnabled()) TheHostCache().Release();
}

void ResetHostCacheWindow() {
  if (HostCacheEnabled()) TheHostCache().ResetWindow();
}

bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool CheckedAdd(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

absl::StatusOr<int64_t> CheckedNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor shape ", ShapeText(shape), " has a negative dimension"));
    if (!CheckedMul(n, d, &n))
      return absl::ResourceExhaustedError(absl::StrCat("tensor shape ", ShapeText(shape), " has more than 2^63 elements"));
  }
  return n;
}

absl::StatusOr<int64_t> CheckedBytes(DType dtype, const std::vector<int64_t>& shape) {
  absl::StatusOr<int64_t> n = CheckedNumel(shape);
  if (!n.ok()) return n;
  int64_t bytes = 0;
  if (!CheckedMul(*n, static_cast<int64_t>(DTypeSize(dtype)), &bytes) || !CheckedAdd(bytes, 63, &bytes))
    return absl::ResourceExhaustedError(absl::StrCat("tensor shape ", ShapeText(shape), " has more than 2^63 bytes"));
  return bytes - 63;
}

int64_t HostAvailableBytes() {
  const int64_t meminfo = MeminfoBytes("\n" + ReadSmallFile("/proc/meminfo"), "MemAvailable");
  const int64_t cgroup = CgroupAvailableBytes();
  if (meminfo < 0) return cgroup;
  return cgroup < 0 ? meminfo : std::min(meminfo, cgroup);
}

absl::Status StatusOfCurrentException(const std::string& op) {
  try {
    throw;
  } catch (const MemoryLimitExceeded& e) {
    return absl::ResourceExhaustedError(absl::StrCat(op, ": ", e.what()));
  } catch (const OutOfMemory& e) {
    return absl::ResourceExhaustedError(absl::StrCat(op, ": ", e.what()));
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat(op, ": out of memory (", e.what(), "; ", AvailableText(),
                                                     " bytes available)"));
  } catch (const std::system_error& e) {  // std::ios_base::failure among them
    const std::error_code& code = e.code();
    const bool is_errno = code.category() == std::generic_category() || code.category() == std::system_category();
    return absl::Status(is_errno ? io::ErrnoCode(code.value()) : absl::StatusCode::kInternal,
                        absl::StrCat(op, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(op, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(op, " failed: an exception of unknown type"));
  }
}

namespace {
[[noreturn]] void ThrowOutOfMemory(const std::string& what, int64_t bytes, MemCategory cat, Device device,
                                   int64_t available) {
  throw OutOfMemory(absl::StrCat("out of memory: ", what, " ", bytes, " bytes of ", MemCategoryName(cat), " asked on ",
                                 device == Device::kCPU ? "the host" : "the device", ", ",
                                 available < 0 ? std::string("unknown") : absl::StrCat(available),
                                 " bytes available"));
}
}  // namespace

void RegisterDeviceAllocator(Device d, DeviceAllocator a) { g_allocators[static_cast<int>(d)] = a; }

void MemoryTracker::Add(MemCategory c, int64_t bytes) {
  SpinGuard g(lock_);
  int64_t after = 0;
  if (!CheckedAdd(s_.total_current, bytes, &after))  // a plan of an absurd run on meta: refuse, never wrap
    throw OutOfMemory(absl::StrCat("out of memory: ", bytes, " bytes of ", MemCategoryName(c), " with ",
                                   s_.total_current, " in use overflow 64-bit byte counts"));
  if (limit_ > 0 && after > limit_)
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

MemoryTracker::~MemoryTracker() {
  if (device_ == Device::kCPU) ReleaseHostCache();
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
  absl::StatusOr<int64_t> checked = CheckedBytes(dtype, shape);
  if (!checked.ok()) throw OutOfMemory(absl::StrCat("out of memory: ", checked.status().message()));
  const int64_t bytes = *checked;
  if (device == Device::kCPU && bytes >= kCheckedAllocationBytes) {
    // Cached host blocks count as available: the cache frees them before it lets the process pass its peak.
    int64_t available = HostAvailableBytes();
    if (available >= 0) available += GetHostCacheStats().cached_bytes;
    if (available >= 0 && bytes > available)
      ThrowOutOfMemory(absl::StrCat("a tensor of shape ", ShapeText(shape), " needs"), bytes, cat, device, available);
  }
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.category_ = cat;
  t.numel_ = bytes / static_cast<int64_t>(DTypeSize(dtype));
  t.shape_ = std::move(shape);
  const DeviceAllocator& a = g_allocators[static_cast<int>(device)];
  if (!a.alloc)
    throw std::runtime_error("no allocator for the model's device (this build lacks its backend: --config=cuda)");
  if (tracker) tracker->Add(cat, bytes);  // first: over the limit, nothing is allocated
  void* p;
  try {
    p = a.alloc(static_cast<size_t>(bytes));
  } catch (const std::bad_alloc&) {
    if (tracker) tracker->Sub(cat, bytes);
    ThrowOutOfMemory("the allocator refused", bytes, cat, device, device == Device::kCPU ? HostAvailableBytes() : -1);
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

namespace {
std::atomic<int64_t> g_to_host{0}, g_from_host{0};
// A copy between host memory and a device's (meta memory holds nothing to copy).
bool CountsAsHostCopy(Device d, size_t bytes) { return bytes > 0 && d != Device::kMeta && !HostAddressable(d); }
}  // namespace

HostCopyCounts DeviceHostCopies() { return {g_to_host.load(), g_from_host.load()}; }

void CopyToHost(Device d, void* dst, const void* src, size_t bytes) {
  if (CountsAsHostCopy(d, bytes)) ++g_to_host;
  AllocatorOf(d).to_host(dst, src, bytes);
}
void CopyFromHost(Device d, void* dst, const void* src, size_t bytes) {
  if (CountsAsHostCopy(d, bytes)) ++g_from_host;
  AllocatorOf(d).from_host(dst, src, bytes);
}
void CopyOnDevice(Device d, void* dst, const void* src, size_t bytes) { AllocatorOf(d).on_device(dst, src, bytes); }
void CopyToHost(const Tensor& t, void* dst) {
  if (t.defined()) CopyToHost(t.device(), dst, t.raw(), t.nbytes());
}
void CopyFromHost(const Tensor& t, const void* src) {
  if (t.defined()) CopyFromHost(t.device(), t.raw(), src, t.nbytes());
}
void CopyTensor(const Tensor& dst, const Tensor& src) {
  if (dst.device() != src.device() || dst.nbytes() != src.nbytes())
    throw std::invalid_argument(absl::StrCat("CopyTensor: ", src.nbytes(), " bytes on device ",
                                             static_cast<int>(src.device()), " into ", dst.nbytes(),
                                             " bytes on device ", static_cast<int>(dst.device())));
  if (dst.defined()) CopyOnDevice(dst.device(), dst.raw(), src.raw(), dst.nbytes());
}
const void* HostBytes(const Tensor& t, std::vector<std::vector<char>>* copies) {
  if (HostAddressable(t.device())) return t.raw();
  copies->emplace_back(t.nbytes());
  CopyToHost(t, copies->back().data());
  return copies->back().data();
}

absl::Status FillFromHost(const Tensor& t, const std::function<absl::Status(void*)>& fill) {
  if (HostAddressable(t.device())) return fill(t.raw());
  std::vector<char> host(t.nbytes());
  if (absl::Status s = fill(host.data()); !s.ok()) return s;
  CopyFromHost(t, host.data());
  return absl::OkStatus();
}

absl::Status WithHostBytes(const Tensor& t, bool write_back, const std::function<absl::Status(void*)>& f) {
  if (HostAddressable(t.device())) return f(t.raw());
  std::vector<char> host(t.nbytes());
  CopyToHost(t, host.data());
  if (absl::Status s = f(host.data()); !s.ok()) return s;
  if (write_back) CopyFromHost(t, host.data());
  return absl::OkStatus();
}

void Tensor::SetZero() {
  if (storage_) g_allocators[static_cast<int>(device_)].memset_zero(storage_.get(), nbytes());
}

}  // namespace sg
