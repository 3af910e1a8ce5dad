// LoRA's dropout mask (core/lora.h) as a counter-based hash: element (position, feature) of a module's adapter
// input is kept when a hash of (seed, module, position, feature), as a uniform number in [0, 1), is >= p. Pure
// integer arithmetic, so host code, the CPU kernels and the CUDA kernels draw the same mask bit for bit, whatever
// the chunking, the threads or the device.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define SG_HOST_DEVICE __host__ __device__
#else
#define SG_HOST_DEVICE
#endif

namespace sg {

SG_HOST_DEVICE inline uint64_t LoraMix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
SG_HOST_DEVICE inline uint64_t LoraRowKey(uint64_t seed, uint64_t module, int64_t position) {
  return LoraMix(LoraMix(LoraMix(seed ^ 0x4C6F524144726F70ull) + module) + static_cast<uint64_t>(position));
}
SG_HOST_DEVICE inline bool LoraKeep(uint64_t row_key, int64_t feature, double p) {
  const uint64_t h = LoraMix(row_key + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(feature + 1));
  return static_cast<double>(h >> 11) * 0x1.0p-53 >= p;
}

}  // namespace sg
