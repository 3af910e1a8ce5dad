#include "kernels/cpu/vexp.h"

namespace sg::cpu {
namespace {

// The same loop compiled twice; the AVX2 + FMA build (8 lanes) is chosen at run time where the CPU has them.
// (target_clones("arch=haswell") would dispatch on the CPU model, not its features, and miss newer CPUs.)
__attribute__((target("avx2,fma"))) void ExpShiftedAvx2(float* x, int64_t n, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = ExpF32(x[i] - shift);
}

void ExpShiftedBase(float* x, int64_t n, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = ExpF32(x[i] - shift);
}

}  // namespace

void ExpShifted(float* x, int64_t n, float shift) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  (avx2 ? ExpShiftedAvx2 : ExpShiftedBase)(x, n, shift);
}

}  // namespace sg::cpu
