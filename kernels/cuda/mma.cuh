// One warp's tensor-core multiply-accumulate, D[16 x 8] += A[16 x 16] B[16 x 8] with bf16 A and B and f32 D
// (PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80 and later), the bf16 conversions around it, and
// the loads of its fragments from shared memory. Under the CPU emulation the mma is sg_emu::MmaM16N8K16Bf16
// (emulation/include/sg_emu_mma.h), which reads the same fragments.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with g = lane / 4 and
// t = lane % 4; a 32-bit register holds two bf16, the lower-indexed element in the low half:
//   A (row major, 16 x 16): a[0] = A(g, 2t..2t+1)  a[1] = A(g+8, 2t..2t+1)  a[2] = A(g, 2t+8..)  a[3] = A(g+8, 2t+8..)
//   B (16 x 8, k x n):      b[0] = B(2t..2t+1, g)  b[1] = B(2t+8..2t+9, g)
//   C, D (16 x 8, f32):     c[0], c[1] = C(g, 2t), C(g, 2t+1)  c[2], c[3] = C(g+8, 2t), C(g+8, 2t+1)
// So the C fragments of two neighbouring n-tiles are, rounded to bf16, the A fragment of the next product (P of
// attention becomes the A operand of P V without going through shared memory): see AFromC.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/bf16.cuh"

#ifndef __CUDACC__
#include "sg_emu_mma.h"
#endif

namespace sg::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "bf16 mma.sync needs sm_80 or later"
#endif

// d += a b for one warp; every lane of the warp must call it (.sync.aligned).
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef __CUDACC__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  sg_emu::MmaM16N8K16Bf16(d, a, b);
#endif
}

__device__ __forceinline__ uint32_t Pack(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
__device__ __forceinline__ uint32_t PackF(float lo, float hi) { return Pack(ToBf16(lo), ToBf16(hi)); }

// Two adjacent bf16 at p (4-byte aligned).
__device__ __forceinline__ uint32_t Load2(const uint16_t* p) {
#ifdef __CUDACC__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

__device__ __forceinline__ int LaneGroup() { return (threadIdx.x & 31) >> 2; }     // g
__device__ __forceinline__ int LaneInGroup() { return threadIdx.x & 3; }           // t

// A = the 16 x 16 block at p of a row-major bf16 tile with row stride ld (even).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint16_t* p, int ld) {
  const int g = LaneGroup(), t = LaneInGroup();
  a[0] = Load2(p + g * ld + 2 * t);
  a[1] = Load2(p + (g + 8) * ld + 2 * t);
  a[2] = Load2(p + g * ld + 2 * t + 8);
  a[3] = Load2(p + (g + 8) * ld + 2 * t + 8);
}
// B(k, n) = p[n * ld + k]: the n-th column contiguous (rows of K for Q K^T).
__device__ __forceinline__ void LoadBT(uint32_t (&b)[2], const uint16_t* p, int ld) {
  const int g = LaneGroup(), t = LaneInGroup();
  b[0] = Load2(p + g * ld + 2 * t);
  b[1] = Load2(p + g * ld + 2 * t + 8);
}
// B(k, n) = p[k * ld + n]: rows contiguous (V for P V).
__device__ __forceinline__ void LoadB(uint32_t (&b)[2], const uint16_t* p, int ld) {
  const int g = LaneGroup(), t = LaneInGroup();
  b[0] = Pack(p[2 * t * ld + g], p[(2 * t + 1) * ld + g]);
  b[1] = Pack(p[(2 * t + 8) * ld + g], p[(2 * t + 9) * ld + g]);
}
// The A fragment of columns [16 kk, 16 kk + 16) of a 16-row f32 accumulator held as C fragments c[n-tile][4],
// rounded to bf16.
template <int NT>
__device__ __forceinline__ void AFromC(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
  a[0] = PackF(c[2 * kk][0], c[2 * kk][1]);
  a[1] = PackF(c[2 * kk][2], c[2 * kk][3]);
  a[2] = PackF(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = PackF(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

}  // namespace sg::cuda
