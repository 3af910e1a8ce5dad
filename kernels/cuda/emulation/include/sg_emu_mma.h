// The tensor-core instructions the CUDA backend uses, on the CPU emulation (kernels/cuda/mma.cuh calls them in
// place of its inline PTX).
//
// PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, D = A B + C for one warp, with the operands spread over
// the lanes' registers exactly as the PTX ISA lays them out ("Matrix Fragments for mma.m16n8k16 with floating point
// type"; g = lane / 4, t = lane % 4, two bf16 per 32-bit register, the lower-indexed one in the low half):
//   A (16 x 16, row):  register r of lane 4g + t holds A(g + 8 (r & 1), 2t + 8 (r >> 1) + {0, 1})
//   B (16 x 8, col):   register r of lane 4g + t holds B(2t + 8 r + {0, 1}, g)
//   C, D (16 x 8):     element i of lane 4g + t is C(g + 8 (i >> 1), 2t + (i & 1))
// Each lane posts its A and B registers, the warp meets at a barrier (so a lane that skips the mma is a reported
// warp error, as .aligned requires), every lane computes its D elements from the other lanes' registers, and the
// warp meets again before the registers can be posted over. Products of bf16 are exact in f32; each D element is
// their sum plus C, rounded once to f32 (the hardware rounds its internal sums in its own order: results differ
// by f32 rounding only).
//
// PTX ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA, "ldmatrix"): lane 8i + r gives the address of row
// r of 8 x 8 matrix i; lane 4g + t receives in register i matrix i's elements (g, 2t) and (g, 2t + 1), or with
// .trans (2t, g) and (2t + 1, g). A row address that is not 16-byte aligned is a kernel error, as on a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "sg_emu.h"

namespace sg_emu {

namespace mma_internal {

struct Fragments {
  uint32_t a[4];
  uint32_t b[2];
};

inline float Bf16(uint32_t reg, int half) {
  const uint32_t bits = (reg >> (16 * half)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A(row, col) and B(k, n) from the posted registers of one warp, by the layouts above.
inline float A(const Fragments* warp, int row, int col) {
  const int lane = 4 * (row % 8) + (col % 8) / 2;
  const int reg = (row / 8) + 2 * (col / 8);
  return Bf16(warp[lane].a[reg], col % 2);
}
inline float B(const Fragments* warp, int k, int n) {
  const int lane = 4 * n + (k % 8) / 2;
  return Bf16(warp[lane].b[k / 8], k % 2);
}

}  // namespace mma_internal

inline void MmaM16N8K16Bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  using mma_internal::Fragments;
  // Blocks run one at a time on a host thread, so one slot per (warp, lane) of a block suffices.
  static thread_local Fragments posted[32][32];
  const int thread = LinearThread(), lane = thread & 31;
  Fragments* warp = posted[thread >> 5];
  std::memcpy(warp[lane].a, a, sizeof(warp[lane].a));
  std::memcpy(warp[lane].b, b, sizeof(warp[lane].b));
  int dummy = 0;
  WarpExchange(0xffffffffu, &dummy, sizeof(dummy), -1, "mma.sync.m16n8k16");
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double acc = d[i];
    for (int k = 0; k < 16; ++k)
      acc += static_cast<double>(mma_internal::A(warp, row, k)) * mma_internal::B(warp, k, col);
    d[i] = static_cast<float>(acc);
  }
  WarpExchange(0xffffffffu, &dummy, sizeof(dummy), -1, "mma.sync.m16n8k16");
}

inline void LdMatrixX4(uint32_t (&m)[4], const uint16_t* row, bool trans) {
  static thread_local const uint16_t* posted[32][32];  // per (warp, lane) of the running block
  const int thread = LinearThread(), lane = thread & 31;
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) DeviceError("ldmatrix: a row address is not 16-byte aligned");
  const uint16_t** warp = posted[thread >> 5];
  warp[lane] = row;
  int dummy = 0;
  WarpExchange(0xffffffffu, &dummy, sizeof(dummy), -1, "ldmatrix.sync.m8n8.x4");
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = trans ? warp[8 * i + 2 * t][g] : warp[8 * i + g][2 * t];
    const uint16_t hi = trans ? warp[8 * i + 2 * t + 1][g] : warp[8 * i + g][2 * t + 1];
    m[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  WarpExchange(0xffffffffu, &dummy, sizeof(dummy), -1, "ldmatrix.sync.m8n8.x4");
}

}  // namespace sg_emu
