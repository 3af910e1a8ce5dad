// The Gated DeltaNet ops (kernels/cpu/gated_delta.cc, pointwise.cc): the forward against a naive recurrence, every
// gradient against central finite differences in fp64, a sequence in two chunks (state relayed forward, its
// gradient backward) against the sequence in one, the null state arguments, and f32 against f64.
#include <gtest/gtest.h>

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
const OpTable<double>& ops = CpuOps<double>();

struct Shape {
  int64_t n, k_heads, v_heads, dk, dv;
  int64_t state() const { return v_heads * dk * dv; }
};

// Inputs of one chunk: decays g < 0 and gates beta in (0, 1), as the model's gates give them.
struct Inputs {
  Shape s;
  Vec q, k, v, g, beta, s0;
  Inputs(Shape s, uint64_t seed)
      : s(s),
        q(Random(s.n * s.k_heads * s.dk, seed)),
        k(Random(s.n * s.k_heads * s.dk, seed + 1, 0.5)),
        v(Random(s.n * s.v_heads * s.dv, seed + 2)),
        g(Random(s.n * s.v_heads, seed + 3, 0.2, -0.4)),
        beta(Random(s.n * s.v_heads, seed + 4, 0.15, 0.5)),
        s0(Random(s.state(), seed + 5)) {}
};

struct Forward {
  Vec out, s_final;
};

Forward RunForward(const Inputs& in, const double* s0) {
  const Shape& s = in.s;
  Forward f{Vec(s.n * s.v_heads * s.dv), Vec(s.state())};
  ops.gated_delta_forward(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), s0, s.n, s.k_heads,
                          s.v_heads, s.dk, s.dv, f.out.data(), f.s_final.data());
  return f;
}

struct Grads {
  Vec dq, dk, dv, dg, dbeta, ds0;
};

// The backward with a NaN-filled workspace (a read before a write shows) and NaN-filled outputs (each must be
// assigned).
Grads RunBackward(const Inputs& in, const double* s0, const Vec& dout, const double* ds_final, bool want_ds0 = true) {
  const Shape& s = in.s;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Grads d{Vec(in.q.size(), nan), Vec(in.k.size(), nan),    Vec(in.v.size(), nan),
          Vec(in.g.size(), nan), Vec(in.beta.size(), nan), Vec(s.state(), nan)};
  Vec workspace(ops.gated_delta_workspace_elems(s.n, s.v_heads, s.dk, s.dv), nan);
  ops.gated_delta_backward(dout.data(), ds_final, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                           s0, s.n, s.k_heads, s.v_heads, s.dk, s.dv, d.dq.data(), d.dk.data(), d.dv.data(),
                           d.dg.data(), d.dbeta.data(), want_ds0 ? d.ds0.data() : nullptr, workspace.data());
  return d;
}

// The recurrence as written in the contract, one value head at a time, value head h reading key head
// h / (v_heads / k_heads).
Forward NaiveForward(const Inputs& in) {
  const Shape& s = in.s;
  Forward f{Vec(s.n * s.v_heads * s.dv), Vec(s.state())};
  for (int64_t h = 0; h < s.v_heads; ++h) {
    const int64_t kh = h / (s.v_heads / s.k_heads);
    std::vector<Vec> S(s.dk, Vec(s.dv));
    for (int64_t i = 0; i < s.dk; ++i)
      for (int64_t j = 0; j < s.dv; ++j) S[i][j] = in.s0[(h * s.dk + i) * s.dv + j];
    for (int64_t t = 0; t < s.n; ++t) {
      const double* q = &in.q[(t * s.k_heads + kh) * s.dk];
      const double* k = &in.k[(t * s.k_heads + kh) * s.dk];
      const double* v = &in.v[(t * s.v_heads + h) * s.dv];
      const double decay = std::exp(in.g[t * s.v_heads + h]), beta = in.beta[t * s.v_heads + h];
      for (auto& row : S)
        for (double& x : row) x *= decay;
      for (int64_t j = 0; j < s.dv; ++j) {
        double u = 0;
        for (int64_t i = 0; i < s.dk; ++i) u += S[i][j] * k[i];
        const double delta = beta * (v[j] - u);
        for (int64_t i = 0; i < s.dk; ++i) S[i][j] += k[i] * delta;
        double out = 0;
        for (int64_t i = 0; i < s.dk; ++i) out += S[i][j] * q[i];
        f.out[(t * s.v_heads + h) * s.dv + j] = out;
      }
    }
    for (int64_t i = 0; i < s.dk; ++i)
      for (int64_t j = 0; j < s.dv; ++j) f.s_final[(h * s.dk + i) * s.dv + j] = S[i][j];
  }
  return f;
}

