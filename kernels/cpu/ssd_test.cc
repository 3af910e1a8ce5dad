// Mamba-2's ops (kernels/cpu/ssd.cc): the SSD scan's forward against a naive recurrence, every gradient against
// central finite differences in fp64 (dt clamped at both ends on some tokens, softplus past its threshold on one),
// a sequence in two chunks (state relayed forward, its gradient backward) against the sequence in one, the null and
// aliased state arguments, f32 against f64, the thread count; the gated group RMSNorm likewise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"

namespace sg {
namespace {

using testing_fd::Concat;
using testing_fd::Dot;
using testing_fd::FiniteDifferenceError;
using testing_fd::MaxDiff;
using testing_fd::Random;
using testing_fd::RelErr;
using testing_fd::Rows;
using testing_fd::Vec;

constexpr double kTol = 1e-7;
constexpr double kInf = std::numeric_limits<double>::infinity();
const OpTable<double>& ops = CpuOps<double>();

struct Shape {
  int64_t n, heads, head_dim, groups, N;
  int64_t state() const { return heads * head_dim * N; }
  int64_t xs() const { return n * heads * head_dim; }
  int64_t bcs() const { return n * groups * N; }
};

struct Limits {
  double lo = 0, hi = kInf;
};

// Inputs of one chunk: dt_raw + dt_bias spread so that softplus covers about (0.05, 3).
struct Inputs {
  Shape s;
  Limits lim;
  Vec x, dt_raw, dt_bias, A_log, B, C, D, s0;
  Inputs(Shape s, uint64_t seed, Limits lim = {})
      : s(s),
        lim(lim),
        x(Random(s.xs(), seed)),
        dt_raw(Random(s.n * s.heads, seed + 1, 1.2, -0.5)),
        dt_bias(Random(s.heads, seed + 2, 0.5)),
        A_log(Random(s.heads, seed + 3, 0.5, -0.5)),
        B(Random(s.bcs(), seed + 4)),
        C(Random(s.bcs(), seed + 5)),
        D(Random(s.heads, seed + 6)),
        s0(Random(s.state(), seed + 7)) {}
};

struct Forward {
  Vec y, s_final;
};

Forward RunForward(const Inputs& in, const double* s0, const double* D) {
  const Shape& s = in.s;
  Forward f{Vec(s.xs()), Vec(s.state())};
  ops.ssd_forward(in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(), in.C.data(), D, s0,
                  s.n, s.heads, s.head_dim, s.groups, s.N, in.lim.lo, in.lim.hi, f.y.data(), f.s_final.data());
  return f;
}
Forward RunForward(const Inputs& in) { return RunForward(in, in.s0.data(), in.D.data()); }

struct Grads {
  Vec dx, ddt_raw, dB, dC, ds0;
  Vec ddt_bias, dA_log, dD;  // accumulated: start at zero here
};

// The backward with a NaN-filled workspace (a read before a write shows) and NaN-filled assigned outputs.
Grads RunBackward(const Inputs& in, const double* s0, const double* D, const Vec& dy, const double* ds_final,
                  bool want_ds0 = true) {
  const Shape& s = in.s;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Grads d{Vec(s.xs(), nan),    Vec(s.n * s.heads, nan),
          Vec(s.bcs(), nan),   Vec(s.bcs(), nan),
          Vec(s.state(), nan), Vec(s.heads),
          Vec(s.heads),        Vec(s.heads)};
  Vec workspace(ops.ssd_workspace_elems(s.n, s.heads, s.head_dim, s.groups, s.N), nan);
  ops.ssd_backward(dy.data(), ds_final, in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(),
                   in.C.data(), D, s0, s.n, s.heads, s.head_dim, s.groups, s.N, in.lim.lo, in.lim.hi, d.dx.data(),
                   d.ddt_raw.data(), d.ddt_bias.data(), d.dA_log.data(), d.dB.data(), d.dC.data(), d.dD.data(),
                   want_ds0 ? d.ds0.data() : nullptr, workspace.data());
  return d;
}
Grads RunBackward(const Inputs& in, const Vec& dy, const Vec& ds_final) {
  return RunBackward(in, in.s0.data(), in.D.data(), dy, ds_final.data());
}

double NaiveDt(const Inputs& in, int64_t t, int64_t h) {
  const double v = in.dt_raw[t * in.s.heads + h] + in.dt_bias[h];
  return std::min(std::max(v > 20 ? v : std::log1p(std::exp(v)), in.lim.lo), in.lim.hi);
}

// The recurrence as the contract writes it, one head and state entry at a time.
Forward NaiveForward(const Inputs& in) {
  const Shape& s = in.s;
  Forward f{Vec(s.xs()), in.s0};
  for (int64_t h = 0; h < s.heads; ++h) {
    const int64_t g = h / (s.heads / s.groups);
    const double A = -std::exp(in.A_log[h]);
    for (int64_t t = 0; t < s.n; ++t) {
      const double dt = NaiveDt(in, t, h);
      for (int64_t p = 0; p < s.head_dim; ++p) {
        const double xp = in.x[(t * s.heads + h) * s.head_dim + p];
        double y = in.D[h] * xp;
        for (int64_t j = 0; j < s.N; ++j) {
          double& S = f.s_final[(h * s.head_dim + p) * s.N + j];
          S = std::exp(dt * A) * S + dt * xp * in.B[(t * s.groups + g) * s.N + j];
          y += S * in.C[(t * s.groups + g) * s.N + j];
        }
        f.y[(t * s.heads + h) * s.head_dim + p] = y;
      }
    }
  }
  return f;
}

// 4 heads in 2 groups (two heads per group), head_dim 3, N 5.
constexpr Shape kSmall{9, 4, 3, 2, 5};
// Large enough for the threaded paths, with a last block shorter than the others (70 tokens: blocks of 9).
constexpr Shape kLarge{70, 4, 8, 2, 16};

TEST(SsdTest, ForwardMatchesNaiveRecurrence) {
  for (Shape s : {kSmall, kLarge, Shape{5, 3, 4, 1, 2}, Shape{6, 4, 2, 4, 3}}) {
    for (Limits lim : {Limits{}, Limits{0.3, 1.5}}) {
      const Inputs in(s, 10, lim);
      const Forward got = RunForward(in), want = NaiveForward(in);
      EXPECT_LT(MaxDiff(got.y, want.y), 1e-13) << "n " << s.n << " lo " << lim.lo;
      EXPECT_LT(MaxDiff(got.s_final, want.s_final), 1e-13) << "n " << s.n << " lo " << lim.lo;
    }
  }
}

struct GradientCase {
  int64_t n;
  Limits lim;
};

// Chunk lengths 1 (one block), 9 (three full blocks), 11 (a short last block); dt unclamped (with one softplus past
// its threshold) or clamped at both ends on some tokens.
class SsdGradientTest : public ::testing::TestWithParam<GradientCase> {};

TEST_P(SsdGradientTest, EveryInputAgainstFiniteDifferences) {
  Shape s = kSmall;
  s.n = GetParam().n;
  const Limits lim = GetParam().lim;
  Inputs in(s, 20, lim);
  if (lim.hi == kInf) in.dt_raw[s.n * s.heads - 1] = 21;  // softplus is the identity there
  // The clamp binds on some tokens, and no softplus lies within the differences' step of a limit.
  int below = 0, above = 0;
  for (int64_t t = 0; t < s.n; ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      const double v = in.dt_raw[t * s.heads + h] + in.dt_bias[h], sp = v > 20 ? v : std::log1p(std::exp(v));
      below += sp < lim.lo;
      above += sp > lim.hi;
      ASSERT_GT(std::min(std::abs(sp - lim.lo), std::abs(sp - lim.hi)), 1e-4);
    }
  if (lim.hi != kInf) {
    EXPECT_GT(below, 0);
    EXPECT_GT(above, 0);
  }
  const Vec dy = Random(s.xs(), 30), ds_final = Random(s.state(), 31);
  auto f = [&] {
    const Forward r = RunForward(in);
    return Dot(r.y, dy) + Dot(r.s_final, ds_final);
  };
  const Grads d = RunBackward(in, dy, ds_final);
  EXPECT_LT(FiniteDifferenceError(f, in.x, d.dx), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.dt_raw, d.ddt_raw), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.dt_bias, d.ddt_bias), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.A_log, d.dA_log), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.B, d.dB), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.C, d.dC), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.D, d.dD), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.s0, d.ds0), kTol);
}

