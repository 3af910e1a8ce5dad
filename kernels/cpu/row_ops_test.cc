// Every ISA build of attention's row loops (vexp.h) against double-precision references, on lengths that cover the
// vector widths' remainders; and the ISA choice follows SG_CPU_ISA.
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/vexp.h"

namespace sg::cpu {
namespace {

std::vector<Isa> BuildsThisCpuRuns() {
  std::vector<Isa> out = {Isa::kGeneric};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back(Isa::kAvx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    out.push_back(Isa::kAvx512);
  return out;
}

std::vector<float> Random(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(RowOpsTest, EveryBuildMatchesDoubleReference) {
  for (Isa isa : BuildsThisCpuRuns()) {
    const RowOps& ops = RowOpsFor(isa);
    for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 64, 255, 256, 1000}) {
      SCOPED_TRACE(std::string(IsaName(isa)) + " n=" + std::to_string(n));
      const std::vector<float> x = Random(n, 3 + n, -30.0f, 5.0f), y = Random(n, 5 + n, -2.0f, 2.0f);
      double max = x[0], dot = 0;
      for (int64_t i = 0; i < n; ++i) {
        max = std::max(max, static_cast<double>(x[i]));
        dot += static_cast<double>(x[i]) * y[i];
      }
      EXPECT_EQ(ops.max(x.data(), n), static_cast<float>(max));
      double mag = 0;
      for (int64_t i = 0; i < n; ++i) mag += std::abs(static_cast<double>(x[i]) * y[i]);
      EXPECT_NEAR(ops.dot(x.data(), y.data(), n), dot, 1e-6 * mag);

      const float shift = 1.25f;
      std::vector<float> e = x, es = x;
      ops.exp_shifted(e.data(), n, shift);
      const float sum = ops.exp_shifted_sum(es.data(), n, shift);
      double ref_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double ref = std::exp(static_cast<double>(x[i] - shift));  // the kernels subtract in float
        ref_sum += ref;
        EXPECT_NEAR(e[i], ref, 4e-7 * ref) << i;
        EXPECT_EQ(es[i], e[i]) << i;  // the same exp, summed on the way
      }
      EXPECT_NEAR(sum, ref_sum, 1e-6 * ref_sum);

      std::vector<float> dp = y, p = x;
      ops.softmax_backward(p.data(), dp.data(), n, shift, 0.5f);
      std::vector<float> s = y;
      ops.scale(s.data(), n, -3.0f);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(p[i], e[i]) << i;
        EXPECT_FLOAT_EQ(dp[i], e[i] * (y[i] - 0.5f)) << i;
        EXPECT_EQ(s[i], y[i] * -3.0f) << i;
      }
    }
  }
}

// The vectorized exp at the edges softmax feeds it: 0 below the underflow threshold, finite up to 88.
TEST(RowOpsTest, ExpEdgesInEveryBuild) {
  for (Isa isa : BuildsThisCpuRuns()) {
    std::vector<float> x = {-1000.0f, -87.5f, -87.0f, 0.0f, 88.0f, -0.0f, 1e-30f};
    ActiveRowOps();  // the active build is one of these
    RowOpsFor(isa).exp_shifted(x.data(), static_cast<int64_t>(x.size()), 0.0f);
    EXPECT_EQ(x[0], 0.0f) << IsaName(isa);
    EXPECT_EQ(x[1], 0.0f) << IsaName(isa);
    EXPECT_GT(x[2], 0.0f) << IsaName(isa);
    EXPECT_EQ(x[3], 1.0f) << IsaName(isa);
    EXPECT_TRUE(std::isfinite(x[4])) << IsaName(isa);
    EXPECT_EQ(x[5], 1.0f) << IsaName(isa);
    EXPECT_EQ(x[6], 1.0f) << IsaName(isa);
  }
}

// SG_CPU_ISA caps the level (the test targets set it: see BUILD); without it, the CPU's best.
TEST(RowOpsTest, ActiveIsaFollowsEnvironment) {
  const char* want = std::getenv("SG_CPU_ISA");
  const Isa best = BuildsThisCpuRuns().back();
  if (!want) {
    EXPECT_GE(ActiveIsa(), best);
  } else {
    EXPECT_EQ(std::string(IsaName(ActiveIsa())),
              std::string(want) == "avx512" && best < Isa::kAvx512 ? IsaName(best) : want);
  }
}

}  // namespace
}  // namespace sg::cpu
