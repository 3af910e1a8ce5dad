// bf16 storage kernels: rounding, the mixed f32/bf16 GEMM against an fp64 product of the same (rounded) inputs,
// and AdamW on fp32 master weights rounded into bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"

namespace sg {
namespace {

using testing_fd::Random;
using testing_fd::Vec;

TEST(BF16Test, RoundsToNearestEven) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0); just above goes up.
  EXPECT_EQ(F32ToBF16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(F32ToBF16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(F32ToBF16(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::nanf("")))));
  EXPECT_EQ(BF16ToF32(F32ToBF16(-INFINITY)), -INFINITY);
  std::vector<float> x = {0.1f, -3.3f, 65504.0f, 1e-30f}, y(4);
  std::vector<uint16_t> h(4);
  cpu::F32ToBF16Row(x.data(), 4, h.data());
  cpu::BF16ToF32Row(h.data(), 4, y.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(h[i], F32ToBF16(x[i]));
    EXPECT_LE(std::abs(y[i] - x[i]), std::abs(x[i]) * 0x1p-8f) << x[i];
  }
}

// A matrix held as f32 or bf16, with its values as doubles (after rounding) for the reference.
struct Held {
  DType type;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Vec exact;
  Held(DType t, const Vec& v) : type(t), exact(v.size()) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (t == DType::kBF16) {
        h.push_back(F32ToBF16(static_cast<float>(v[i])));
        exact[i] = BF16ToF32(h.back());
      } else {
        f.push_back(static_cast<float>(v[i]));
        exact[i] = f.back();
      }
    }
  }
  void* data() { return type == DType::kBF16 ? static_cast<void*>(h.data()) : static_cast<void*>(f.data()); }
  double at(size_t i) const { return type == DType::kBF16 ? BF16ToF32(h[i]) : f[i]; }
};

// Sizes cross tile boundaries (256 x 256 x 512) in every dimension; leading dimensions exceed the widths.
TEST(BF16Test, GemmMixedMatchesFp64OnEveryTypeAndTranspose) {
  const int64_t m = 261, n = 259, k = 530, pad = 3;
  for (int types = 1; types < 8; ++types)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const DType at = types & 1 ? DType::kBF16 : DType::kF32, bt = types & 2 ? DType::kBF16 : DType::kF32,
                    ct = types & 4 ? DType::kBF16 : DType::kF32;
        const int64_t lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
        Held a(at, Random((ta ? k : m) * lda, 1 + types)), b(bt, Random((tb ? n : k) * ldb, 20 + types)),
            c(ct, Random(m * ldc, 40 + types));
        const float alpha = 0.75f, beta = 0.5f;
        cpu::GemmMixed(ta, tb, m, n, k, alpha, at, a.data(), lda, bt, b.data(), ldb, beta, ct, c.data(), ldc);
        double worst = 0;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0, mag = 0;
            for (int64_t p = 0; p < k; ++p) {
              const double x = a.exact[ta ? p * lda + i : i * lda + p], y = b.exact[tb ? j * ldb + p : p * ldb + j];
              sum += x * y;
              mag += std::abs(x * y);
            }
            const double want = alpha * sum + beta * c.exact[i * ldc + j];
            const double got = c.at(i * ldc + j);
            // fp32 accumulation (k ulps of the magnitude at most), then one rounding of C when it is bf16.
            const double bound = 1e-6 * k * (mag + std::abs(c.exact[i * ldc + j])) +
                                 (ct == DType::kBF16 ? std::abs(want) * 0x1p-8 * 1.01 : 0.0);
            worst = std::max(worst, std::abs(got - want) / bound);
          }
        EXPECT_LE(worst, 1.0) << "types " << types << " ta " << ta << " tb " << tb;
        EXPECT_GT(worst, 0.0);  // inputs are not exact in fp32 sums: an exact match would mean nothing was compared
        // The padding between rows is never written.
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = n; j < ldc; ++j) ASSERT_EQ(c.at(i * ldc + j), c.exact[i * ldc + j]);
      }
}