INSTANTIATE_TEST_SUITE_P(ChunkLengthsAndLimits, SsdGradientTest,
                         ::testing::Values(GradientCase{1, {}}, GradientCase{9, {}}, GradientCase{11, {}},
                                           GradientCase{9, {0.3, 1.5}}, GradientCase{11, {0.3, 1.5}}));

// The clamp's gradient passes where lo < softplus < hi, as torch 2.15's clamp with scalar limits (transformers passes
// time_step_limit as floats): none at a limit itself.
TEST(SsdTest, ClampStopsTheGradientAtTheLimit) {
  const double sp0 = std::log1p(std::exp(0.0));  // softplus(0)
  Inputs in(Shape{1, 1, 1, 1, 1}, 25);
  in.dt_raw = {0.0};
  in.dt_bias = {0.0};
  for (Limits lim : {Limits{sp0, 2.0}, Limits{0.1, sp0}, Limits{0.7, 2.0}}) {
    in.lim = lim;
    const Grads d = RunBackward(in, Vec{1.0}, Vec{0.0});
    EXPECT_EQ(d.ddt_raw[0], 0.0) << lim.lo << " " << lim.hi;
    EXPECT_EQ(d.ddt_bias[0], 0.0) << lim.lo << " " << lim.hi;
  }
  in.lim = {sp0 - 1e-3, sp0 + 1e-3};  // just inside
  EXPECT_NE(RunBackward(in, Vec{1.0}, Vec{0.0}).ddt_raw[0], 0.0);
}

