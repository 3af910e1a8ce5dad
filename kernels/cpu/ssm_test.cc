// The state-space ops (kernels/cpu/ssm.cc) against central finite differences in fp64, including the carried
// conv tail and scan state, and a sequence split into chunks against the sequence in one piece.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"

namespace sg {
namespace {

using testing_fd::Dot;
using testing_fd::FiniteDifferenceError;
using testing_fd::MaxDiff;
using testing_fd::Random;
using testing_fd::Vec;

constexpr double kTol = 1e-7;
const OpTable<double>& ops = CpuOps<double>();

// n < k - 1 makes the output tail reach back into the input tail.
class Conv1dTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(Conv1dTest, GradientsIncludingTails) {
  const int64_t n = GetParam(), ch = 3, k = 4;
  Vec x = Random(n * ch, 1), tail = Random((k - 1) * ch, 2), w = Random(ch * k, 3), b = Random(ch, 4);
  const Vec r = Random(n * ch, 5), rt = Random((k - 1) * ch, 6);
  auto f = [&] {
    Vec y(n * ch), tail_out((k - 1) * ch);
    ops.conv1d_forward(x.data(), tail.data(), w.data(), b.data(), n, ch, k, y.data(), tail_out.data());
    return Dot(y, r) + Dot(tail_out, rt);
  };
  Vec dx(n * ch), dtail((k - 1) * ch), dw(ch * k, 0.0), db(ch, 0.0);
  ops.conv1d_backward(r.data(), rt.data(), x.data(), tail.data(), w.data(), n, ch, k, dx.data(), dtail.data(),
                      dw.data(), db.data());
  EXPECT_LT(FiniteDifferenceError(f, x, dx), kTol);
  EXPECT_LT(FiniteDifferenceError(f, tail, dtail), kTol);
  EXPECT_LT(FiniteDifferenceError(f, w, dw), kTol);
  EXPECT_LT(FiniteDifferenceError(f, b, db), kTol);
}

INSTANTIATE_TEST_SUITE_P(ChunkSizes, Conv1dTest, ::testing::Values(1, 2, 3, 7));

TEST(Conv1dTest, ChunksWithTailEqualWholeSequence) {
  const int64_t n = 9, ch = 5, k = 4, split = 2;
  const Vec x = Random(n * ch, 7), w = Random(ch * k, 8);
  Vec whole(n * ch), parts(n * ch), tail((k - 1) * ch);
  ops.conv1d_forward(x.data(), nullptr, w.data(), nullptr, n, ch, k, whole.data(), nullptr);
  ops.conv1d_forward(x.data(), nullptr, w.data(), nullptr, split, ch, k, parts.data(), tail.data());
  ops.conv1d_forward(x.data() + split * ch, tail.data(), w.data(), nullptr, n - split, ch, k,
                     parts.data() + split * ch, nullptr);
  EXPECT_LT(MaxDiff(whole, parts), 1e-14);
}

struct ScanInputs {
  int64_t n, dim, N;
  Vec u, delta, A, B, C, D, h0;
  ScanInputs(int64_t n, int64_t dim, int64_t N, uint64_t seed)
      : n(n), dim(dim), N(N), u(Random(n * dim, seed)), delta(Random(n * dim, seed + 1, 0.2, 0.5)),
        A(Random(dim * N, seed + 2, 0.3, -1.0)), B(Random(n * N, seed + 3)), C(Random(n * N, seed + 4)),
        D(Random(dim, seed + 5)), h0(Random(dim * N, seed + 6)) {}
};

class ScanTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ScanTest, GradientsIncludingStates) {
  ScanInputs in(GetParam(), 3, 4, 11);
  const Vec r = Random(in.n * in.dim, 20), rh = Random(in.dim * in.N, 21);
  auto f = [&] {
    Vec y(in.n * in.dim), hf(in.dim * in.N);
    ops.selective_scan_forward(in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(),
                               in.h0.data(), in.n, in.dim, in.N, y.data(), hf.data());
    return Dot(y, r) + Dot(hf, rh);
  };
  Vec du(in.u.size()), ddelta(in.delta.size()), dA(in.A.size(), 0.0), dB(in.B.size()), dC(in.C.size()),
      dD(in.D.size(), 0.0), dh0(in.h0.size());
  ops.selective_scan_backward(r.data(), rh.data(), in.u.data(), in.delta.data(), in.A.data(), in.B.data(),
                              in.C.data(), in.D.data(), in.h0.data(), in.n, in.dim, in.N, du.data(), ddelta.data(),
                              dA.data(), dB.data(), dC.data(), dD.data(), dh0.data());
  EXPECT_LT(FiniteDifferenceError(f, in.u, du), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.delta, ddelta), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.A, dA), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.B, dB), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.C, dC), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.D, dD), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.h0, dh0), kTol);
}