TEST(BF16Test, GemmMixedBetaZeroIgnoresNaNInC) {
  const int64_t m = 5, n = 4, k = 3;
  Held a(DType::kBF16, Random(m * k, 7)), b(DType::kF32, Random(k * n, 8));
  std::vector<uint16_t> c(m * n, F32ToBF16(std::nanf("")));
  cpu::GemmMixed(false, false, m, n, k, 1.0f, DType::kBF16, a.data(), k, DType::kF32, b.data(), n, 0.0f,
                 DType::kBF16, c.data(), n);
  for (uint16_t x : c) EXPECT_TRUE(std::isfinite(BF16ToF32(x)));
}

// Attention over bf16 KV pages equals attention over the same values in f32 pages (forward, dQ); dK/dV accumulate
// into bf16 pages to bf16's resolution.
TEST(BF16Test, AttentionOverBF16PagesMatchesF32Pages) {
  AttentionShape s;
  s.n = 70;  // two query blocks
  s.pos0 = 10;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.scale = 1.0 / std::sqrt(8.0);
  const int64_t page_size = 16, stride = page_size * s.kv_heads * s.head_dim, pool = 7 * stride;
  const std::vector<int32_t> table = {3, 0, 6, 1, 5, 2};  // logical -> pool page
  const int64_t qn = s.n * s.heads * s.head_dim;
  Held k(DType::kBF16, Random(pool, 61)), v(DType::kBF16, Random(pool, 62));
  std::vector<float> kf(k.exact.begin(), k.exact.end()), vf(v.exact.begin(), v.exact.end());
  const Vec q64 = Random(qn, 63), r64 = Random(qn, 64);
  const std::vector<float> q(q64.begin(), q64.end()), r(r64.begin(), r64.end());
  auto view = [&](auto* kp, auto* vp) {
    return testing_fd::PagedView(kp, vp, table, page_size, s.kv_heads, s.head_dim);
  };
  const OpTable<float>& f = CpuOps<float>();
  std::vector<float> ws(f.attention_workspace_elems(s, page_size));
  std::vector<float> out(qn), lse(s.heads * s.n), dq(qn), dk(pool, 0), dv(pool, 0);
  std::vector<float> out_b(qn), lse_b(s.heads * s.n), dq_b(qn);
  std::vector<uint16_t> dk_b(pool, 0), dv_b(pool, 0);
  f.attention_forward(s, q.data(), view(kf.data(), vf.data()), out.data(), lse.data(), ws.data());
  f.attention_forward_bf16(s, q.data(), view(k.h.data(), v.h.data()), out_b.data(), lse_b.data(), ws.data());
  f.attention_backward(s, q.data(), view(kf.data(), vf.data()), out.data(), lse.data(), r.data(), dq.data(),
                       view(dk.data(), dv.data()), ws.data());
  f.attention_backward_bf16(s, q.data(), view(k.h.data(), v.h.data()), out.data(), lse.data(), r.data(),
                            dq_b.data(), view(dk_b.data(), dv_b.data()), ws.data());
  auto max_abs = [](const std::vector<float>& x) {
    double m = 0;
    for (float e : x) m = std::max<double>(m, std::abs(e));
    return m;
  };
  for (int64_t i = 0; i < qn; ++i) {
    ASSERT_NEAR(out_b[i], out[i], 1e-5 * max_abs(out)) << i;
    ASSERT_NEAR(dq_b[i], dq[i], 1e-5 * max_abs(dq)) << i;
  }
  for (int64_t i = 0; i < s.heads * s.n; ++i) ASSERT_NEAR(lse_b[i], lse[i], 1e-5 * std::abs(lse[i])) << i;
  int64_t touched = 0;
  for (int64_t i = 0; i < pool; ++i) {
    // Rounded once per query block and query head of the group: at most a few bf16 ulps of the largest entry.
    ASSERT_NEAR(BF16ToF32(dk_b[i]), dk[i], 4 * 0x1p-8 * max_abs(dk)) << i;
    ASSERT_NEAR(BF16ToF32(dv_b[i]), dv[i], 4 * 0x1p-8 * max_abs(dv)) << i;
    touched += dk_b[i] != 0;
  }
  EXPECT_GT(touched, pool / 2);
  for (int64_t i = 4 * stride; i < 5 * stride; ++i) EXPECT_EQ(dk_b[i], 0);  // pool page 4 is in no table entry
}