// Null s0 is a zero state, null ds_final a zero gradient, null ds0 leaves the others as they were; null D no skip
// and no dD.
TEST(SsdTest, NullArguments) {
  const Shape s = kSmall;
  Inputs in(s, 40);
  const Vec zeros(s.state(), 0.0), zero_d(s.heads, 0.0), dy = Random(s.xs(), 41);
  const Forward with_null = RunForward(in, nullptr, nullptr), with_zeros = RunForward(in, zeros.data(), zero_d.data());
  EXPECT_EQ(with_null.y, with_zeros.y);
  EXPECT_EQ(with_null.s_final, with_zeros.s_final);
  Vec y(s.xs());
  ops.ssd_forward(in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(), in.C.data(), nullptr,
                  nullptr, s.n, s.heads, s.head_dim, s.groups, s.N, 0, kInf, y.data(), nullptr);
  EXPECT_EQ(y, with_zeros.y);

  const Grads a = RunBackward(in, nullptr, nullptr, dy, nullptr);
  const Grads b = RunBackward(in, zeros.data(), zero_d.data(), dy, zeros.data());
  const Grads c = RunBackward(in, nullptr, nullptr, dy, nullptr, /*want_ds0=*/false);
  for (auto field : {&Grads::dx, &Grads::ddt_raw, &Grads::dB, &Grads::dC, &Grads::ddt_bias, &Grads::dA_log}) {
    EXPECT_EQ(a.*field, b.*field);
    EXPECT_EQ(a.*field, c.*field);
  }
  EXPECT_EQ(a.ds0, b.ds0);
  EXPECT_EQ(a.dD, Vec(s.heads, 0.0));  // untouched without D
}