constexpr Shape kSmall{9, 2, 4, 3, 5};
// Large enough for the threaded path, with a last block shorter than the others (70 tokens: blocks of 9).
constexpr Shape kLarge{70, 2, 4, 8, 16};

TEST(GatedDeltaTest, ForwardMatchesNaiveRecurrence) {
  for (Shape s : {kSmall, kLarge, Shape{5, 1, 3, 4, 2}}) {
    const Inputs in(s, 10);
    const Forward got = RunForward(in, in.s0.data()), want = NaiveForward(in);
    EXPECT_LT(MaxDiff(got.out, want.out), 1e-13) << "n " << s.n;
    EXPECT_LT(MaxDiff(got.s_final, want.s_final), 1e-13) << "n " << s.n;
  }
}

// Chunk lengths 1 (one block), 9 (three full blocks), 11 (a short last block).
class GatedDeltaGradientTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(GatedDeltaGradientTest, EveryInputAgainstFiniteDifferences) {
  Shape s = kSmall;
  s.n = GetParam();
  Inputs in(s, 20);
  const Vec dout = Random(s.n * s.v_heads * s.dv, 30), ds_final = Random(s.state(), 31);
  auto f = [&] {
    const Forward r = RunForward(in, in.s0.data());
    return Dot(r.out, dout) + Dot(r.s_final, ds_final);
  };
  const Grads d = RunBackward(in, in.s0.data(), dout, ds_final.data());
  EXPECT_LT(FiniteDifferenceError(f, in.q, d.dq), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.k, d.dk), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.v, d.dv), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.g, d.dg), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.beta, d.dbeta), kTol);
  EXPECT_LT(FiniteDifferenceError(f, in.s0, d.ds0), kTol);
}

INSTANTIATE_TEST_SUITE_P(ChunkLengths, GatedDeltaGradientTest, ::testing::Values(1, 9, 11));

// Null s0 is a zero state, null ds_final a zero gradient, null ds0 leaves the other gradients as they were.
TEST(GatedDeltaTest, NullStatesAreZeros) {
  Inputs in(kSmall, 40);
  const Vec zeros(kSmall.state(), 0.0), dout = Random(in.v.size(), 41);
  const Forward with_null = RunForward(in, nullptr), with_zeros = RunForward(in, zeros.data());
  EXPECT_EQ(with_null.out, with_zeros.out);
  EXPECT_EQ(with_null.s_final, with_zeros.s_final);
  Vec out(in.v.size());
  ops.gated_delta_forward(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), nullptr, kSmall.n,
                          kSmall.k_heads, kSmall.v_heads, kSmall.dk, kSmall.dv, out.data(), nullptr);
  EXPECT_EQ(out, with_zeros.out);

  const Grads a = RunBackward(in, nullptr, dout, nullptr);
  const Grads b = RunBackward(in, zeros.data(), dout, zeros.data());
  const Grads c = RunBackward(in, nullptr, dout, nullptr, /*want_ds0=*/false);
  for (auto field : {&Grads::dq, &Grads::dk, &Grads::dv, &Grads::dg, &Grads::dbeta}) {
    EXPECT_EQ(a.*field, b.*field);
    EXPECT_EQ(a.*field, c.*field);
  }
  EXPECT_EQ(a.ds0, b.ds0);
}

// The carried state may stay in one buffer: s_final over s0, ds0 over ds_final.
TEST(GatedDeltaTest, StateBuffersMayAlias) {
  Inputs in(kLarge, 45);
  const Vec dout = Random(in.v.size(), 46), ds_final = Random(kLarge.state(), 47);
  const Forward want = RunForward(in, in.s0.data());
  const Grads want_d = RunBackward(in, in.s0.data(), dout, ds_final.data());
  const Shape& s = kLarge;
  Vec state = in.s0, out(in.v.size());
  ops.gated_delta_forward(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), state.data(), s.n,
                          s.k_heads, s.v_heads, s.dk, s.dv, out.data(), state.data());
  EXPECT_EQ(out, want.out);
  EXPECT_EQ(state, want.s_final);
  Vec grad = ds_final, dq(in.q.size()), dk(in.k.size()), dv(in.v.size()), dg(in.g.size()), dbeta(in.beta.size());
  Vec workspace(ops.gated_delta_workspace_elems(s.n, s.v_heads, s.dk, s.dv));
  ops.gated_delta_backward(dout.data(), grad.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                           in.s0.data(), s.n, s.k_heads, s.v_heads, s.dk, s.dv, dq.data(), dk.data(), dv.data(),
                           dg.data(), dbeta.data(), grad.data(), workspace.data());
  EXPECT_EQ(grad, want_d.ds0);
  EXPECT_EQ(dq, want_d.dq);
  EXPECT_EQ(dg, want_d.dg);
}