// Loss kernels over a bf16 logits chunk equal the f32 ones on the widened rows; the gradient is their rounding.
TEST(BF16Test, LossKernelsOverBF16LogitsMatchF32) {
  const int64_t n = 6, vocab = 300;
  Held logits(DType::kBF16, Random(n * vocab, 71, 3.0));
  std::vector<float> wide(logits.exact.begin(), logits.exact.end());
  const std::vector<int32_t> labels = {5, -100, 299, 0, 17, 150};
  const std::vector<double> row_scale = {1.0, 0.0, 0.5, 2.0, 1.0, 1.0};
  std::vector<double> lp(n), lp_b(n);
  std::vector<int32_t> am(n), am_b(n);
  cpu::TokenLogprobs<float>(wide.data(), labels.data(), n, vocab, lp.data());
  cpu::TokenLogprobsBF16(logits.h.data(), labels.data(), n, vocab, lp_b.data());
  cpu::TokenArgmax<float>(wide.data(), labels.data(), n, vocab, am.data());
  cpu::TokenArgmaxBF16(logits.h.data(), labels.data(), n, vocab, am_b.data());
  EXPECT_EQ(lp_b, lp);
  EXPECT_EQ(am_b, am);
  const double loss = cpu::CrossEntropyForwardBackward<float>(wide.data(), labels.data(), n, vocab,
                                                              row_scale.data(), 0.25, nullptr);
  const double loss_b = cpu::CrossEntropyForwardBackwardBF16(logits.h.data(), labels.data(), n, vocab,
                                                             row_scale.data(), 0.25, nullptr);
  EXPECT_EQ(loss_b, loss);
  for (int64_t i = 0; i < n * vocab; ++i) ASSERT_EQ(logits.h[i], F32ToBF16(wide[i])) << i;
}

TEST(BF16Test, AdamWStepsMasterInFp32AndRoundsIntoWeights) {
  const int64_t count = 70000;  // above the kernels' parallel threshold
  Vec init = Random(count, 3), grad = Random(count, 4);
  std::vector<float> master(init.begin(), init.end()), ref = master, g(grad.begin(), grad.end());
  std::vector<float> m(count, 0), v(count, 0), m_ref(count, 0), v_ref(count, 0);
  std::vector<uint16_t> w(count);
  cpu::F32ToBF16Row(master.data(), count, w.data());
  for (int64_t step = 1; step <= 3; ++step) {
    cpu::AdamWBF16(w.data(), master.data(), g.data(), m.data(), v.data(), count, 1e-4, 0.9, 0.95, 1e-8, 0.1, step);
    cpu::AdamW<float>(ref.data(), g.data(), m_ref.data(), v_ref.data(), count, 1e-4, 0.9, 0.95, 1e-8, 0.1, step);
  }
  int64_t moved_below_bf16 = 0;
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_EQ(master[i], ref[i]) << i;
    ASSERT_EQ(w[i], F32ToBF16(master[i])) << i;
    ASSERT_NE(master[i], static_cast<float>(init[i])) << i;
    moved_below_bf16 += F32ToBF16(static_cast<float>(init[i])) == w[i];
  }
  // Three steps of 1e-4 are below bf16's resolution for most weights: only the fp32 masters keep them.
  EXPECT_GT(moved_below_bf16, count / 2);
}

}  // namespace
}  // namespace sg