// The carried state may stay in one buffer: s_final over s0, ds0 over ds_final.
TEST(SsdTest, StateBuffersMayAlias) {
  const Shape s = kLarge;
  Inputs in(s, 45);
  const Vec dy = Random(s.xs(), 46), ds_final = Random(s.state(), 47);
  const Forward want = RunForward(in);
  const Grads want_d = RunBackward(in, dy, ds_final);
  Vec state = in.s0, y(s.xs());
  ops.ssd_forward(in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(), in.C.data(),
                  in.D.data(), state.data(), s.n, s.heads, s.head_dim, s.groups, s.N, 0, kInf, y.data(), state.data());
  EXPECT_EQ(y, want.y);
  EXPECT_EQ(state, want.s_final);
  Grads d = want_d;
  Vec grad = ds_final, ddt_bias(s.heads), dA_log(s.heads), dD(s.heads);
  Vec workspace(ops.ssd_workspace_elems(s.n, s.heads, s.head_dim, s.groups, s.N));
  ops.ssd_backward(dy.data(), grad.data(), in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(),
                   in.B.data(), in.C.data(), in.D.data(), in.s0.data(), s.n, s.heads, s.head_dim, s.groups, s.N, 0,
                   kInf, d.dx.data(), d.ddt_raw.data(), ddt_bias.data(), dA_log.data(), d.dB.data(), d.dC.data(),
                   dD.data(), grad.data(), workspace.data());
  EXPECT_EQ(grad, want_d.ds0);
  EXPECT_EQ(d.dx, want_d.dx);
  EXPECT_EQ(dA_log, want_d.dA_log);
}

Inputs Part(const Inputs& in, int64_t from, int64_t count) {
  Inputs p = in;
  const Shape& s = in.s;
  p.s.n = count;
  p.x = Rows(in.x, from, count, s.heads * s.head_dim);
  p.dt_raw = Rows(in.dt_raw, from, count, s.heads);
  p.B = Rows(in.B, from, count, s.groups * s.N);
  p.C = Rows(in.C, from, count, s.groups * s.N);
  return p;
}

Vec Sum(const Vec& a, const Vec& b) {
  Vec c = a;
  for (size_t i = 0; i < c.size(); ++i) c[i] += b[i];
  return c;
}

// Two chunks, s_final of the first as s0 of the second and ds0 of the second as ds_final of the first, give the
// one-chunk outputs and gradients (the per-head parameters' gradients summed over the chunks).
TEST(SsdTest, ChunksRelayingTheStateEqualWholeSequence) {
  const Shape s = kLarge;
  const int64_t split = 23;
  const Inputs whole(s, 50, Limits{0.2, 2.0}), first = Part(whole, 0, split), second = Part(whole, split, s.n - split);
  const Vec dy = Random(s.xs(), 51), ds_final = Random(s.state(), 52);
  const Forward all = RunForward(whole);
  const Grads all_d = RunBackward(whole, dy, ds_final);

  const Forward f1 = RunForward(first);
  const Forward f2 = RunForward(second, f1.s_final.data(), second.D.data());
  EXPECT_LT(MaxDiff(Concat(f1.y, f2.y), all.y), 1e-12);
  EXPECT_LT(MaxDiff(f2.s_final, all.s_final), 1e-12);
  const int64_t row = s.heads * s.head_dim;
  const Grads d2 =
      RunBackward(second, f1.s_final.data(), second.D.data(), Rows(dy, split, s.n - split, row), ds_final.data());
  const Grads d1 = RunBackward(first, first.s0.data(), first.D.data(), Rows(dy, 0, split, row), d2.ds0.data());
  for (auto field : {&Grads::dx, &Grads::ddt_raw, &Grads::dB, &Grads::dC})
    EXPECT_LT(MaxDiff(Concat(d1.*field, d2.*field), all_d.*field), 1e-11);
  for (auto field : {&Grads::ddt_bias, &Grads::dA_log, &Grads::dD})
    EXPECT_LT(MaxDiff(Sum(d1.*field, d2.*field), all_d.*field), 1e-10);
  EXPECT_LT(MaxDiff(d1.ds0, all_d.ds0), 1e-11);
}

