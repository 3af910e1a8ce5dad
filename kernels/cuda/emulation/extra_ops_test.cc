// Shapes of the CUDA kernels' code paths that //kernels/cuda:ops_test.cc does not reach, run on the emulated
// backend against the CPU table: attention with head_dim 256 (the 32- and 16-row tiles), wide GQA groups, pages
// of 2 tokens; selective scan with 4 states per lane (65 <= N <= 128) and the pairs backward with several states
// per lane; conv1d with k = 1 and 2; one-column losses. Outputs carry guard elements (out-of-bounds writes) and
// assigned outputs start as NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/backend.h"

namespace sg {
namespace {

constexpr int64_t kGuard = 41;

template <typename T>
T Sentinel() {
  return static_cast<T>(-5555.5);
}

// Host memory is device memory under emulation: a vector with guard zones on both sides.
template <typename T>
struct Buf {
  std::vector<T> v;
  int64_t n;
  std::string name;
  Buf(int64_t count, T init, std::string nm) : v(count + 2 * kGuard, Sentinel<T>()), n(count), name(std::move(nm)) {
    std::fill(v.begin() + kGuard, v.begin() + kGuard + n, init);
  }
  Buf(const std::vector<T>& x, std::string nm) : Buf(static_cast<int64_t>(x.size()), T(0), std::move(nm)) {
    std::copy(x.begin(), x.end(), data());
  }
  T* data() { return v.data() + kGuard; }
  std::vector<double> Values() const {
    for (int64_t i = 0; i < n + 2 * kGuard; ++i)
      if ((i < kGuard || i >= kGuard + n) && !(v[i] == Sentinel<T>()))
        ADD_FAILURE() << name << ": out-of-bounds write at " << i - kGuard;
    return std::vector<double>(v.begin() + kGuard, v.begin() + kGuard + n);
  }
};

template <typename T>
std::vector<T> Rand(int64_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(d(rng));
  return v;
}

template <typename T>
constexpr double kTol = std::is_same_v<T, float> ? 5e-5 : 1e-11;

void ExpectClose(const std::vector<double>& got, const std::vector<double>& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 0, err = 0;
  size_t worst = 0;
  for (double r : ref)
    if (std::isfinite(r)) scale = std::max(scale, std::abs(r));
  for (size_t i = 0; i < ref.size(); ++i) {
    double e;
    if (std::isnan(got[i]) || std::isnan(ref[i])) e = std::isnan(got[i]) && std::isnan(ref[i]) ? 0 : INFINITY;
    else e = got[i] == ref[i] ? 0 : std::abs(got[i] - ref[i]);
    if (e > err) err = e, worst = i;
  }
  EXPECT_LE(err, tol * std::max(scale, 1e-300)) << what << ": max |cuda - cpu| = " << err << " (max |cpu| " << scale
                                                 << "), worst at " << worst << " (cuda " << got[worst] << ", cpu "
                                                 << ref[worst] << ")";
}

template <typename T>
using Outs = std::vector<std::pair<std::string, std::vector<double>>>;

template <typename T, typename F>
void Compare(F&& run, double tol, const std::string& what) {
  const Outs<T> cpu = run(Device::kCPU), cuda = run(Device::kCUDA);
  ASSERT_EQ(cpu.size(), cuda.size());
  for (size_t i = 0; i < cpu.size(); ++i) ExpectClose(cuda[i].second, cpu[i].second, tol, what + " " + cpu[i].first);
}

template <typename T>
class EmulatedExtraTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(DeviceUnavailableReason(Device::kCUDA), ""); }
};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EmulatedExtraTest, Types);

struct Attn {
  int64_t heads, kv_heads, hd, page, n, pos0;
  bool mask, holes;
};

