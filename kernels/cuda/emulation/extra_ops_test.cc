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
#include "kernels/cuda/ops_test_support.h"

namespace sg {
namespace {

using namespace ops_test;  // NOLINT: the shared harness

// The emulated device's outputs against the CPU table's.
template <typename F>
void Compare(F&& run, double tol, const std::string& what) {
  ExpectAllClose(run(Device::kCUDA), run(Device::kCPU), tol, what);
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
  const int64_t pages = (c.pos0 + c.n + c.page - 1) / c.page, pool = pages + 2, stride = c.page * c.kv_heads * c.hd;
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
    Buf<T> Q(d, q, "q"), K(d, k, "k"), V(d, v, "v"), DO(d, dout, "dout"), O(d, qn, NAN, "out"),
        L(d, c.n * c.heads, NAN, "lse"), DQ(d, qn, NAN, "dq"), DK(d, dk0, "dk"), DV(d, dv0, "dv"),
        W(d, std::max<int64_t>(1, ops.attention_workspace_elems(s, c.page)), T(0), "workspace");
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
    return Outs{
        {{"out", O.Values()}, {"lse", L.Values()}, {"dq", DQ.Values()}, {"dk", DK.Values()}, {"dv", DV.Values()}}};
  };
  Compare(run, kLoose<T>,
          "attention h" + std::to_string(c.heads) + " kv" + std::to_string(c.kv_heads) + " hd" + std::to_string(c.hd) +
              " page" + std::to_string(c.page) + " n" + std::to_string(c.n) + " pos0 " + std::to_string(c.pos0));
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
      Buf<T> U(d, u, "u"), DT(d, delta, "delta"), AA(d, A, "A"), BB(d, B, "B"), CC(d, C, "C"), DD(d, D, "D"),
          H0(d, h0, "h0"), Y(d, n * dim, NAN, "y"), HF(d, dim * N, NAN, "h_final"), DY(d, dy, "dy"),
          DHF(d, dhf, "dh_final"), DU(d, n * dim, NAN, "du"), DDT(d, n * dim, NAN, "ddelta"), DA(d, dA0, "dA"),
          DB(d, n * N, NAN, "dB"), DC(d, n * N, NAN, "dC"), DDD(d, dD0, "dD"), DH0(d, dim * N, NAN, "dh0");
      ops.selective_scan_forward(U.data(), DT.data(), AA.data(), BB.data(), CC.data(), DD.data(), H0.data(), n, dim, N,
                                 Y.data(), HF.data());
      ops.selective_scan_backward(DY.data(), DHF.data(), U.data(), DT.data(), AA.data(), BB.data(), CC.data(),
                                  DD.data(), H0.data(), n, dim, N, DU.data(), DDT.data(), DA.data(), DB.data(),
                                  DC.data(), DDD.data(), DH0.data());
      // Pairs backward (window 3) on the same chunk, no later tokens.
      Buf<T> PU(d, n * dim, NAN, "pairs du"), PDT(d, n * dim, NAN, "pairs ddelta"), PA(d, dA0, "pairs dA"),
          PB(d, n * N, NAN, "pairs dB"), PC(d, n * N, NAN, "pairs dC"), PD(d, dD0, "pairs dD");
      ops.selective_scan_backward_pairs(DY.data(), U.data(), DT.data(), AA.data(), BB.data(), CC.data(), DD.data(),
                                        H0.data(), n, dim, N, nullptr, nullptr, nullptr, 0, 3, PU.data(), PDT.data(),
                                        PA.data(), PB.data(), PC.data(), PD.data());
      return Outs{{{"y", Y.Values()},
                   {"h_final", HF.Values()},
                   {"du", DU.Values()},
                   {"ddelta", DDT.Values()},
                   {"dA", DA.Values()},
                   {"dB", DB.Values()},
                   {"dC", DC.Values()},
                   {"dD", DDD.Values()},
                   {"dh0", DH0.Values()},
                   {"pairs du", PU.Values()},
                   {"pairs ddelta", PDT.Values()},
                   {"pairs dA", PA.Values()},
                   {"pairs dB", PB.Values()},
                   {"pairs dC", PC.Values()},
                   {"pairs dD", PD.Values()}}};
    };
    Compare(run, kLoose<T>, "scan n=" + std::to_string(n) + " dim=" + std::to_string(dim) + " N=" + std::to_string(N));
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
      Buf<T> X(d, x, "x"), TI(d, tin, "tail_in"), W(d, w, "w"), B(d, b, "b"), Y(d, n * ch, NAN, "y"),
          TO(d, tail, NAN, "tail_out"), DY(d, dy, "dy"), DTO(d, dto, "dtail_out"), DX(d, n * ch, NAN, "dx"),
          DTI(d, tail, NAN, "dtail_in"), DW(d, dw0, "dw"), DB(d, db0, "db");
      ops.conv1d_forward(X.data(), TI.data(), W.data(), B.data(), n, ch, k, Y.data(), TO.data());
      ops.conv1d_backward(DY.data(), DTO.data(), X.data(), TI.data(), W.data(), n, ch, k, DX.data(), DTI.data(),
                          DW.data(), DB.data());
      return Outs{{{"y", Y.Values()},
                   {"tail_out", TO.Values()},
                   {"dx", DX.Values()},
                   {"dtail_in", DTI.Values()},
                   {"dw", DW.Values()},
                   {"db", DB.Values()}}};
    };
    Compare(run, kLoose<T>, "conv1d k=" + std::to_string(k));
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
      Buf<T> G(d, logits, "dlogits"), L(d, logits, "logits");
      std::vector<double> lp(n, NAN);
      std::vector<int32_t> am(n, 77);
      const double loss = ops.cross_entropy_forward_backward(G.data(), labels.data(), n, vocab, nullptr, 0.5, nullptr);
      ops.token_logprobs(L.data(), labels.data(), n, vocab, lp.data());
      ops.token_argmax(L.data(), labels.data(), n, vocab, am.data());
      return Outs{{{"dlogits", G.Values()},
                   {"loss", {loss}},
                   {"logprobs", lp},
                   {"argmax", std::vector<double>(am.begin(), am.end())}}};
    };
    Compare(run, kLoose<T>, "losses vocab=" + std::to_string(vocab));
  }
}

}  // namespace
}  // namespace sg