std::vector<float> F32(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

TEST(SsdTest, F32CloseToF64) {
  const Shape s = kLarge;
  const Inputs in(s, 60, Limits{0.1, 2.5});
  const Vec dy = Random(s.xs(), 61), ds_final = Random(s.state(), 62);
  const Forward f64 = RunForward(in);
  const Grads d64 = RunBackward(in, dy, ds_final);

  const std::vector<float> x = F32(in.x), dt_raw = F32(in.dt_raw), dt_bias = F32(in.dt_bias), A_log = F32(in.A_log),
                           B = F32(in.B), C = F32(in.C), D = F32(in.D), s0 = F32(in.s0), dyf = F32(dy),
                           dsf = F32(ds_final);
  std::vector<float> y(x.size()), sf(s0.size()), dx(x.size()), ddt(dt_raw.size()), dB(B.size()), dC(C.size()),
      ds0(s0.size()), ddt_bias(s.heads), dA_log(s.heads), dD(s.heads);
  const OpTable<float>& ops32 = CpuOps<float>();
  std::vector<float> workspace(ops32.ssd_workspace_elems(s.n, s.heads, s.head_dim, s.groups, s.N));
  ops32.ssd_forward(x.data(), dt_raw.data(), dt_bias.data(), A_log.data(), B.data(), C.data(), D.data(), s0.data(), s.n,
                    s.heads, s.head_dim, s.groups, s.N, in.lim.lo, in.lim.hi, y.data(), sf.data());
  ops32.ssd_backward(dyf.data(), dsf.data(), x.data(), dt_raw.data(), dt_bias.data(), A_log.data(), B.data(), C.data(),
                     D.data(), s0.data(), s.n, s.heads, s.head_dim, s.groups, s.N, in.lim.lo, in.lim.hi, dx.data(),
                     ddt.data(), ddt_bias.data(), dA_log.data(), dB.data(), dC.data(), dD.data(), ds0.data(),
                     workspace.data());
  EXPECT_LT(RelErr(y, f64.y), 1e-5);
  EXPECT_LT(RelErr(sf, f64.s_final), 1e-5);
  EXPECT_LT(RelErr(dx, d64.dx), 1e-5);
  EXPECT_LT(RelErr(ddt, d64.ddt_raw), 1e-5);
  EXPECT_LT(RelErr(dB, d64.dB), 1e-5);
  EXPECT_LT(RelErr(dC, d64.dC), 1e-5);
  EXPECT_LT(RelErr(ds0, d64.ds0), 1e-5);
  EXPECT_LT(RelErr(ddt_bias, d64.ddt_bias), 1e-5);
  EXPECT_LT(RelErr(dA_log, d64.dA_log), 1e-5);
  EXPECT_LT(RelErr(dD, d64.dD), 1e-5);
}

// Bit for bit the same results on 1 and on 3 threads (the CPU is the reference).
TEST(SsdTest, ResultsDoNotDependOnTheThreadCount) {
  const Shape s = kLarge;
  const Inputs in(s, 65, Limits{0.2, 2.0});
  const Vec dy = Random(s.xs(), 66), ds_final = Random(s.state(), 67);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Forward f1 = RunForward(in);
  const Grads d1 = RunBackward(in, dy, ds_final);
  omp_set_num_threads(3);
  const Forward f3 = RunForward(in);
  const Grads d3 = RunBackward(in, dy, ds_final);
  omp_set_num_threads(threads);
  EXPECT_EQ(f1.y, f3.y);
  EXPECT_EQ(f1.s_final, f3.s_final);
  for (auto field :
       {&Grads::dx, &Grads::ddt_raw, &Grads::dB, &Grads::dC, &Grads::ds0, &Grads::ddt_bias, &Grads::dA_log, &Grads::dD})
    EXPECT_EQ(d1.*field, d3.*field);
}

// Checkpoints every sqrt(n) tokens and one block of states per head, plus dB and dC per head.
TEST(SsdTest, WorkspaceGrowsAsSqrtOfTheChunk) {
  const int64_t state = 4 * 8 * 16, rows = 2 * 4 * 16;
  EXPECT_EQ(ops.ssd_workspace_elems(64, 4, 8, 2, 16), (8 + 8 + 1) * state + 64 * rows);
  EXPECT_EQ(ops.ssd_workspace_elems(65, 4, 8, 2, 16), (8 + 9 + 1) * state + 65 * rows);
  EXPECT_EQ(ops.ssd_workspace_elems(0, 4, 8, 2, 16), (0 + 1 + 1) * state);
}

TEST(SsdTest, RefusesBadArguments) {
  const Shape s = kSmall;
  Inputs in(s, 70);
  Vec y(s.xs());
  auto forward = [&](int64_t groups, double lo, double hi) {
    ops.ssd_forward(in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(), in.C.data(),
                    nullptr, nullptr, s.n, s.heads, s.head_dim, groups, s.N, lo, hi, y.data(), nullptr);
  };
  EXPECT_THROW(forward(3, 0, kInf), std::invalid_argument);  // 3 groups of 4 heads
  EXPECT_THROW(forward(0, 0, kInf), std::invalid_argument);
  EXPECT_THROW(forward(2, 1.0, 0.5), std::invalid_argument);
  Vec d(s.xs());
  EXPECT_THROW(
      ops.gated_group_rmsnorm_forward(in.x.data(), in.x.data(), in.x.data(), 1, 12, 5, 1e-6, y.data(), d.data()),
      std::invalid_argument);
}

// ---- Adjoint sharding (ssd_backward_pairs) ----

struct PairsRun {
  Grads d;
  int64_t pairs;
};

// The pairs op over `in` with the tokens after it (none when after is null), window `window`.
PairsRun RunPairs(const Inputs& in, const double* s0, const Vec& dy, const Inputs* after, const Vec* after_dy,
                  int64_t window) {
  const Shape& s = in.s;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  PairsRun r{{Vec(s.xs(), nan), Vec(s.n * s.heads, nan), Vec(s.bcs(), nan), Vec(s.bcs(), nan), Vec(), Vec(s.heads),
              Vec(s.heads), Vec(s.heads)},
             0};
  Vec workspace(ops.ssd_workspace_elems(s.n, s.heads, s.head_dim, s.groups, s.N), nan);
  r.pairs = ops.ssd_backward_pairs(
      dy.data(), in.x.data(), in.dt_raw.data(), in.dt_bias.data(), in.A_log.data(), in.B.data(), in.C.data(),
      in.D.data(), s0, s.n, s.heads, s.head_dim, s.groups, s.N, in.lim.lo, in.lim.hi,
      after ? after_dy->data() : nullptr, after ? after->dt_raw.data() : nullptr, after ? after->C.data() : nullptr,
      after ? after->s.n : 0, window, r.d.dx.data(), r.d.ddt_raw.data(), r.d.ddt_bias.data(), r.d.dA_log.data(),
      r.d.dB.data(), r.d.dC.data(), r.d.dD.data(), workspace.data());
  return r;
}

// Adjoint sharding with every pair (window >= the tokens left), the later tokens' cotangents handed to the first
// chunk, gives ssd_backward's gradients; the pair counts are the paper's (sum over i of T - i).
TEST(SsdPairsTest, PairsOverChunksEqualBackward) {
  const Shape s{48, 4, 3, 2, 5};
  const int64_t split = 19, m = s.n - split, all = int64_t(1) << 40;
  const Inputs whole(s, 100, Limits{0.2, 2.0}), first = Part(whole, 0, split), second = Part(whole, split, m);
  const Vec dy = Random(s.xs(), 101), no_grad(s.state(), 0.0);
  const Grads want = RunBackward(whole, dy, no_grad);
  const int64_t row = s.heads * s.head_dim;
  const Vec dy1 = Rows(dy, 0, split, row), dy2 = Rows(dy, split, m, row);
  const Forward f1 = RunForward(first);
  const PairsRun late = RunPairs(second, f1.s_final.data(), dy2, nullptr, nullptr, all);
  const PairsRun early = RunPairs(first, first.s0.data(), dy1, &second, &dy2, all);
  EXPECT_EQ(late.pairs, m * (m + 1) / 2);
  EXPECT_EQ(late.pairs + early.pairs, s.n * (s.n + 1) / 2);
  for (auto field : {&Grads::dx, &Grads::ddt_raw, &Grads::dB, &Grads::dC})
    EXPECT_LT(MaxDiff(Concat(early.d.*field, late.d.*field), want.*field), 1e-12);
  for (auto field : {&Grads::ddt_bias, &Grads::dA_log, &Grads::dD})
    EXPECT_LT(MaxDiff(Sum(early.d.*field, late.d.*field), want.*field), 1e-11);
}

// A truncated window keeps the pairs with t - i < window only: dx and dB against the definition, with the adjoint
// states written as exp(A * (sum of dt)) instead of running products; T̄T - T̄(T̄-1)/2 pairs per head.
TEST(SsdPairsTest, TruncatedWindowMatchesDefinition) {
  const Shape s{23, 4, 3, 2, 5};
  const int64_t window = 6;
  const Inputs in(s, 110, Limits{0.2, 2.0});
  const Vec dy = Random(s.xs(), 111);
  const PairsRun got = RunPairs(in, in.s0.data(), dy, nullptr, nullptr, window);
  EXPECT_EQ(got.pairs, window * s.n - window * (window - 1) / 2);

  Vec dx(s.xs(), 0.0), dB(s.bcs(), 0.0);
  for (int64_t h = 0; h < s.heads; ++h) {
    const int64_t g = h / (s.heads / s.groups);
    const double A = -std::exp(in.A_log[h]);
    for (int64_t i = 0; i < s.n; ++i) {
      const double dt = NaiveDt(in, i, h);
      for (int64_t p = 0; p < s.head_dim; ++p) {
        const int64_t xi = (i * s.heads + h) * s.head_dim + p;
        dx[xi] = in.D[h] * dy[xi];
        for (int64_t j = 0; j < s.N; ++j) {
          double dS = 0, sum = 0;  // the gradient of S_i[p][j]
          for (int64_t t = i; t < std::min(s.n, i + window); ++t) {
            if (t > i) sum += NaiveDt(in, t, h);
            dS += dy[(t * s.heads + h) * s.head_dim + p] * in.C[(t * s.groups + g) * s.N + j] * std::exp(A * sum);
          }
          dx[xi] += dt * dS * in.B[(i * s.groups + g) * s.N + j];
          dB[(i * s.groups + g) * s.N + j] += dt * dS * in.x[xi];
        }
      }
    }
  }
  EXPECT_LT(MaxDiff(got.d.dx, dx), 1e-12);
  EXPECT_LT(MaxDiff(got.d.dB, dB), 1e-12);
}

TEST(SsdPairsTest, RefusesAnEmptyWindow) {
  const Inputs in(kSmall, 120);
  const Vec dy = Random(kSmall.xs(), 121);
  EXPECT_THROW(RunPairs(in, nullptr, dy, nullptr, nullptr, 0), std::invalid_argument);
}

// ---- The gated group RMSNorm ----

struct NormInputs {
  int64_t rows, dim, group_size;
  Vec x, z, w;
  NormInputs(int64_t rows, int64_t dim, int64_t group_size, uint64_t seed)
      : rows(rows),
        dim(dim),
        group_size(group_size),
        x(Random(rows * dim, seed)),
        z(Random(rows * dim, seed + 1, 2.0)),
        w(Random(dim, seed + 2, 0.3, 1.0)) {}
};

constexpr double kEps = 1e-5;

struct NormForward {
  Vec out, rstd;
};

NormForward RunNorm(const NormInputs& in) {
  NormForward f{Vec(in.rows * in.dim), Vec(in.rows * in.dim / in.group_size)};
  ops.gated_group_rmsnorm_forward(in.x.data(), in.z.data(), in.w.data(), in.rows, in.dim, in.group_size, kEps,
                                  f.out.data(), f.rstd.data());
  return f;
}

struct NormGrads {
  Vec dx, dz, dw;
};

NormGrads RunNormBackward(const NormInputs& in, const Vec& dout, const Vec& dw0) {
  const NormForward f = RunNorm(in);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  NormGrads d{Vec(in.x.size(), nan), Vec(in.z.size(), nan), dw0};
  ops.gated_group_rmsnorm_backward(dout.data(), in.x.data(), in.z.data(), in.w.data(), f.rstd.data(), in.rows, in.dim,
                                   in.group_size, kEps, d.dx.data(), d.dz.data(), d.dw.data());
  return d;
}

TEST(GatedGroupRmsnormTest, ForwardMatchesTransformersFormula) {
  const NormInputs in(3, 12, 4, 80);
  const NormForward f = RunNorm(in);
  for (int64_t r = 0; r < in.rows; ++r)
    for (int64_t g = 0; g < in.dim / in.group_size; ++g) {
      double ss = 0;
      Vec u(in.group_size);
      for (int64_t j = 0; j < in.group_size; ++j) {
        const int64_t i = r * in.dim + g * in.group_size + j;
        u[j] = in.x[i] * in.z[i] / (1 + std::exp(-in.z[i]));
        ss += u[j] * u[j];
      }
      const double rstd = 1 / std::sqrt(ss / in.group_size + kEps);
      EXPECT_NEAR(f.rstd[r * in.dim / in.group_size + g], rstd, 1e-13);
      for (int64_t j = 0; j < in.group_size; ++j)
        EXPECT_NEAR(f.out[r * in.dim + g * in.group_size + j], in.w[g * in.group_size + j] * u[j] * rstd, 1e-13);
    }
}

TEST(GatedGroupRmsnormTest, GradientsAgainstFiniteDifferences) {
  for (int64_t group_size : {4, 12}) {
    NormInputs in(3, 12, group_size, 85);
    const Vec dout = Random(in.x.size(), 86), dw0 = Random(in.dim, 87);
    auto f = [&] { return Dot(RunNorm(in).out, dout); };
    NormGrads d = RunNormBackward(in, dout, dw0);
    for (int64_t j = 0; j < in.dim; ++j) d.dw[j] -= dw0[j];  // accumulated
    EXPECT_LT(FiniteDifferenceError(f, in.x, d.dx), kTol) << group_size;
    EXPECT_LT(FiniteDifferenceError(f, in.z, d.dz), kTol) << group_size;
    EXPECT_LT(FiniteDifferenceError(f, in.w, d.dw), kTol) << group_size;
  }
}

TEST(GatedGroupRmsnormTest, ResultsDoNotDependOnTheThreadCount) {
  const NormInputs in(300, 256, 64, 90);  // past the threaded path's threshold
  const Vec dout = Random(in.x.size(), 91), dw0(in.dim, 0.0);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const NormForward f1 = RunNorm(in);
  const NormGrads d1 = RunNormBackward(in, dout, dw0);
  omp_set_num_threads(3);
  const NormForward f3 = RunNorm(in);
  const NormGrads d3 = RunNormBackward(in, dout, dw0);
  omp_set_num_threads(threads);
  EXPECT_EQ(f1.out, f3.out);
  EXPECT_EQ(f1.rstd, f3.rstd);
  EXPECT_EQ(d1.dx, d3.dx);
  EXPECT_EQ(d1.dz, d3.dz);
  EXPECT_EQ(d1.dw, d3.dw);
}

}  // namespace
}  // namespace sg
