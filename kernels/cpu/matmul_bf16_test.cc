// --matmul=bf16 on the CPU (cpu::SetMatmul): the f32 operands of products are rounded to bf16 and the products
// accumulate in fp32, in GEMMs (outside and inside parallel regions) and in attention. With bf16 dot products that
// runs in oneDNN's bf16 matmul; with SG_CPU_ISA below avx512_bf16 (this test's avx2/generic variants) the rounded
// operands multiply in sgemm, so every check here holds on both.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"
#include "kernels/cpu/isa.h"

namespace sg {
namespace {

using testing_fd::Random;

double Rounded(double x) { return BF16ToF32(F32ToBF16(static_cast<float>(x))); }

// Sets --matmul for one test and puts fp32 back after it.
class MatmulBF16Test : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(cpu::SetMatmul("bf16"), ""); }
  void TearDown() override { ASSERT_EQ(cpu::SetMatmul("fp32"), ""); }
};

TEST(MatmulModeTest, RefusesTf32AndUnknownModes) {
  EXPECT_NE(cpu::SetMatmul("tf32").find("no tf32"), std::string::npos);
  EXPECT_NE(cpu::SetMatmul("fp16").find("unknown matmul mode 'fp16'"), std::string::npos);
  EXPECT_FALSE(cpu::MatmulRoundsToBF16());
}

// F32ToBF16Row (AVX-512 where the CPU has it, which this mode leans on) gives F32ToBF16's bits for every sign,
// exponent and top mantissa bits, with the low halves that decide rounding: ties, NaNs, infinities, denormals and
// values that round up to infinity included. Odd lengths cover the vector loop's tail.
TEST(MatmulModeTest, RowRoundingMatchesTheScalarRounding) {
  std::vector<float> x;
  for (uint32_t high = 0; high < 0x10000; ++high)
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xc000u, 0xffffu}) {
      const uint32_t u = high << 16 | low;
      float f;
      std::memcpy(&f, &u, 4);
      x.push_back(f);
    }
  for (int64_t n : {static_cast<int64_t>(x.size()), int64_t{37}}) {
    std::vector<uint16_t> got(n);
    cpu::F32ToBF16Row(x.data(), n, got.data());
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += got[i] != F32ToBF16(x[i]);
    EXPECT_EQ(wrong, 0) << "n " << n;
  }
}

// One product C = alpha op(A) op(B) + beta C with the given operand types, against fp64 products of the operands
// rounded to bf16 (tight: fp32 accumulation) and of the operands as they are. Returns false on failure.
struct GemmCase {
  bool ta, tb;
  int64_t m, n, k;
  DType at, bt, ct;
  uint64_t seed;
};

// max |C - rounded reference| / bound, and max |C - rounded| vs max |C - exact| (the rounding must show).
struct GemmResult {
  double worst = 0, diff_rounded = 0, diff_exact = 0;
};