Inputs Part(const Inputs& in, int64_t from, int64_t count) {
  Inputs p = in;
  const Shape& s = in.s;
  p.s.n = count;
  p.q = Rows(in.q, from, count, s.k_heads * s.dk);
  p.k = Rows(in.k, from, count, s.k_heads * s.dk);
  p.v = Rows(in.v, from, count, s.v_heads * s.dv);
  p.g = Rows(in.g, from, count, s.v_heads);
  p.beta = Rows(in.beta, from, count, s.v_heads);
  return p;
}

// Two chunks, s_final of the first as s0 of the second and ds0 of the second as ds_final of the first, give the
// one-chunk outputs and gradients.
TEST(GatedDeltaTest, ChunksRelayingTheStateEqualWholeSequence) {
  const Shape s = kLarge;
  const int64_t split = 23;
  const Inputs whole(s, 50), first = Part(whole, 0, split), second = Part(whole, split, s.n - split);
  const Vec dout = Random(s.n * s.v_heads * s.dv, 51), ds_final = Random(s.state(), 52);
  const Forward all = RunForward(whole, whole.s0.data());
  const Grads all_d = RunBackward(whole, whole.s0.data(), dout, ds_final.data());

  const Forward f1 = RunForward(first, first.s0.data());
  const Forward f2 = RunForward(second, f1.s_final.data());
  EXPECT_LT(MaxDiff(Concat(f1.out, f2.out), all.out), 1e-12);
  EXPECT_LT(MaxDiff(f2.s_final, all.s_final), 1e-12);
  const int64_t row = s.v_heads * s.dv;
  const Grads d2 = RunBackward(second, f1.s_final.data(), Rows(dout, split, s.n - split, row), ds_final.data());
  const Grads d1 = RunBackward(first, first.s0.data(), Rows(dout, 0, split, row), d2.ds0.data());
  for (auto field : {&Grads::dq, &Grads::dk, &Grads::dv, &Grads::dg, &Grads::dbeta})
    EXPECT_LT(MaxDiff(Concat(d1.*field, d2.*field), all_d.*field), 1e-11);
  EXPECT_LT(MaxDiff(d1.ds0, all_d.ds0), 1e-11);
}

TEST(GatedDeltaTest, F32CloseToF64) {
  const Shape s = kLarge;
  const Inputs in(s, 60);
  const Vec dout = Random(s.n * s.v_heads * s.dv, 61), ds_final = Random(s.state(), 62);
  const Forward f64 = RunForward(in, in.s0.data());
  const Grads d64 = RunBackward(in, in.s0.data(), dout, ds_final.data());

  auto f32 = [](const Vec& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> q = f32(in.q), k = f32(in.k), v = f32(in.v), g = f32(in.g), beta = f32(in.beta),
                           s0 = f32(in.s0), dy = f32(dout), dsf = f32(ds_final);
  std::vector<float> out(v.size()), sf(s0.size()), dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()),
      db(beta.size()), ds0(s0.size());
  const OpTable<float>& ops32 = CpuOps<float>();
  std::vector<float> workspace(ops32.gated_delta_workspace_elems(s.n, s.v_heads, s.dk, s.dv));
  ops32.gated_delta_forward(q.data(), k.data(), v.data(), g.data(), beta.data(), s0.data(), s.n, s.k_heads, s.v_heads,
                            s.dk, s.dv, out.data(), sf.data());
  ops32.gated_delta_backward(dy.data(), dsf.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), s0.data(), s.n,
                             s.k_heads, s.v_heads, s.dk, s.dv, dq.data(), dk.data(), dv.data(), dg.data(), db.data(),
                             ds0.data(), workspace.data());
  EXPECT_LT(RelErr(out, f64.out), 1e-5);
  EXPECT_LT(RelErr(sf, f64.s_final), 1e-5);
  EXPECT_LT(RelErr(dq, d64.dq), 1e-5);
  EXPECT_LT(RelErr(dk, d64.dk), 1e-5);
  EXPECT_LT(RelErr(dv, d64.dv), 1e-5);
  EXPECT_LT(RelErr(dg, d64.dg), 1e-5);
  EXPECT_LT(RelErr(db, d64.dbeta), 1e-5);
  EXPECT_LT(RelErr(ds0, d64.ds0), 1e-5);
}

