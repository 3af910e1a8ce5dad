// The host memory of CPU tensors: aligned blocks, the larger ones cached for reuse.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg {

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
  int64_t cached_bytes = 0, cached_blocks = 0;      // free blocks the cache holds
  int64_t in_use_bytes = 0, peak_in_use_bytes = 0;  // blocks of cacheable size handed out (size classes' bytes)
  int64_t limit_bytes = 0;                          // in use + cached stay within this: 1.25x peak_in_use_bytes
  int64_t hits = 0, misses = 0;                     // allocations of cacheable size served from the cache / by malloc
  int64_t evictions = 0;                            // cached blocks freed to stay within the bound
  // The fewest cached bytes since ResetHostCacheWindow: cached_bytes then minus this is what the window took from
  // the cache (resident memory that a process RSS delta does not show, e.g. a benchmark step's).
  int64_t window_low_cached_bytes = 0;
};
HostCacheStats GetHostCacheStats();
// Frees every cached block and restarts the peak from the blocks in use (e.g. when a model is destroyed).
void ReleaseHostCache();
void ResetHostCacheWindow();

}  // namespace sg