GemmResult RunGemm(const GemmCase& g) {
  const int64_t lda = g.ta ? g.m : g.k, ldb = g.tb ? g.k : g.n;
  const std::vector<double> av = Random(g.m * g.k, g.seed), bv = Random(g.k * g.n, g.seed + 1),
                            cv = Random(g.m * g.n, g.seed + 2);
  // Operands in their types; a and b hold the values as stored (bf16 ones already rounded).
  auto store = [](DType t, const std::vector<double>& v, std::vector<float>& f, std::vector<uint16_t>& h) {
    f.assign(v.begin(), v.end());
    h.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      h[i] = F32ToBF16(f[i]);
      if (t == DType::kBF16) f[i] = BF16ToF32(h[i]);
    }
  };
  std::vector<float> a, b, c;
  std::vector<uint16_t> a16, b16, c16;
  store(g.at, av, a, a16);
  store(g.bt, bv, b, b16);
  store(g.ct, cv, c, c16);
  const float alpha = 0.5f, beta = 0.25f;
  auto ptr = [](DType t, std::vector<float>& f, std::vector<uint16_t>& h) -> void* {
    return t == DType::kBF16 ? static_cast<void*>(h.data()) : static_cast<void*>(f.data());
  };
  cpu::GemmMixed(g.ta, g.tb, g.m, g.n, g.k, alpha, g.at, ptr(g.at, a, a16), lda, g.bt, ptr(g.bt, b, b16), ldb, beta,
                 g.ct, ptr(g.ct, c, c16), g.n);
  GemmResult r;
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j) {
      double rounded = 0, exact = 0, mag = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double x = a[g.ta ? p * lda + i : i * lda + p], y = b[g.tb ? j * ldb + p : p * ldb + j];
        rounded += Rounded(x) * Rounded(y);
        exact += x * y;
        mag += std::abs(x * y);
      }
      const double c0 = g.ct == DType::kBF16 ? BF16ToF32(F32ToBF16(static_cast<float>(cv[i * g.n + j])))
                                             : static_cast<float>(cv[i * g.n + j]);
      const double got = g.ct == DType::kBF16 ? BF16ToF32(c16[i * g.n + j]) : c[i * g.n + j];
      const double want = alpha * rounded + beta * c0;
      // fp32 accumulation, plus one bf16 rounding of a bf16 C.
      const double bound = 1e-6 * g.k * (mag + std::abs(c0)) + (g.ct == DType::kBF16 ? std::abs(want) / 256 : 0);
      r.worst = std::max(r.worst, std::abs(got - want) / bound);
      r.diff_rounded = std::max(r.diff_rounded, std::abs(got - want));
      r.diff_exact = std::max(r.diff_exact, std::abs(got - (alpha * exact + beta * c0)));
    }
  return r;
}

void ExpectRounded(const GemmCase& g, const GemmResult& r) {
  const std::string what = "ta " + std::to_string(g.ta) + " tb " + std::to_string(g.tb) + " types " +
                           std::to_string(static_cast<int>(g.at)) + std::to_string(static_cast<int>(g.bt)) +
                           std::to_string(static_cast<int>(g.ct)) + " m " + std::to_string(g.m);
  EXPECT_LE(r.worst, 1.0) << what;
  // With an f32 operand and an f32 C, the result is far nearer the rounded product than the exact one.
  if ((g.at == DType::kF32 || g.bt == DType::kF32) && g.ct == DType::kF32) {
    EXPECT_LT(8 * r.diff_rounded, r.diff_exact) << what;
  }
}

TEST_F(MatmulBF16Test, GemmRoundsTheF32OperandsOutsideParallelRegions) {
  // m crosses 256-row blocks; every mix of operand types, both transposes, f32 and bf16 C.
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (DType at : {DType::kF32, DType::kBF16})
        for (DType bt : {DType::kF32, DType::kBF16})
          for (DType ct : {DType::kF32, DType::kBF16}) {
            const GemmCase g{ta != 0, tb != 0, 600, 130, 520, at, bt, ct, 3};
            ExpectRounded(g, RunGemm(g));
          }
}

// A run over many sequence lengths makes many shapes: the primitives a thread keeps stay bounded, and products
// made after the cache starts over are still right.
TEST_F(MatmulBF16Test, ManyShapesKeepTheCacheBounded) {
  if (cpu::ActiveIsa() < cpu::Isa::kAvx512Bf16) GTEST_SKIP() << "no bf16 dot products: sgemm runs the rounded operands";
  size_t most = 0;
  for (int64_t m = 1; m <= 300; ++m) {
    const GemmCase g{false, true, m, 8, 16, DType::kF32, DType::kBF16, DType::kF32, static_cast<uint64_t>(m)};
    const GemmResult r = RunGemm(g);
    ASSERT_LE(r.worst, 1.0) << "m " << m;
    most = std::max(most, cpu::MatmulShapesCached());
  }
  EXPECT_GE(most, 200u);  // the shapes were cached ...
  EXPECT_LE(most, 256u);  // ... up to the bound
}

TEST_F(MatmulBF16Test, GemmInsideAParallelRegion) {
  // Attention's shapes (a query block by a page, and back), each thread its own, at the same time.
  const std::vector<GemmCase> cases = {
      {false, true, 256, 256, 64, DType::kF32, DType::kBF16, DType::kF32, 11},
      {false, false, 256, 64, 256, DType::kF32, DType::kBF16, DType::kF32, 12},
      {true, false, 200, 64, 256, DType::kF32, DType::kF32, DType::kF32, 13},
      {false, true, 100, 56, 64, DType::kF32, DType::kF32, DType::kF32, 14},
  };
  std::vector<GemmResult> results(2 * cases.size());
  std::vector<int> in_parallel(results.size());
#pragma omp parallel for num_threads(2) schedule(static, 1)
  for (size_t i = 0; i < results.size(); ++i) {
    in_parallel[i] = omp_in_parallel();
    results[i] = RunGemm(cases[i % cases.size()]);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    EXPECT_TRUE(in_parallel[i]);
    ExpectRounded(cases[i % cases.size()], results[i]);
  }
}

