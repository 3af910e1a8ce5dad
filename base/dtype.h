// Element types and devices shared by every layer of the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace sg {

enum class DType : int { kF32 = 0, kF64 = 1, kBF16 = 2, kF16 = 3, kI32 = 4, kI64 = 5 };
// kMeta: tensors with shapes and byte accounting but no storage, ops that do nothing (kernels/meta): the engine
// walks a run's exact allocation schedule without computing anything (core/plan.h).
enum class Device : int { kCPU = 0, kCUDA = 1, kMeta = 2 };
constexpr int kNumDevices = 3;
// Where every meta tensor and offload buffer "lives": a non-canonical address on x86-64 and AArch64 (bits 48-63
// neither all 0 nor all 1), so a host read or write faults at once instead of touching memory. Offsets added to it
// (rows, pages) stay in that hole for anything below 2^48 bytes.
inline void* MetaAddress() { return reinterpret_cast<void*>(uintptr_t{0xdead} << 48); }

inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

// bf16 / f16 <-> f32 conversions (round-to-nearest-even on the way down).
inline float BF16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t F32ToBF16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

}  // namespace sg
