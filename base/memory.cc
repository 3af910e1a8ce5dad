#include "base/memory.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <ios>
#include <new>
#include <sstream>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/checked.h"
#include "base/errno_status.h"
#include "base/host_cache.h"

namespace sg {

const char* MemCategoryName(MemCategory c) {
  static constexpr const char* kNames[] = {"weights", "grads",  "optimizer", "activations",   "kv_cache",
                                           "kv_grad", "logits", "workspace", "master_weights"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kNumMemCategories, "name every category");
  int i = static_cast<int>(c);
  return i >= 0 && i < kNumMemCategories ? kNames[i] : "?";
}

namespace {
struct SpinGuard {
  explicit SpinGuard(std::atomic_flag& f) : f_(f) {
    while (f_.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~SpinGuard() { f_.clear(std::memory_order_release); }
  std::atomic_flag& f_;
};

void* HostAlloc(size_t bytes) { return HostAllocate(bytes); }
void HostFree(void* p) { HostDeallocate(p); }
void HostZero(void* p, size_t bytes) { std::memset(p, 0, bytes); }

// Meta tensors own no memory (base/dtype.h's MetaAddress); the meta op table never dereferences them.
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

std::string AvailableText() {
  const int64_t available = HostAvailableBytes();
  return available < 0 ? "unknown" : absl::StrCat(available);
}

}  // namespace

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
    return absl::ResourceExhaustedError(
        absl::StrCat(op, ": out of memory (", e.what(), "; ", AvailableText(), " bytes available)"));
  } catch (const std::system_error& e) {  // std::ios_base::failure among them
    const std::error_code& code = e.code();
    const bool is_errno = code.category() == std::generic_category() || code.category() == std::system_category();
    return absl::Status(is_errno ? ErrnoCode(code.value()) : absl::StatusCode::kInternal,
                        absl::StrCat(op, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(op, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(op, " failed: an exception of unknown type"));
  }
}

void RegisterDeviceAllocator(Device d, DeviceAllocator a) { g_allocators[static_cast<int>(d)] = a; }

const DeviceAllocator& DeviceAllocatorOf(Device d) { return g_allocators[static_cast<int>(d)]; }

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

}  // namespace sg
