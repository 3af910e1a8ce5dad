#include "base/host_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sg {

namespace {
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

}  // namespace sg
