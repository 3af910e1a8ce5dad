// exp over arrays in a form the compiler vectorizes (std::exp on float is a scalar libm call, and attention
// spends most of its time in it), and the other per-row loops of attention. f32: range reduction to r in
// [-ln2/2, ln2/2], a degree-6 polynomial for e^r (Cephes' minimax coefficients), 2^n from the exponent bits; max
// relative error ~2e-7. f64 keeps std::exp, the exactness reference.
//
// The row loops are compiled three times — AVX-512, AVX2 + FMA and the compiler's baseline — and RowOps() picks
// the build for ActiveIsa() (kernels/cpu/isa.h: the CPU's best, or lower with SG_CPU_ISA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/isa.h"

namespace sg::cpu {

inline float ExpF32(float x) {
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float lo = std::max(x, -87.0f);
  const float xc = std::min(lo, 88.0f);
  const float n = (xc * 1.44269504088896341f + kMagic) - kMagic;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // p * 2^n, assembled in the bits; below the underflow threshold the mask clears it to exactly 0.
  const int32_t keep = -static_cast<int32_t>(x >= -87.0f);
  int32_t scale_bits = (static_cast<int32_t>(n) + 127) << 23, bits;
  float scale, y;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  y = p * scale;
  std::memcpy(&bits, &y, sizeof bits);
  bits &= keep;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

// The f32 row loops of attention, one build per ISA.
struct RowOps {
  // max of x[0..n), n >= 1
  float (*max)(const float* x, int64_t n);
  // x[i] = exp(x[i] - shift)
  void (*exp_shifted)(float* x, int64_t n, float shift);
  // x[i] = exp(x[i] - shift); returns the sum of the new x
  float (*exp_shifted_sum)(float* x, int64_t n, float shift);
  // Softmax's backward through one row, from the scores s (in p) and dP: p[i] = exp(s[i] - lse), then
  // dp[i] = p[i] * (dp[i] - d), in one pass
  void (*softmax_backward)(float* p, float* dp, int64_t n, float lse, float d);
  // sum a[i] b[i]
  float (*dot)(const float* a, const float* b, int64_t n);
  // x[i] *= a
  void (*scale)(float* x, int64_t n, float a);
};

const RowOps& RowOpsFor(Isa isa);
inline const RowOps& ActiveRowOps() {
  static const RowOps& ops = RowOpsFor(ActiveIsa());
  return ops;
}

// x[i] = exp(x[i] - shift) for i < n, in the active ISA's build.
inline void ExpShifted(float* x, int64_t n, float shift) { ActiveRowOps().exp_shifted(x, n, shift); }
inline void ExpShifted(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

}  // namespace sg::cpu