INSTANTIATE_TEST_SUITE_P(ChunkSizes, ScanTest, ::testing::Values(1, 2, 7));

// Large enough for the threaded path: two chunks, the state carried forward and its gradient relayed backward,
// give the one-chunk outputs and gradients.
TEST(ScanTest, ChunksWithCarriedStateEqualWholeSequence) {
  const int64_t n = 48, split = 19, dim = 64, N = 8;
  ScanInputs in(n, dim, N, 31);
  const Vec dy = Random(n * dim, 40);
  Vec y(n * dim), du(n * dim), ddelta(n * dim), dA(dim * N, 0.0), dB(n * N), dC(n * N), dD(dim, 0.0);
  ops.selective_scan_forward(in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(),
                             nullptr, n, dim, N, y.data(), nullptr);
  ops.selective_scan_backward(dy.data(), nullptr, in.u.data(), in.delta.data(), in.A.data(), in.B.data(),
                              in.C.data(), in.D.data(), nullptr, n, dim, N, du.data(), ddelta.data(), dA.data(),
                              dB.data(), dC.data(), dD.data(), nullptr);

  Vec y2(n * dim), h(dim * N), du2(n * dim), ddelta2(n * dim), dA2(dim * N, 0.0), dB2(n * N), dC2(n * N),
      dD2(dim, 0.0), dh(dim * N);
  const int64_t m = n - split;
  auto at = [](const Vec& v, int64_t row, int64_t width) { return v.data() + row * width; };
  auto at_mut = [](Vec& v, int64_t row, int64_t width) { return v.data() + row * width; };
  ops.selective_scan_forward(in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(),
                             nullptr, split, dim, N, y2.data(), h.data());
  ops.selective_scan_forward(at(in.u, split, dim), at(in.delta, split, dim), in.A.data(), at(in.B, split, N),
                             at(in.C, split, N), in.D.data(), h.data(), m, dim, N, at_mut(y2, split, dim), nullptr);
  EXPECT_LT(MaxDiff(y, y2), 1e-12);
  ops.selective_scan_backward(at(dy, split, dim), nullptr, at(in.u, split, dim), at(in.delta, split, dim),
                              in.A.data(), at(in.B, split, N), at(in.C, split, N), in.D.data(), h.data(), m, dim, N,
                              at_mut(du2, split, dim), at_mut(ddelta2, split, dim), dA2.data(), at_mut(dB2, split, N),
                              at_mut(dC2, split, N), dD2.data(), dh.data());
  ops.selective_scan_backward(dy.data(), dh.data(), in.u.data(), in.delta.data(), in.A.data(), in.B.data(),
                              in.C.data(), in.D.data(), nullptr, split, dim, N, du2.data(), ddelta2.data(),
                              dA2.data(), dB2.data(), dC2.data(), dD2.data(), nullptr);
  EXPECT_LT(MaxDiff(du, du2), 1e-12);
  EXPECT_LT(MaxDiff(ddelta, ddelta2), 1e-12);
  EXPECT_LT(MaxDiff(dA, dA2), 1e-11);
  EXPECT_LT(MaxDiff(dB, dB2), 1e-11);
  EXPECT_LT(MaxDiff(dC, dC2), 1e-11);
  EXPECT_LT(MaxDiff(dD, dD2), 1e-11);
}