template <typename T>
void CheckAttention(const Attn& c) {
  AttentionShape s;
  s.n = c.n;
  s.pos0 = c.pos0;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.hd;
  s.scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
  const int64_t pages = (c.pos0 + c.n + c.page - 1) / c.page, pool = pages + 2,
                stride = c.page * c.kv_heads * c.hd;
  std::vector<int32_t> table(pool);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937_64 rng(c.hd + c.n);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize(pages);
  std::vector<int32_t> gtable = table;
  std::vector<uint8_t> mask(pages, 1);
  if (c.mask)
    for (int64_t i = 1; i < pages; ++i) mask[i] = i % 4 != 2;
  if (c.holes)
    for (int64_t i = 0; i < pages; i += 3) gtable[i] = -1;
  const int64_t qn = c.n * c.heads * c.hd;
  const auto q = Rand<T>(qn, 1), k = Rand<T>(pool * stride, 2, -2, 2), v = Rand<T>(pool * stride, 3),
             dout = Rand<T>(qn, 4), dk0 = Rand<T>(pool * stride, 5), dv0 = Rand<T>(pool * stride, 6);
  auto run = [&](Device d) {
    const OpTable<T>& ops = OpsFor<T>(d);
    Buf<T> Q(q, "q"), K(k, "k"), V(v, "v"), DO(dout, "dout"), O(qn, NAN, "out"), L(c.n * c.heads, NAN, "lse"),
        DQ(qn, NAN, "dq"), DK(dk0, "dk"), DV(dv0, "dv"),
        W(std::max<int64_t>(1, ops.attention_workspace_elems(s, c.page)), T(0), "workspace");
    auto view = [&](T* kp, T* vp, const std::vector<int32_t>& t) {
      PagedKV<T> p;
      p.k_pool = kp;
      p.v_pool = vp;
      p.page_table = t.data();
      p.page_size = c.page;
      p.page_stride = stride;
      p.kv_heads = c.kv_heads;
      p.head_dim = c.hd;
      p.page_mask = c.mask ? mask.data() : nullptr;
      return p;
    };
    ops.attention_forward(s, Q.data(), view(K.data(), V.data(), table), O.data(), L.data(), W.data());
    ops.attention_backward(s, Q.data(), view(K.data(), V.data(), table), O.data(), L.data(), DO.data(), DQ.data(),
                           view(DK.data(), DV.data(), gtable), W.data());
    W.Values();
    return Outs<T>{{"out", O.Values()}, {"lse", L.Values()}, {"dq", DQ.Values()}, {"dk", DK.Values()},
                   {"dv", DV.Values()}};
  };
  Compare<T>(run, kTol<T>,
             "attention h" + std::to_string(c.heads) + " kv" + std::to_string(c.kv_heads) + " hd" +
                 std::to_string(c.hd) + " page" + std::to_string(c.page) + " n" + std::to_string(c.n) + " pos0 " +
                 std::to_string(c.pos0));
}

TYPED_TEST(EmulatedExtraTest, AttentionWideHeadsAndGroups) {
  for (const Attn& c : {Attn{2, 1, 256, 4, 40, 9, true, true}, Attn{2, 2, 200, 5, 19, 0, false, false},
                        Attn{8, 2, 16, 2, 33, 7, true, true}, Attn{3, 1, 48, 3, 70, 65, true, false}})
    CheckAttention<TypeParam>(c);
}

TYPED_TEST(EmulatedExtraTest, SelectiveScanFourStatesPerLane) {
  using T = TypeParam;
  for (auto [n, dim, N] : {std::tuple<int64_t, int64_t, int64_t>{6, 3, 100}, {4, 2, 128}, {5, 9, 65}, {3, 4, 1}}) {
    const auto u = Rand<T>(n * dim, 10), delta = Rand<T>(n * dim, 11, 0.05, 0.5), A = Rand<T>(dim * N, 12, -1.5, -0.1),
               B = Rand<T>(n * N, 13), C = Rand<T>(n * N, 14), D = Rand<T>(dim, 15), h0 = Rand<T>(dim * N, 16),
               dy = Rand<T>(n * dim, 17), dhf = Rand<T>(dim * N, 18), dA0 = Rand<T>(dim * N, 19),
               dD0 = Rand<T>(dim, 20);
    auto run = [&](Device d) {
      const OpTable<T>& ops = OpsFor<T>(d);
      Buf<T> U(u, "u"), DT(delta, "delta"), AA(A, "A"), BB(B, "B"), CC(C, "C"), DD(D, "D"), H0(h0, "h0"),
          Y(n * dim, NAN, "y"), HF(dim * N, NAN, "h_final"), DY(dy, "dy"), DHF(dhf, "dh_final"),
          DU(n * dim, NAN, "du"), DDT(n * dim, NAN, "ddelta"), DA(dA0, "dA"), DB(n * N, NAN, "dB"),
          DC(n * N, NAN, "dC"), DDD(dD0, "dD"), DH0(dim * N, NAN, "dh0");
      ops.selective_scan_forward(U.data(), DT.data(), AA.data(), BB.data(), CC.data(), DD.data(), H0.data(), n, dim,
                                 N, Y.data(), HF.data());
      ops.selective_scan_backward(DY.data(), DHF.data(), U.data(), DT.data(), AA.data(), BB.data(), CC.data(),
                                  DD.data(), H0.data(), n, dim, N, DU.data(), DDT.data(), DA.data(), DB.data(),
                                  DC.data(), DDD.data(), DH0.data());
      // Pairs backward (window 3) on the same chunk, no later tokens.
      Buf<T> PU(n * dim, NAN, "pairs du"), PDT(n * dim, NAN, "pairs ddelta"), PA(dA0, "pairs dA"),
          PB(n * N, NAN, "pairs dB"), PC(n * N, NAN, "pairs dC"), PD(dD0, "pairs dD");
      ops.selective_scan_backward_pairs(DY.data(), U.data(), DT.data(), AA.data(), BB.data(), CC.data(), DD.data(),
                                        H0.data(), n, dim, N, nullptr, nullptr, nullptr, 0, 3, PU.data(), PDT.data(),
                                        PA.data(), PB.data(), PC.data(), PD.data());
      return Outs<T>{{"y", Y.Values()},       {"h_final", HF.Values()},  {"du", DU.Values()},
                     {"ddelta", DDT.Values()}, {"dA", DA.Values()},       {"dB", DB.Values()},
                     {"dC", DC.Values()},      {"dD", DDD.Values()},      {"dh0", DH0.Values()},
                     {"pairs du", PU.Values()}, {"pairs ddelta", PDT.Values()}, {"pairs dA", PA.Values()},
                     {"pairs dB", PB.Values()}, {"pairs dC", PC.Values()}, {"pairs dD", PD.Values()}};
    };
    Compare<T>(run, kTol<T>, "scan n=" + std::to_string(n) + " dim=" + std::to_string(dim) + " N=" + std::to_string(N));
  }
}

