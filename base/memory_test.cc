// The host block cache under the CPU allocator (base/host_cache.h): reuse per size class, its bound, release, threads,
// zeroing of reused blocks, exact category counts, and SG_HOST_CACHE=0 (memory_cache_off_test runs this file so).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "base/host_cache.h"
#include "base/tensor.h"

namespace sg {
namespace {

bool TurnedOffByEnvironment() {
  const char* v = std::getenv("SG_HOST_CACHE");
  return v && std::string_view(v) == "0";
}

constexpr size_t kMiB = size_t{1} << 20;

TEST(HostCache, OnUnlessTurnedOffOrUnderAsan) {
  EXPECT_EQ(HostCacheEnabled(), !TurnedOffByEnvironment() && !kAddressSanitizer);
}

TEST(HostCache, RejectsABadSetting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: the setting is read once
  EXPECT_EXIT(
      {
        setenv("SG_HOST_CACHE", "yes", 1);
        HostCacheEnabled();
      },
      ::testing::ExitedWithCode(2), "SG_HOST_CACHE=yes: expected 0");
}

// Blocks go back to malloc: nothing is cached, nothing counted; tensors still zero and count as before.
TEST(HostCacheOff, FreedBlocksAreNotKept) {
  if (HostCacheEnabled()) GTEST_SKIP() << "cache on";
  void* p = HostAllocate(2 * kMiB);
  std::memset(p, 0xAB, 2 * kMiB);
  HostDeallocate(p);
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.hits + s.misses, 0);
  MemoryTracker tracker;
  Tensor z = Tensor::Zeros(&tracker, MemCategory::kActivations, DType::kF32, {300000});
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data<float>()[i], 0.0f) << i;
  EXPECT_EQ(tracker.Snapshot().current[static_cast<int>(MemCategory::kActivations)], 1200000);
}

class HostCacheOn : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HostCacheEnabled()) GTEST_SKIP() << "cache off (SG_HOST_CACHE=0 or an ASan build)";
    ReleaseHostCache();
  }
  void TearDown() override { ReleaseHostCache(); }
};

TEST_F(HostCacheOn, SameSizeClassGetsTheFreedBlockBack) {
  const HostCacheStats before = GetHostCacheStats();
  void* p = HostAllocate(kMiB);
  HostDeallocate(p);
  HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(kMiB));
  EXPECT_EQ(s.cached_blocks, 1);
  void* q = HostAllocate(kMiB - 4096);  // a smaller size of the same class (1 MiB in steps of 128 KiB)
  EXPECT_EQ(q, p);
  s = GetHostCacheStats();
  EXPECT_EQ(s.hits, before.hits + 1);
  EXPECT_EQ(s.misses, before.misses + 1);
  EXPECT_EQ(s.cached_bytes, 0);
  HostDeallocate(q);
}

TEST_F(HostCacheOn, ABlockUpToTwiceTheClassServesIt) {
  const HostCacheStats before = GetHostCacheStats();
  void* p = HostAllocate(kMiB);
  HostDeallocate(p);
  void* half = HostAllocate(kMiB / 2);
  EXPECT_EQ(half, p);
  HostDeallocate(half);
  void* quarter = HostAllocate(kMiB / 4 + 64);  // 1 MiB is more than twice its class: a fresh block
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.misses, before.misses + 2);
  EXPECT_EQ(s.hits, before.hits + 1);
  HostDeallocate(quarter);
}

TEST_F(HostCacheOn, SmallBlocksGoStraightToMalloc) {
  const HostCacheStats before = GetHostCacheStats();
  void* p = HostAllocate(kHostCacheMinBytes - 64);
  HostDeallocate(p);
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, before.cached_bytes);
  EXPECT_EQ(s.hits + s.misses, before.hits + before.misses);
}

TEST_F(HostCacheOn, HeldPlusCachedStayWithinTheLimit) {
  const int64_t evictions = GetHostCacheStats().evictions;
  void* a = HostAllocate(4 * kMiB);
  void* b = HostAllocate(4 * kMiB);
  HostDeallocate(a);
  HostDeallocate(b);
  HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.limit_bytes, static_cast<int64_t>(10 * kMiB));  // 1.25x the peak in use
  void* c = HostAllocate(16 * kMiB);  // 16 in use + 8 cached pass 1.25 x 16: one cached block is freed
  s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(s.evictions, evictions + 1);
  HostDeallocate(c);
  ReleaseHostCache();
  void* e = HostAllocate(4 * kMiB);
  HostDeallocate(e);
  void* f = HostAllocate(8 * kMiB);  // 8 + 4 pass 1.25 x 8: the cached block is freed first
  s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.evictions, evictions + 2);
  HostDeallocate(f);

  std::mt19937 rng(7);
  std::vector<void*> held;
  for (int i = 0; i < 2000; ++i) {
    if (held.empty() || (rng() % 2 == 0 && held.size() < 12)) {
      held.push_back(HostAllocate(kHostCacheMinBytes + rng() % (6 * kMiB)));
    } else {
      const size_t k = rng() % held.size();
      HostDeallocate(held[k]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
    }
    s = GetHostCacheStats();
    ASSERT_LE(s.in_use_bytes + s.cached_bytes, s.limit_bytes) << "step " << i;
  }
  for (void* p : held) HostDeallocate(p);
  EXPECT_GT(GetHostCacheStats().hits, 0);
}