// Adjoint sharding with every pair (window >= the tokens left), the later tokens' cotangents handed to the first
// chunk, gives the reverse-scan gradients; the pair counts are those of the paper (sum over i of T - i).
TEST(ScanPairsTest, PairsOverChunksEqualReverseScan) {
  const int64_t n = 48, split = 19, dim = 64, N = 8, m = n - split, all = 1 << 20;
  ScanInputs in(n, dim, N, 31);
  const Vec dy = Random(n * dim, 40);
  Vec du(n * dim), ddelta(n * dim), dA(dim * N, 0.0), dB(n * N), dC(n * N), dD(dim, 0.0);
  ops.selective_scan_backward(dy.data(), nullptr, in.u.data(), in.delta.data(), in.A.data(), in.B.data(),
                              in.C.data(), in.D.data(), nullptr, n, dim, N, du.data(), ddelta.data(), dA.data(),
                              dB.data(), dC.data(), dD.data(), nullptr);

  Vec h(dim * N), du2(n * dim), ddelta2(n * dim), dA2(dim * N, 0.0), dB2(n * N), dC2(n * N), dD2(dim, 0.0);
  auto at = [](const Vec& v, int64_t row, int64_t width) { return v.data() + row * width; };
  auto at_mut = [](Vec& v, int64_t row, int64_t width) { return v.data() + row * width; };
  ops.selective_scan_forward(in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(),
                             nullptr, split, dim, N, nullptr, h.data());
  const int64_t pairs_late = ops.selective_scan_backward_pairs(
      at(dy, split, dim), at(in.u, split, dim), at(in.delta, split, dim), in.A.data(), at(in.B, split, N),
      at(in.C, split, N), in.D.data(), h.data(), m, dim, N, nullptr, nullptr, nullptr, 0, all,
      at_mut(du2, split, dim), at_mut(ddelta2, split, dim), dA2.data(), at_mut(dB2, split, N), at_mut(dC2, split, N),
      dD2.data());
  const int64_t pairs_early = ops.selective_scan_backward_pairs(
      dy.data(), in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(), nullptr, split,
      dim, N, at(dy, split, dim), at(in.delta, split, dim), at(in.C, split, N), m, all, du2.data(), ddelta2.data(),
      dA2.data(), dB2.data(), dC2.data(), dD2.data());
  EXPECT_EQ(pairs_late, m * (m + 1) / 2);
  EXPECT_EQ(pairs_late + pairs_early, n * (n + 1) / 2);
  EXPECT_LT(MaxDiff(du, du2), 1e-12);
  EXPECT_LT(MaxDiff(ddelta, ddelta2), 1e-12);
  EXPECT_LT(MaxDiff(dA, dA2), 1e-11);
  EXPECT_LT(MaxDiff(dB, dB2), 1e-11);
  EXPECT_LT(MaxDiff(dC, dC2), 1e-11);
  EXPECT_LT(MaxDiff(dD, dD2), 1e-11);
}

// A truncated window keeps the pairs with t - i < window only: dB and dA against the definition, with the adjoint
// states written as exp(A * (sum of deltas)) instead of running products; T̄T - T̄(T̄-1)/2 pairs per channel.
TEST(ScanPairsTest, TruncatedWindowMatchesDefinition) {
  const int64_t n = 23, dim = 5, N = 3, window = 6;
  ScanInputs in(n, dim, N, 7);
  const Vec dy = Random(n * dim, 8);
  Vec du(n * dim), ddelta(n * dim), dA(dim * N, 0.0), dB(n * N), dC(n * N), dD(dim, 0.0);
  const int64_t pairs = ops.selective_scan_backward_pairs(
      dy.data(), in.u.data(), in.delta.data(), in.A.data(), in.B.data(), in.C.data(), in.D.data(), in.h0.data(), n,
      dim, N, nullptr, nullptr, nullptr, 0, window, du.data(), ddelta.data(), dA.data(), dB.data(), dC.data(),
      dD.data());
  EXPECT_EQ(pairs, window * n - window * (window - 1) / 2);

  Vec dB_ref(n * N, 0.0), dA_ref(dim * N, 0.0);
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t s = 0; s < N; ++s) {
      const double a = in.A[d * N + s];
      double h = in.h0[d * N + s];
      for (int64_t i = 0; i < n; ++i) {
        const double dt = in.delta[i * dim + d], prev = h;
        h = std::exp(dt * a) * h + dt * in.B[i * N + s] * in.u[i * dim + d];
        double dh = 0, sum = 0;
        for (int64_t t = i; t < std::min(n, i + window); ++t) {
          if (t > i) sum += in.delta[t * dim + d];
          dh += dy[t * dim + d] * in.C[t * N + s] * std::exp(a * sum);
        }
        dB_ref[i * N + s] += dh * dt * in.u[i * dim + d];
        dA_ref[d * N + s] += dh * dt * std::exp(dt * a) * prev;
      }
    }
  EXPECT_LT(MaxDiff(dB, dB_ref), 1e-12);
  EXPECT_LT(MaxDiff(dA, dA_ref), 1e-12);
}