TEST_F(MatmulBF16Test, GemmFloatFollowsTheModeAndFp32IsExactAgain) {
  const int64_t m = 70, n = 90, k = 300;
  const std::vector<double> av = Random(m * k, 21), bv = Random(k * n, 22);
  std::vector<float> a(av.begin(), av.end()), b(bv.begin(), bv.end()), bf16_c(m * n), fp32_c(m * n), sgemm_c(m * n);
  cpu::Gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, bf16_c.data(), n);
  ASSERT_EQ(cpu::SetMatmul("fp32"), "");
  cpu::Gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, fp32_c.data(), n);
  cpu::Sgemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, sgemm_c.data(), n);
  EXPECT_EQ(fp32_c, sgemm_c);
  double diff = 0;
  for (int64_t i = 0; i < m * n; ++i) diff = std::max(diff, static_cast<double>(std::abs(bf16_c[i] - fp32_c[i])));
  EXPECT_GT(diff, 1e-3);  // bf16 inputs: errors near 2^-9 of each product's terms
}

// Attention over a paged cache of n keys with causal queries, in f32 with pages stored as KV, and in f64 from the
// same values (the reference kernel). Gradients are of sum(O * dO).
struct AttentionRun {
  std::vector<double> out, dq, dk, dv;
};

constexpr int64_t kN = 600, kHeads = 4, kKvHeads = 2, kHd = 64, kPage = 128;

AttentionShape Shape() {
  AttentionShape s;
  s.n = kN;
  s.heads = kHeads;
  s.kv_heads = kKvHeads;
  s.head_dim = kHd;
  s.scale = 1.0 / std::sqrt(static_cast<double>(kHd));
  return s;
}

template <typename T, typename KV>
AttentionRun Attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                       const std::vector<double>& dout) {
  const AttentionShape s = Shape();
  const int64_t pages = (kN + kPage - 1) / kPage, stride = kPage * kKvHeads * kHd;
  auto as = [](const std::vector<double>& x, auto* zero) {
    using E = std::remove_pointer_t<decltype(zero)>;
    std::vector<E> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      if constexpr (std::is_same_v<E, uint16_t>) r[i] = F32ToBF16(static_cast<float>(x[i]));
      else r[i] = static_cast<E>(x[i]);
    }
    return r;
  };
  std::vector<KV> kp = as(k, static_cast<KV*>(nullptr)), vp = as(v, static_cast<KV*>(nullptr));
  kp.resize(pages * stride);
  vp.resize(pages * stride);
  std::vector<KV> dk(pages * stride), dv(pages * stride);
  std::vector<T> qt = as(q, static_cast<T*>(nullptr)), dot = as(dout, static_cast<T*>(nullptr));
  std::vector<T> out(qt.size()), dq(qt.size()), lse(kN * kHeads);
  std::vector<int32_t> table(pages);
  for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(i);
  auto view = [&](std::vector<KV>& kk, std::vector<KV>& vv) {
    PagedKV<KV> p;
    p.k_pool = kk.data();
    p.v_pool = vv.data();
    p.page_table = table.data();
    p.page_size = kPage;
    p.page_stride = stride;
    p.kv_heads = kKvHeads;
    p.head_dim = kHd;
    return p;
  };
  std::vector<T> ws(cpu::AttentionWorkspaceElems(s, kPage));
  cpu::AttentionForward<T, KV>(s, qt.data(), view(kp, vp), out.data(), lse.data(), ws.data());
  cpu::AttentionBackward<T, KV>(s, qt.data(), view(kp, vp), out.data(), lse.data(), dot.data(), dq.data(),
                                view(dk, dv), ws.data());
  auto widen = [](const auto& x, size_t n) {
    std::vector<double> r(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<std::decay_t<decltype(x[0])>, uint16_t>) r[i] = BF16ToF32(x[i]);
      else r[i] = x[i];
    }
    return r;
  };
  const size_t kv_elems = kN * kKvHeads * kHd;
  return {widen(out, out.size()), widen(dq, dq.size()), widen(dk, kv_elems), widen(dv, kv_elems)};
}

