#include "kernels/cpu/vexp.h"

namespace sg::cpu {

__attribute__((target_clones("arch=haswell", "default"))) void ExpShifted(float* x, int64_t n, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = ExpF32(x[i] - shift);
}

}  // namespace sg::cpu
