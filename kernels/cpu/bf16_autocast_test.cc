// SG_BF16_MATMUL=autocast (set by this test's BUILD target): f32 activations x bf16 weights round the activations
// to bf16 and accumulate in fp32, as PyTorch's bf16 autocast does; every other type mix keeps GemmMixed's exact
// contract. Without bf16 instructions (or with SG_CPU_ISA below avx512_bf16) the f32 operand is never rounded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"
#include "kernels/cpu/isa.h"

namespace sg {
namespace {

using testing_fd::Random;

TEST(BF16AutocastTest, ActivationsTimesWeightsRoundTheActivations) {
  const bool bf16_units = cpu::ActiveIsa() >= cpu::Isa::kAvx512Bf16;
  const int64_t m = 600, n = 130, k = 520;  // m crosses the 256-row blocks; big enough for the bf16 matmul
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t lda = ta ? m : k, ldb = tb ? k : n;
      const std::vector<double> av = Random(m * k, 3), bv = Random(k * n, 4), cv = Random(m * n, 5);
      std::vector<float> a(av.begin(), av.end()), c(cv.begin(), cv.end());
      std::vector<uint16_t> b(k * n);
      for (int64_t i = 0; i < k * n; ++i) b[i] = F32ToBF16(static_cast<float>(bv[i]));
      const float alpha = 0.5f, beta = 0.25f;
      cpu::GemmMixed(ta, tb, m, n, k, alpha, DType::kF32, a.data(), lda, DType::kBF16, b.data(), ldb, beta,
                     DType::kF32, c.data(), n);
      // Against fp64 products of A rounded to bf16 (autocast) and of A as it is (exact contract).
      double worst_rounded = 0, worst_exact = 0, diff_rounded = 0, diff_exact = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double rounded = 0, exact = 0, mag = 0;
          for (int64_t p = 0; p < k; ++p) {
            const float x = a[ta ? p * lda + i : i * lda + p];
            const double y = BF16ToF32(b[tb ? j * ldb + p : p * ldb + j]);
            rounded += BF16ToF32(F32ToBF16(x)) * y;
            exact += x * y;
            mag += std::abs(x * y);
          }
          const double bound = 1e-6 * k * (mag + std::abs(cv[i * n + j]));
          const double c0 = static_cast<float>(cv[i * n + j]);
          const double dr = std::abs(c[i * n + j] - (alpha * rounded + beta * c0));
          const double dx = std::abs(c[i * n + j] - (alpha * exact + beta * c0));
          worst_rounded = std::max(worst_rounded, dr / bound);
          worst_exact = std::max(worst_exact, dx / bound);
          diff_rounded = std::max(diff_rounded, dr);
          diff_exact = std::max(diff_exact, dx);
        }
      if (bf16_units) {
        EXPECT_LE(worst_rounded, 1.0) << "ta " << ta << " tb " << tb;
        // Far nearer the rounded product than the exact one: the activations were rounded.
        EXPECT_LT(8 * diff_rounded, diff_exact) << "ta " << ta << " tb " << tb;
      } else {
        EXPECT_LE(worst_exact, 1.0) << "ta " << ta << " tb " << tb;
        EXPECT_LT(8 * diff_exact, diff_rounded) << "ta " << ta << " tb " << tb;
      }
    }
}

}  // namespace
}  // namespace sg