// max |a - b| over max |b|, per tensor, the worst of the four.
double RelDiff(const AttentionRun& a, const AttentionRun& b) {
  double worst = 0;
  for (auto [x, y] : {std::pair(&a.out, &b.out), std::pair(&a.dq, &b.dq), std::pair(&a.dk, &b.dk),
                      std::pair(&a.dv, &b.dv)}) {
    double d = 0, scale = 0;
    for (size_t i = 0; i < y->size(); ++i) {
      d = std::max(d, std::abs((*x)[i] - (*y)[i]));
      scale = std::max(scale, std::abs((*y)[i]));
    }
    worst = std::max(worst, d / scale);
  }
  return worst;
}

std::vector<double> RoundedAll(std::vector<double> x) {
  for (double& e : x) e = Rounded(e);
  return x;
}

TEST(MatmulBF16AttentionTest, ForwardAndBackwardTakeBF16Operands) {
  const int64_t qn = kN * kHeads * kHd, kvn = kN * kKvHeads * kHd;
  const std::vector<double> q = Random(qn, 31), k = Random(kvn, 32), v = Random(kvn, 33), dout = Random(qn, 34);
  // The reference: f64 attention of the inputs rounded to bf16.
  const AttentionRun ref = Attention<double, double>(RoundedAll(q), RoundedAll(k), RoundedAll(v), RoundedAll(dout));
  const AttentionRun fp32 = Attention<float, float>(q, k, v, dout);
  const AttentionRun fp32_pages16 = Attention<float, uint16_t>(q, k, v, dout);
  ASSERT_EQ(cpu::SetMatmul("bf16"), "");
  const AttentionRun bf16 = Attention<float, float>(q, k, v, dout);
  const AttentionRun bf16_pages16 = Attention<float, uint16_t>(q, k, v, dout);
  const AttentionRun bf16_rounded_in = Attention<float, float>(RoundedAll(q), RoundedAll(k), RoundedAll(v),
                                                               RoundedAll(dout));
  ASSERT_EQ(cpu::SetMatmul("fp32"), "");
  const AttentionRun fp32_rounded_in = Attention<float, float>(RoundedAll(q), RoundedAll(k), RoundedAll(v),
                                                               RoundedAll(dout));
  // Near the fp32 kernel: within what bf16 rounding of the operands costs.
  EXPECT_LT(RelDiff(bf16, fp32), 1e-2);
  EXPECT_LT(RelDiff(bf16_pages16, fp32_pages16), 1e-2);
  // Near the f64 reference of the rounded inputs: what is left is the rounding of P and dS inside the kernel.
  EXPECT_LT(RelDiff(bf16, ref), 6e-3);
  EXPECT_LT(RelDiff(bf16_pages16, ref), 6e-3);
  // f32 and bf16 pages hold the same rounded K and V in this mode (up to summation order and dK/dV's rounding).
  EXPECT_LT(RelDiff(bf16_pages16, bf16), 1e-2);
  // The mode rounds Q, K, V and dO itself: given them already rounded, O and dV = P^T dO come out bit for bit the
  // same (dQ and dK also read D = dO . O, which stays fp32). Under fp32 they do not.
  EXPECT_EQ(bf16.out, bf16_rounded_in.out);
  EXPECT_EQ(bf16.dv, bf16_rounded_in.dv);
  EXPECT_NE(fp32.out, fp32_rounded_in.out);
  std::printf("rel diff: bf16 vs fp32 %.3g (bf16 pages %.3g); to the rounded f64 reference: bf16 %.3g, bf16 pages "
              "%.3g, fp32 %.3g\n",
              RelDiff(bf16, fp32), RelDiff(bf16_pages16, fp32_pages16), RelDiff(bf16, ref),
              RelDiff(bf16_pages16, ref), RelDiff(fp32, ref));
}

}  // namespace
}  // namespace sg