// f32 with state size 16 takes the register-blocked sweep (AVX2 where available): same gradients as the scan.
TEST(ScanPairsTest, CompiledSweepInF32MatchesReverseScan) {
  const int64_t n = 37, dim = 8, N = 16;
  ScanInputs in(n, dim, N, 5);
  auto f32 = [](const Vec& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> u = f32(in.u), delta = f32(in.delta), A = f32(in.A), B = f32(in.B), C = f32(in.C),
                           D = f32(in.D), dy = f32(Random(n * dim, 6));
  const OpTable<float>& ops32 = CpuOps<float>();
  std::vector<std::vector<float>> out;
  for (bool pairs : {false, true}) {
    std::vector<float> du(n * dim), ddelta(n * dim), dA(dim * N, 0.f), dB(n * N), dC(n * N), dD(dim, 0.f);
    if (pairs)
      ops32.selective_scan_backward_pairs(dy.data(), u.data(), delta.data(), A.data(), B.data(), C.data(), D.data(),
                                          nullptr, n, dim, N, nullptr, nullptr, nullptr, 0, n, du.data(),
                                          ddelta.data(), dA.data(), dB.data(), dC.data(), dD.data());
    else
      ops32.selective_scan_backward(dy.data(), nullptr, u.data(), delta.data(), A.data(), B.data(), C.data(),
                                    D.data(), nullptr, n, dim, N, du.data(), ddelta.data(), dA.data(), dB.data(),
                                    dC.data(), dD.data(), nullptr);
    for (auto* v : {&du, &ddelta, &dA, &dB}) out.push_back(*v);
  }
  for (size_t k = 0; k < 4; ++k) {
    float scale = 0, err = 0;
    for (size_t i = 0; i < out[k].size(); ++i) {
      scale = std::max(scale, std::abs(out[k][i]));
      err = std::max(err, std::abs(out[k][i] - out[k + 4][i]));
    }
    EXPECT_LT(err, 1e-5f * scale) << "output " << k;
  }
}

TEST(PointwiseSsmTest, SiluAndSoftplus) {
  const int64_t count = 9;
  Vec x = Random(count, 50, 3.0);
  x[0] = 25;  // softplus above its threshold
  const Vec r = Random(count, 51);
  auto f_silu = [&] {
    Vec y(count);
    ops.silu_forward(x.data(), count, y.data());
    return Dot(y, r);
  };
  auto f_softplus = [&] {
    Vec y(count);
    ops.softplus_forward(x.data(), count, y.data());
    return Dot(y, r);
  };
  Vec dx(count);
  ops.silu_backward(r.data(), x.data(), count, dx.data());
  EXPECT_LT(FiniteDifferenceError(f_silu, x, dx), kTol);
  ops.softplus_backward(r.data(), x.data(), count, dx.data());
  EXPECT_LT(FiniteDifferenceError(f_softplus, x, dx), kTol);
}

// Nemotron-H's ReLU²: zero below 0 (value and gradient), x^2 above; finite differences away from the kink.
TEST(PointwiseSsmTest, Relu2) {
  const int64_t count = 9;
  Vec x = Random(count, 52, 3.0);
  for (double& v : x)
    if (std::abs(v) < 0.1) v += 0.2;
  const Vec r = Random(count, 53);
  auto f = [&] {
    Vec y(count);
    ops.relu2_forward(x.data(), count, y.data());
    return Dot(y, r);
  };
  Vec y(count), dx(count);
  ops.relu2_forward(x.data(), count, y.data());
  for (int64_t i = 0; i < count; ++i) EXPECT_EQ(y[i], x[i] > 0 ? x[i] * x[i] : 0.0) << i;
  ops.relu2_backward(r.data(), x.data(), count, dx.data());
  EXPECT_LT(FiniteDifferenceError(f, x, dx), kTol);
}

}  // namespace
}  // namespace sg