// The workspace holds sqrt(n)-spaced checkpoints and one block of states per head, plus dq and dk per value head.
TEST(GatedDeltaTest, WorkspaceGrowsAsSqrtOfTheChunk) {
  const int64_t state = 4 * 8 * 16, rows = 2 * 4 * 8;
  EXPECT_EQ(ops.gated_delta_workspace_elems(64, 4, 8, 16), (8 + 8 + 1) * state + 64 * rows);
  EXPECT_EQ(ops.gated_delta_workspace_elems(65, 4, 8, 16), (8 + 9 + 1) * state + 65 * rows);
  EXPECT_EQ(ops.gated_delta_workspace_elems(0, 4, 8, 16), (0 + 1 + 1) * state);
}

TEST(GatedDeltaTest, KeyHeadsMustDivideValueHeads) {
  Inputs in(kSmall, 70);
  Vec out(in.v.size());
  EXPECT_THROW(ops.gated_delta_forward(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), nullptr,
                                       kSmall.n, 3, kSmall.v_heads, kSmall.dk, kSmall.dv, out.data(), nullptr),
               std::invalid_argument);
}

TEST(GdnGatesTest, ForwardAndGradients) {
  const int64_t n = 6, heads = 3;
  Vec a = Random(n * heads, 80, 2.0), b = Random(n * heads, 81, 2.0), a_log = Random(heads, 82, 0.5),
      dt_bias = Random(heads, 83);
  a[4] = 25;  // softplus above its threshold
  const Vec rg = Random(n * heads, 84), rb = Random(n * heads, 85), da_log0 = Random(heads, 86),
            ddt0 = Random(heads, 87);
  auto forward = [&](Vec& g, Vec& beta) {
    ops.gdn_gates_forward(a.data(), b.data(), a_log.data(), dt_bias.data(), n, heads, g.data(), beta.data());
  };
  Vec g(n * heads), beta(n * heads);
  forward(g, beta);
  for (int64_t i = 0; i < n * heads; ++i) {
    const double x = a[i] + dt_bias[i % heads];
    EXPECT_NEAR(beta[i], 1 / (1 + std::exp(-b[i])), 1e-15);
    EXPECT_NEAR(g[i], -std::exp(a_log[i % heads]) * (x > 20 ? x : std::log(1 + std::exp(x))), 1e-13);
  }
  auto f = [&] {
    Vec g2(n * heads), beta2(n * heads);
    forward(g2, beta2);
    return Dot(g2, rg) + Dot(beta2, rb);
  };
  Vec da(n * heads), db(n * heads), da_log = da_log0, ddt = ddt0;
  ops.gdn_gates_backward(rg.data(), rb.data(), a.data(), b.data(), a_log.data(), dt_bias.data(), n, heads, da.data(),
                         db.data(), da_log.data(), ddt.data());
  for (int64_t h = 0; h < heads; ++h) {  // accumulated
    da_log[h] -= da_log0[h];
    ddt[h] -= ddt0[h];
  }
  EXPECT_LT(FiniteDifferenceError(f, a, da), kTol);
  EXPECT_LT(FiniteDifferenceError(f, b, db), kTol);
  EXPECT_LT(FiniteDifferenceError(f, a_log, da_log), kTol);
  EXPECT_LT(FiniteDifferenceError(f, dt_bias, ddt), kTol);
}

TEST(SigmoidGateTest, ForwardAndGradients) {
  const int64_t count = 11;
  Vec gate = Random(count, 90, 2.0), x = Random(count, 91);
  const Vec r = Random(count, 92);
  Vec out(count);
  ops.sigmoid_gate_forward(gate.data(), x.data(), count, out.data());
  for (int64_t i = 0; i < count; ++i) EXPECT_NEAR(out[i], x[i] / (1 + std::exp(-gate[i])), 1e-15);
  auto f = [&] {
    Vec y(count);
    ops.sigmoid_gate_forward(gate.data(), x.data(), count, y.data());
    return Dot(y, r);
  };
  Vec dgate(count), dx(count);
  ops.sigmoid_gate_backward(r.data(), gate.data(), x.data(), count, dgate.data(), dx.data());
  EXPECT_LT(FiniteDifferenceError(f, gate, dgate), kTol);
  EXPECT_LT(FiniteDifferenceError(f, x, dx), kTol);
}

TEST(CopyRowsTest, CopiesAColumnBlockOnly) {
  const int64_t rows = 4, ld_src = 7, ld_dst = 5, cols = 3;
  const Vec src = Random(rows * ld_src, 95);
  Vec dst(rows * ld_dst, -1.0);
  ops.copy_rows(dst.data() + 1, ld_dst, src.data() + 2, ld_src, rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < ld_dst; ++c)
      EXPECT_EQ(dst[r * ld_dst + c], c >= 1 && c < 1 + cols ? src[r * ld_src + 2 + c - 1] : -1.0) << r << " " << c;
}

}  // namespace
}  // namespace sg