TEST_F(HostCacheOn, ReleaseFreesEverythingCached) {
  void* kept = HostAllocate(kMiB);
  std::vector<void*> blocks;
  for (size_t n : {kMiB, 3 * kMiB, 9 * kMiB}) blocks.push_back(HostAllocate(n));
  for (void* p : blocks) HostDeallocate(p);
  EXPECT_EQ(GetHostCacheStats().cached_blocks, 3);
  ReleaseHostCache();
  HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.cached_blocks, 0);
  EXPECT_EQ(s.in_use_bytes, static_cast<int64_t>(kMiB));  // blocks in use are not touched
  EXPECT_EQ(s.peak_in_use_bytes, s.in_use_bytes);
  const int64_t misses = s.misses;
  void* again = HostAllocate(3 * kMiB);
  EXPECT_EQ(GetHostCacheStats().misses, misses + 1);
  HostDeallocate(again);
  HostDeallocate(kept);
}

// Threads allocate, fill, check and free blocks of many classes: a block handed to two owners at once, or lost,
// shows as a changed fill or as bytes left in use.
TEST_F(HostCacheOn, ThreadsShareTheCache) {
  const int64_t in_use = GetHostCacheStats().in_use_bytes;
  std::vector<std::thread> threads;
  std::vector<int> corrupted(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &corrupted] {
      std::mt19937 rng(100 + t);
      std::vector<std::pair<unsigned char*, size_t>> held;
      for (int i = 0; i < 400; ++i) {
        if (held.size() < 4 && (held.empty() || rng() % 2 == 0)) {
          const size_t n = kHostCacheMinBytes + rng() % (2 * kMiB);
          auto* p = static_cast<unsigned char*>(HostAllocate(n));
          std::memset(p, t + 1, n);
          held.emplace_back(p, n);
        } else {
          auto [p, n] = held.back();
          held.pop_back();
          for (size_t j = 0; j < n; j += 4096) corrupted[t] += p[j] != t + 1;
          corrupted[t] += p[n - 1] != t + 1;
          HostDeallocate(p);
        }
      }
      for (auto [p, n] : held) HostDeallocate(p);
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(corrupted[t], 0) << "thread " << t;
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.in_use_bytes, in_use);
  EXPECT_GT(s.hits, 0);
  EXPECT_LE(s.in_use_bytes + s.cached_bytes, s.limit_bytes);
}

// Tensor::Zeros on a reused dirty block is zero, and the categories count the tensor's bytes, not its class's.
TEST_F(HostCacheOn, ReusedBlocksAreZeroedAndCountedAsTensorBytes) {
  MemoryTracker tracker;
  const int act = static_cast<int>(MemCategory::kActivations);
  Tensor dirty = Tensor::Empty(&tracker, MemCategory::kActivations, DType::kF32, {300000});  // 1200000 bytes
  std::memset(dirty.raw(), 0xFF, dirty.nbytes());
  void* block = dirty.raw();
  EXPECT_EQ(tracker.Snapshot().current[act], 1200000);
  dirty.Reset();
  EXPECT_EQ(tracker.Snapshot().current[act], 0);
  EXPECT_EQ(GetHostCacheStats().cached_bytes, 1310720);  // the class: 1 MiB + 2 × 128 KiB

  Tensor z = Tensor::Zeros(&tracker, MemCategory::kActivations, DType::kF32, {290000});
  ASSERT_EQ(z.raw(), block);
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data<float>()[i], 0.0f) << i;
  const MemorySnapshot m = tracker.Snapshot();
  EXPECT_EQ(m.current[act], 1160000);
  EXPECT_EQ(m.peak[act], 1200000);
  EXPECT_EQ(m.total_current, 1160000);
}

// A model's memory goes back to the system when the model ends: its CPU tracker's end empties the cache; a meta
// tracker's (a plan's twin) leaves it alone.
TEST_F(HostCacheOn, CpuTrackerEndReleasesTheCache) {
  {
    MemoryTracker meta;
    meta.set_device(Device::kMeta);
    HostDeallocate(HostAllocate(kMiB));
  }
  EXPECT_EQ(GetHostCacheStats().cached_bytes, static_cast<int64_t>(kMiB));
  {
    MemoryTracker model;
    Tensor t = Tensor::Empty(&model, MemCategory::kWeights, DType::kF32, {1 << 20});
  }
  EXPECT_EQ(GetHostCacheStats().cached_bytes, 0);
}

// The window's low-water mark of cached bytes: what a step took from the cache, though it gave it all back.
TEST_F(HostCacheOn, WindowRecordsWhatWasTakenFromTheCache) {
  HostDeallocate(HostAllocate(kMiB));
  HostDeallocate(HostAllocate(4 * kMiB));
  ResetHostCacheWindow();
  EXPECT_EQ(GetHostCacheStats().window_low_cached_bytes, static_cast<int64_t>(5 * kMiB));
  void* p = HostAllocate(4 * kMiB);
  HostDeallocate(p);
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(5 * kMiB));
  EXPECT_EQ(s.window_low_cached_bytes, static_cast<int64_t>(kMiB));
}

}  // namespace
}  // namespace sg
