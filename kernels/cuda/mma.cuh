// One warp's tensor-core multiply-accumulate, D[16 x 8] += A[16 x 16] B[16 x 8] with bf16 A and B and f32 D
// (PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80 and later), and the loads of its fragments from
// shared memory (ldmatrix). Under the CPU emulation both are sg_emu's (emulation/include/sg_emu_mma.h), which
// implement the same lane layouts.
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

// Two floats rounded to bf16 in one register, lo in the low half.
__device__ __forceinline__ uint32_t PackF(float lo, float hi) {
  return static_cast<uint32_t>(ToBf16(lo)) | (static_cast<uint32_t>(ToBf16(hi)) << 16);
}

__device__ __forceinline__ int LaneGroup() { return (threadIdx.x & 31) >> 2; }  // g
__device__ __forceinline__ int LaneInGroup() { return threadIdx.x & 3; }        // t

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 bf16 matrices from shared memory for one warp. Lane
// 8i + r gives the (16-byte aligned) address of row r of matrix i; lane 4g + t receives in m[i] matrix i's
// (row g, columns 2t, 2t + 1), or transposed (kTrans) its (rows 2t, 2t + 1, column g).
template <bool kTrans>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&m)[4], const uint16_t* row) {
#ifdef __CUDACC__
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "r"(addr));
#else
  sg_emu::LdMatrixX4(m, row, kTrans);
#endif
}

// Fragments from bf16 tiles in shared memory (row stride ld, a multiple of 8; p 16-byte aligned). The 8 x 8
// matrices are chosen so that the lane layout ldmatrix delivers is the mma's.
// A = the 16 x 16 block at p of a row-major tile: matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15) -> a[0..3].
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint16_t* p, int ld) {
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
  LdMatrixX4<false>(a, p + (r + 8 * (i & 1)) * ld + 8 * (i >> 1));
}
// The B fragments b[j] of n-tiles j = 0, 1 (n in [8j, 8j + 8)) over k in [0, 16), with B(k, n) = p[n * ld + k]:
// each column contiguous (rows of K for Q K^T). An 8 x 8 matrix of rows n, columns k gives lane (g, t) exactly
// B(2t, g), B(2t + 1, g).
__device__ __forceinline__ void LoadBT2(uint32_t (&b)[2][2], const uint16_t* p, int ld) {
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
  uint32_t m[4];
  LdMatrixX4<false>(m, p + (r + 8 * (i >> 1)) * ld + 8 * (i & 1));
  b[0][0] = m[0], b[0][1] = m[1], b[1][0] = m[2], b[1][1] = m[3];
}
// The same with B(k, n) = p[k * ld + n]: rows contiguous (V for P V), read transposed.
__device__ __forceinline__ void LoadB2(uint32_t (&b)[2][2], const uint16_t* p, int ld) {
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
  uint32_t m[4];
  LdMatrixX4<true>(m, p + (r + 8 * (i & 1)) * ld + 8 * (i >> 1));
  b[0][0] = m[0], b[0][1] = m[1], b[1][0] = m[2], b[1][1] = m[3];
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
