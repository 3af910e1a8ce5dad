// bf16 storage in device code (--dtype=bf16): bits as uint16_t, converted with base/dtype.h's rounding (to nearest
// even, NaN kept quiet). Kernels templated on a storage type S compute in Wide<S> (bf16 -> f32).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sg::cuda {

__device__ __forceinline__ uint16_t ToBf16(float f) {
  uint32_t u = static_cast<uint32_t>(__float_as_int(f));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float FromBf16(uint16_t b) {
  return __int_as_float(static_cast<int>(static_cast<uint32_t>(b) << 16));
}

template <typename S> struct WideOf { using type = S; };
template <> struct WideOf<uint16_t> { using type = float; };
template <typename S> using Wide = typename WideOf<S>::type;

__device__ __forceinline__ float Widen(uint16_t x) { return FromBf16(x); }
__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ double Widen(double x) { return x; }
__device__ __forceinline__ void Narrow(uint16_t* p, float v) { *p = ToBf16(v); }
__device__ __forceinline__ void Narrow(float* p, float v) { *p = v; }
__device__ __forceinline__ void Narrow(double* p, double v) { *p = v; }

}  // namespace sg::cuda