TYPED_TEST(EmulatedExtraTest, Conv1dShortKernels) {
  using T = TypeParam;
  for (int64_t k : {1, 2}) {
    const int64_t n = 5, ch = 70, tail = (k - 1) * ch;
    const auto x = Rand<T>(n * ch, 30), tin = Rand<T>(std::max<int64_t>(tail, 0), 31), w = Rand<T>(ch * k, 32),
               b = Rand<T>(ch, 33), dy = Rand<T>(n * ch, 34), dto = Rand<T>(tail, 35), dw0 = Rand<T>(ch * k, 36),
               db0 = Rand<T>(ch, 37);
    auto run = [&](Device d) {
      const OpTable<T>& ops = OpsFor<T>(d);
      Buf<T> X(x, "x"), TI(tin, "tail_in"), W(w, "w"), B(b, "b"), Y(n * ch, NAN, "y"), TO(tail, NAN, "tail_out"),
          DY(dy, "dy"), DTO(dto, "dtail_out"), DX(n * ch, NAN, "dx"), DTI(tail, NAN, "dtail_in"), DW(dw0, "dw"),
          DB(db0, "db");
      ops.conv1d_forward(X.data(), TI.data(), W.data(), B.data(), n, ch, k, Y.data(), TO.data());
      ops.conv1d_backward(DY.data(), DTO.data(), X.data(), TI.data(), W.data(), n, ch, k, DX.data(), DTI.data(),
                          DW.data(), DB.data());
      return Outs<T>{{"y", Y.Values()},   {"tail_out", TO.Values()}, {"dx", DX.Values()},
                     {"dtail_in", DTI.Values()}, {"dw", DW.Values()}, {"db", DB.Values()}};
    };
    Compare<T>(run, kTol<T>, "conv1d k=" + std::to_string(k));
  }
}

TYPED_TEST(EmulatedExtraTest, OneColumnLosses) {
  using T = TypeParam;
  for (int64_t vocab : {1, 2, 513}) {
    const int64_t n = 4;
    std::vector<int32_t> labels = {0, -100, static_cast<int32_t>(vocab - 1), 0};
    const auto logits = Rand<T>(n * vocab, 40 + vocab, -4, 4);
    auto run = [&](Device d) {
      const OpTable<T>& ops = OpsFor<T>(d);
      Buf<T> G(logits, "dlogits"), L(logits, "logits");
      std::vector<double> lp(n, NAN);
      std::vector<int32_t> am(n, 77);
      const double loss = ops.cross_entropy_forward_backward(G.data(), labels.data(), n, vocab, nullptr, 0.5);
      ops.token_logprobs(L.data(), labels.data(), n, vocab, lp.data());
      ops.token_argmax(L.data(), labels.data(), n, vocab, am.data());
      return Outs<T>{{"dlogits", G.Values()},
                     {"loss", {loss}},
                     {"logprobs", lp},
                     {"argmax", std::vector<double>(am.begin(), am.end())}};
    };
    Compare<T>(run, kTol<T>, "losses vocab=" + std::to_string(vocab));
  }
}

}  // namespace
}  // namespace sg
