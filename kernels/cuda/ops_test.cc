// Every op of the CUDA backend's table against the CPU table on the same random inputs, in f32 and f64, on shapes
// that exercise the edge cases (transposes and padded leading dimensions, empty GEMMs, repeated ids, GQA, ragged
// and shuffled KV pages, a query chunk starting mid-page, sparse page masks, gradient views with missing pages,
// ignored labels, conv tails shorter than the kernel, null optional arguments), plus bf16 GEMM accuracy, the f32
// table's bf16 entries (--dtype=bf16: cuBLASLt GEMMs, tensor-core attention, loss, conversions, AdamW masters)
// against the CPU's, determinism and errors reported as exceptions.
//
// Every output buffer carries guard elements before and after it, set to a sentinel and checked after the op
// (out-of-bounds writes); outputs the contract says are assigned start as NaN (an op that reads or accumulates
// into them shows up as a mismatch).
//
// Without a usable GPU every test is skipped ("no usable CUDA device: ..."). SG_OPS_TEST_DEVICE=cpu runs the same
// comparisons with the CPU table standing in for the device (a check of this harness on a machine without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ios>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/tensor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/ops_test_support.h"

namespace sg {
namespace {

using namespace ops_test;  // NOLINT: the shared harness

// ---------------------------------------------------------------------------------------------------------------
// Harness

// The device under test: CUDA, or the CPU when SG_OPS_TEST_DEVICE=cpu (harness self-check).
bool SelfCheck() {
  const char* e = std::getenv("SG_OPS_TEST_DEVICE");
  return e != nullptr && std::string(e) == "cpu";
}
Device Dut() { return SelfCheck() ? Device::kCPU : Device::kCUDA; }

// "" when the device under test can run.
std::string GpuUnavailable() {
  if (SelfCheck()) return "";
  static const std::string why = DeviceUnavailableReason(Device::kCUDA);
  return why;
}

// The skip message: "no usable CUDA device: <why>" (without repeating the prefix when the probe says it already).
std::string SkipMessage(const std::string& why) {
  const std::string prefix = "no usable CUDA device: ";
  return why.compare(0, prefix.size(), prefix) == 0 ? why : prefix + why;
}

// This test only builds with --config=cuda, linking //kernels/cuda: the backend must have registered itself (its
// static registrar was kept by the linker) whether or not a GPU is present. Only then is "no GPU" a skip.
#define SG_SKIP_WITHOUT_GPU()                                                                                   \
  do {                                                                                                          \
    if (!SelfCheck() && FindBackend(Device::kCUDA) == nullptr)                                                  \
      FAIL() << "the CUDA backend did not register although //kernels/cuda is linked in (its static "          \
                "registrar in table.cu was dropped by the linker: the cuda_library archive needs alwayslink): " \
             << DeviceUnavailableReason(Device::kCUDA);                                                         \
    const std::string sg_why = GpuUnavailable();                                                                \
    if (!sg_why.empty()) GTEST_SKIP() << SkipMessage(sg_why);                                                   \
  } while (0)

// Every test of this file derives from this fixture (or starts with SG_SKIP_WITHOUT_GPU()).
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { SG_SKIP_WITHOUT_GPU(); }
};

const char* TypeName(float) { return "f32"; }
const char* TypeName(double) { return "f64"; }

template <typename T>
class CudaOpsTest : public GpuTest {};
using Types = ::testing::Types<float, double>;
class TypeNames {
 public:
  template <typename T>
  static std::string GetName(int) { return TypeName(T()); }
};
TYPED_TEST_SUITE(CudaOpsTest, Types, TypeNames);

// Runs f(device) on the CPU and on the device under test.
template <typename F>
std::pair<Outs, Outs> RunBoth(F&& f) {
  Outs cpu = f(Device::kCPU);
  Outs dut = f(Dut());
  return {std::move(dut), std::move(cpu)};
}

// ---------------------------------------------------------------------------------------------------------------
// GEMM

struct GemmShape {
  int64_t m, n, k;
};

template <typename T>
void CheckGemm(bool ta, bool tb, GemmShape g, T alpha, T beta, int64_t pad, uint64_t seed) {
  // Row-major op(A)[m][k], op(B)[k][n], C[m][n], each row padded by `pad` (leading dimension > width).
  const int64_t a_rows = ta ? g.k : g.m, a_cols = ta ? g.m : g.k;
  const int64_t b_rows = tb ? g.n : g.k, b_cols = tb ? g.k : g.n;
  const int64_t lda = std::max<int64_t>(a_cols, 1) + pad, ldb = std::max<int64_t>(b_cols, 1) + pad,
                ldc = std::max<int64_t>(g.n, 1) + pad;
  const std::vector<T> a = Rand<T>(a_rows * lda, seed), b = Rand<T>(b_rows * ldb, seed + 1),
                       c = Rand<T>(g.m * ldc, seed + 2);
  auto [dut, cpu] = RunBoth([&](Device d) {
    Buf<T> A(d, a, "A"), B(d, b, "B"), C(d, c, "C");
    OpsFor<T>(d).gemm(ta, tb, g.m, g.n, g.k, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
    Outs o;
    o.Add(C);
    // Inputs are const: unchanged (and their guards intact).
    EXPECT_EQ(A.Raw(), a);
    EXPECT_EQ(B.Raw(), b);
    return o;
  });
  const std::string what = std::string("gemm ") + (ta ? "T" : "N") + (tb ? "T" : "N") + " m=" +
                           std::to_string(g.m) + " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) +
                           " alpha=" + std::to_string(alpha) + " beta=" + std::to_string(beta);
  ExpectAllClose(dut, cpu, g.k > 256 ? kLoose<T> : kTight<T>, what);
  // The padding columns of C (beyond n in each row) are not part of C.
  const std::vector<double>& out = dut.v[0].second;
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = g.n; j < ldc; ++j)
      ASSERT_EQ(out[i * ldc + j], static_cast<double>(c[i * ldc + j])) << what << ": padding of C row " << i << " written";
}

TYPED_TEST(CudaOpsTest, GemmAllTransposesAndShapes) {
  using T = TypeParam;
  const std::vector<GemmShape> shapes = {{37, 29, 53}, {1, 1, 1},  {64, 1, 33}, {1, 70, 19}, {5, 3, 1},
                                         {0, 5, 3},    {5, 0, 3},  {4, 6, 0},   {0, 0, 0},   {130, 97, 300}};
  uint64_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const GemmShape& g : shapes)
        for (auto [alpha, beta] : {std::pair<T, T>(1, 0), std::pair<T, T>(T(0.7), T(-1.3))})
          for (int64_t pad : {0, 3}) CheckGemm<T>(ta, tb, g, alpha, beta, pad, seed += 3);
}

// bf16 tensor-core GEMM (SetGemmMath(kBF16)): its error against an fp64 product of the f32 inputs must be at most
// twice the error of an fp64 product of the inputs rounded to bf16 (the rounding the mode allows), plus a little.
TEST(CudaGemmMathTest, Bf16ErrorWithinTwiceRoundedReference) {
  SG_SKIP_WITHOUT_GPU();
  if (SelfCheck()) GTEST_SKIP() << "GemmMath is a CUDA setting";
  struct Restore {
    ~Restore() { cuda::SetGemmMath(cuda::GemmMath::kF32); }
  } restore;
  const auto round_bf16 = [](float x) { return BF16ToF32(F32ToBF16(x)); };
  const std::vector<GemmShape> shapes = {{64, 48, 256}, {33, 65, 1000}, {128, 128, 64}, {7, 300, 129}};
  uint64_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const GemmShape& g : shapes) {
        const int64_t lda = ta ? g.m : g.k, ldb = tb ? g.k : g.n, ldc = g.n;
        const std::vector<float> a = Normal<float>(g.m * g.k, seed++), b = Normal<float>(g.k * g.n, seed++);
        auto A = [&](const std::vector<float>& x, int64_t i, int64_t p) { return ta ? x[p * lda + i] : x[i * lda + p]; };
        auto B = [&](const std::vector<float>& x, int64_t p, int64_t j) { return tb ? x[j * ldb + p] : x[p * ldb + j]; };
        std::vector<double> exact(g.m * g.n), rounded(g.m * g.n);
        for (int64_t i = 0; i < g.m; ++i)
          for (int64_t j = 0; j < g.n; ++j) {
            double s = 0, r = 0;
            for (int64_t p = 0; p < g.k; ++p) {
              s += static_cast<double>(A(a, i, p)) * B(b, p, j);
              r += static_cast<double>(round_bf16(A(a, i, p))) * round_bf16(B(b, p, j));
            }
            exact[i * g.n + j] = s;
            rounded[i * g.n + j] = r;
          }
        auto run = [&](cuda::GemmMath math) {
          cuda::SetGemmMath(math);
          Buf<float> da(Dut(), a, "A"), db(Dut(), b, "B"), dc(Dut(), g.m * ldc, Nan<float>(), "C");
          OpsFor<float>(Dut()).gemm(ta, tb, g.m, g.n, g.k, 1.0f, da.data(), lda, db.data(), ldb, 0.0f, dc.data(), ldc);
          cuda::SetGemmMath(cuda::GemmMath::kF32);
          return dc.Values();
        };
        double scale = 0, rounded_err = 0, bf16_err = 0, f32_err = 0;
        const std::vector<double> bf16 = run(cuda::GemmMath::kBF16), f32 = run(cuda::GemmMath::kF32);
        for (size_t i = 0; i < exact.size(); ++i) {
          scale = std::max(scale, std::abs(exact[i]));
          rounded_err = std::max(rounded_err, std::abs(rounded[i] - exact[i]));
          bf16_err = std::isnan(bf16[i]) ? INFINITY : std::max(bf16_err, std::abs(bf16[i] - exact[i]));
          f32_err = std::isnan(f32[i]) ? INFINITY : std::max(f32_err, std::abs(f32[i] - exact[i]));
        }
        const std::string what = std::string("bf16 gemm ") + (ta ? "T" : "N") + (tb ? "T" : "N") + " " +
                                 std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k);
        EXPECT_LE(bf16_err, 2 * rounded_err + 1e-5 * scale)
            << what << ": cuda bf16 error " << bf16_err << ", bf16-rounded fp64 reference error " << rounded_err;
        // Back in kF32, the product is f32-accurate again (the mode was restored).
        EXPECT_LE(f32_err, 1e-5 * scale) << what << ": f32 after restoring kF32";
        std::cout << what << ": max|C| " << scale << ", bf16 err " << bf16_err << ", rounded-input ref err "
                  << rounded_err << ", f32 err " << f32_err << "\n";
      }
  EXPECT_EQ(cuda::GetGemmMath(), cuda::GemmMath::kF32);
}

// ---------------------------------------------------------------------------------------------------------------
// Pointwise, norms, embedding

TYPED_TEST(CudaOpsTest, EmbeddingForwardBackwardRepeatedIds) {
  using T = TypeParam;
  for (auto [vocab, d, n] : {std::tuple<int64_t, int64_t, int64_t>{11, 37, 50}, {5, 1, 9}, {300, 256, 700},
                             {3, 130, 1}}) {
    std::vector<int32_t> ids(n);
    std::mt19937_64 rng(vocab * 7 + d);
    for (int64_t i = 0; i < n; ++i) ids[i] = i % 3 == 0 ? 2 : static_cast<int32_t>(rng() % vocab);  // id 2 repeats
    const std::vector<T> table = Rand<T>(vocab * d, 1 + d), dout = Rand<T>(n * d, 2 + d),
                         dtable0 = Rand<T>(vocab * d, 3 + d);
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> tab(dev, table, "table"), out(dev, n * d, Nan<T>(), "out"), dy(dev, dout, "dout"),
          dtab(dev, dtable0, "dtable");
      ops.embedding_forward(ids.data(), n, tab.data(), d, out.data());
      ops.embedding_backward(ids.data(), n, dy.data(), d, dtab.data());
      Outs o;
      o.Add(out);
      o.Add(dtab);
      return o;
    });
    const std::string what = "embedding vocab=" + std::to_string(vocab) + " d=" + std::to_string(d);
    ExpectAllEqual(Outs{{dut.v[0]}}, Outs{{cpu.v[0]}}, what);  // a gather is exact
    ExpectClose(dut.v[1].second, cpu.v[1].second, kTight<T>, what + " dtable");
  }
}

TYPED_TEST(CudaOpsTest, RmsNormForwardBackward) {
  using T = TypeParam;
  // d = 1 with a small eps cancels dx to eps / x^2 of its terms (dx = w dy rstd eps / (x^2 + eps)): that case takes
  // eps = 1, so that the comparison measures the kernel rather than the cancellation.
  for (auto [n, d] : {std::pair<int64_t, int64_t>{13, 7}, {5, 100}, {3, 2048}, {64, 33}, {1, 1}}) {
    const double eps = d == 1 ? 1.0 : 1e-5;
    for (bool accumulate : {false, true}) {
      const std::vector<T> x = Rand<T>(n * d, 10 + d, -2, 2), w = Rand<T>(d, 11 + d, 0.5, 1.5),
                           dy = Rand<T>(n * d, 12 + d), dx0 = Rand<T>(n * d, 13 + d), dw0 = Rand<T>(d, 14 + d);
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> X(dev, x, "x"), W(dev, w, "w"), Y(dev, n * d, Nan<T>(), "y"), R(dev, n, Nan<T>(), "rstd"),
            DY(dev, dy, "dy"), DW(dev, dw0, "dw");
        // dx assigned: starts as NaN; accumulated: starts as values.
        Buf<T> DX = accumulate ? Buf<T>(dev, dx0, "dx") : Buf<T>(dev, n * d, Nan<T>(), "dx");
        ops.rmsnorm_forward(X.data(), W.data(), n, d, eps, Y.data(), R.data());
        ops.rmsnorm_backward(DY.data(), X.data(), W.data(), R.data(), n, d, DX.data(), DW.data(), accumulate);
        Outs o;
        o.Add(Y);
        o.Add(R);
        o.Add(DX);
        o.Add(DW);
        return o;
      });
      ExpectAllClose(dut, cpu, n * d > 1000 ? kLoose<T> : kTight<T>,
                     "rmsnorm n=" + std::to_string(n) + " d=" + std::to_string(d) +
                         (accumulate ? " accumulate" : " assign"));
    }
  }
}

TYPED_TEST(CudaOpsTest, RopeForwardAndInverse) {
  using T = TypeParam;
  for (auto [n, heads, hd, pos0] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{9, 3, 8, 13}, {5, 4, 64, 0},
                                    {17, 2, 128, 1000}, {1, 1, 2, 7}}) {
    std::vector<double> inv_freq(hd / 2);
    for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(10000.0, -2.0 * i / hd);
    const std::vector<T> x = Rand<T>(n * heads * hd, 20 + hd);
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> fwd(dev, x, "rope"), inv(dev, x, "rope inverse"), round_trip(dev, x, "inverse(rope)");
      ops.rope(fwd.data(), n, heads, hd, pos0, inv_freq.data(), false);
      ops.rope(inv.data(), n, heads, hd, pos0, inv_freq.data(), true);
      ops.rope(round_trip.data(), n, heads, hd, pos0, inv_freq.data(), false);
      ops.rope(round_trip.data(), n, heads, hd, pos0, inv_freq.data(), true);
      Outs o;
      o.Add(fwd);
      o.Add(inv);
      o.Add(round_trip);
      return o;
    });
    const std::string what = "rope hd=" + std::to_string(hd) + " pos0=" + std::to_string(pos0);
    ExpectAllClose(dut, cpu, kTight<T>, what);
    std::vector<double> xd(x.begin(), x.end());
    ExpectClose(dut.v[2].second, xd, 10 * kTight<T>, what + " inverse undoes forward");
  }
}

TYPED_TEST(CudaOpsTest, BiasForwardBackward) {
  using T = TypeParam;
  for (auto [n, m] : {std::pair<int64_t, int64_t>{33, 70}, {1, 5}, {2000, 3}, {7, 1025}}) {
    const std::vector<T> y = Rand<T>(n * m, 30 + m), b = Rand<T>(m, 31 + m), dy = Rand<T>(n * m, 32 + m),
                         db0 = Rand<T>(m, 33 + m);
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> Y(dev, y, "y"), B(dev, b, "b"), DY(dev, dy, "dy"), DB(dev, db0, "db");
      ops.add_bias(Y.data(), B.data(), n, m);
      ops.bias_backward(DY.data(), n, m, DB.data());
      Outs o;
      o.Add(Y);
      o.Add(DB);
      return o;
    });
    ExpectAllClose(dut, cpu, n > 100 ? kLoose<T> : kTight<T>, "bias n=" + std::to_string(n) + " m=" + std::to_string(m));
  }
}

TYPED_TEST(CudaOpsTest, SwigluForwardBackward) {
  using T = TypeParam;
  for (int64_t count : {1, 1000, 4097}) {
    std::vector<T> g = Rand<T>(count, 40 + count, -12, 12), u = Rand<T>(count, 41 + count, -3, 3);
    const std::vector<T> dout = Rand<T>(count, 42 + count);
    if (count > 4) g[0] = 30, g[1] = -30, g[2] = 0;  // saturated and exact-zero gates
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> G(dev, g, "gate"), U(dev, u, "up"), O(dev, count, Nan<T>(), "out"), DO(dev, dout, "dout"),
          DG(dev, count, Nan<T>(), "dgate"), DU(dev, count, Nan<T>(), "dup");
      ops.swiglu_forward(G.data(), U.data(), count, O.data());
      ops.swiglu_backward(DO.data(), G.data(), U.data(), count, DG.data(), DU.data());
      Outs o;
      o.Add(O);
      o.Add(DG);
      o.Add(DU);
      return o;
    });
    ExpectAllClose(dut, cpu, kTight<T>, "swiglu count=" + std::to_string(count));
  }
}

TYPED_TEST(CudaOpsTest, AddInplaceCopyFillScale) {
  using T = TypeParam;
  for (int64_t count : {0, 1, 1001, 70000}) {
    const std::vector<T> y = Rand<T>(count, 50), x = Rand<T>(count, 51);
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> Y(dev, y, "add_inplace"), X(dev, x, "x"), C(dev, count, Nan<T>(), "copy"), F(dev, y, "fill"),
          S(dev, x, "scale");
      ops.add_inplace(Y.data(), X.data(), count);
      ops.copy(C.data(), X.data(), count);
      ops.fill(F.data(), count, T(2.5));
      ops.scale(S.data(), count, 0.37);
      Outs o;
      o.Add(Y);
      o.Add(C);
      o.Add(F);
      o.Add(S);
      EXPECT_EQ(X.Raw(), x);
      return o;
    });
    ExpectAllEqual(dut, cpu, "count=" + std::to_string(count));  // one rounding each: exact
  }
}

TYPED_TEST(CudaOpsTest, SiluSoftplusForwardBackward) {
  using T = TypeParam;
  const int64_t count = 2000;
  std::vector<T> x = Rand<T>(count, 60, -30, 30);
  x[0] = 20, x[1] = T(20.001), x[2] = T(19.999), x[3] = 25, x[4] = -25, x[5] = 0, x[6] = -90, x[7] = 90;
  const std::vector<T> dy = Rand<T>(count, 61);
  auto [dut, cpu] = RunBoth([&](Device dev) {
    const OpTable<T>& ops = OpsFor<T>(dev);
    Buf<T> X(dev, x, "x"), DY(dev, dy, "dy"), sy(dev, count, Nan<T>(), "silu"), sdx(dev, count, Nan<T>(), "dsilu"),
        py(dev, count, Nan<T>(), "softplus"), pdx(dev, count, Nan<T>(), "dsoftplus");
    ops.silu_forward(X.data(), count, sy.data());
    ops.silu_backward(DY.data(), X.data(), count, sdx.data());
    ops.softplus_forward(X.data(), count, py.data());
    ops.softplus_backward(DY.data(), X.data(), count, pdx.data());
    Outs o;
    o.Add(sy);
    o.Add(sdx);
    o.Add(py);
    o.Add(pdx);
    return o;
  });
  ExpectAllClose(dut, cpu, kTight<T>, "silu/softplus");
  // Elementwise relative error as well, so that tiny values (silu at -30) do not hide behind the max; not for
  // dsilu, whose factor 1 + x (1 - s) cancels near x = -1.28. Subnormal results are compared absolutely.
  for (size_t k : {0, 2, 3})
    for (int64_t i = 0; i < count; ++i) {
      const double g = dut.v[k].second[i], r = cpu.v[k].second[i];
      EXPECT_LE(std::abs(g - r), 16 * std::numeric_limits<T>::epsilon() * std::abs(r) +
                                     64 * static_cast<double>(std::numeric_limits<T>::min()))
          << cpu.v[k].first << " at x=" << x[i] << ": cuda " << g << ", cpu " << r;
    }
}

TYPED_TEST(CudaOpsTest, Relu2ForwardBackward) {
  using T = TypeParam;
  const int64_t count = 2000;
  std::vector<T> x = Rand<T>(count, 62, -30, 30);
  x[0] = 0, x[1] = T(-1e-30), x[2] = T(1e-30);
  const std::vector<T> dy = Rand<T>(count, 63);
  auto [dut, cpu] = RunBoth([&](Device dev) {
    const OpTable<T>& ops = OpsFor<T>(dev);
    Buf<T> X(dev, x, "x"), DY(dev, dy, "dy"), y(dev, count, Nan<T>(), "relu2"), dx(dev, count, Nan<T>(), "drelu2");
    ops.relu2_forward(X.data(), count, y.data());
    ops.relu2_backward(DY.data(), X.data(), count, dx.data());
    Outs o;
    o.Add(y);
    o.Add(dx);
    return o;
  });
  ExpectAllEqual(dut, cpu, "relu2");  // one product each: the same bits
}

TYPED_TEST(CudaOpsTest, AdamW) {
  using T = TypeParam;
  const int64_t count = 3001;
  const std::vector<T> p = Rand<T>(count, 70), g = Rand<T>(count, 71, -3, 3), m = Rand<T>(count, 72, -0.1, 0.1),
                       v = Rand<T>(count, 73, 0, 0.1);
  for (int64_t step : {1, 7}) {
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const std::vector<T> zeros(count, T(0));  // the moments of a first step
      Buf<T> P(dev, p, "p"), G(dev, g, "g"), M(dev, step == 1 ? zeros : m, "m"), V(dev, step == 1 ? zeros : v, "v");
      OpsFor<T>(dev).adamw(P.data(), G.data(), M.data(), V.data(), count, 1e-3, 0.9, 0.95, 1e-8, 0.1, step);
      Outs o;
      o.Add(P);
      o.Add(M);
      o.Add(V);
      return o;
    });
    ExpectAllClose(dut, cpu, kTight<T>, "adamw step " + std::to_string(step));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention over pages

struct AttnCase {
  int64_t heads, kv_heads, head_dim, page_size, n, pos0;
  bool shuffle;      // pool page order != logical order (and unused pool pages in between)
  bool mask;         // page_mask with some pages unselected (page 0 always selected)
  bool holes;        // gradient page table with -1 entries
  int64_t stride_pad;  // page_stride beyond page_size * kv_heads * head_dim
  int64_t key_begin = 0;  // packed documents: the queries' document starts here (<= pos0)
};

std::string AttnName(const ::testing::TestParamInfo<AttnCase>& info) {
  const AttnCase& c = info.param;
  return "h" + std::to_string(c.heads) + "kv" + std::to_string(c.kv_heads) + "d" + std::to_string(c.head_dim) +
         "_page" + std::to_string(c.page_size) + "_n" + std::to_string(c.n) + "_pos" + std::to_string(c.pos0) +
         (c.shuffle ? "_shuffled" : "") + (c.mask ? "_masked" : "") + (c.holes ? "_holes" : "") +
         (c.stride_pad ? "_padded" : "") + (c.key_begin ? "_from" + std::to_string(c.key_begin) : "");
}

// Bitwise equality (NaN entries included).
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The inputs of one attention case, shared by the CPU and device runs.
template <typename T>
struct AttnSetup {
  AttentionShape s;
  int64_t pages = 0, pool_pages = 0, stride = 0, page_size = 0;
  std::vector<int32_t> table, grad_table;
  std::vector<uint8_t> mask;
  std::vector<T> q, k, v, dout, dk0, dv0;

  explicit AttnSetup(const AttnCase& c, uint64_t seed) {
    s.n = c.n;
    s.pos0 = c.pos0;
    s.heads = c.heads;
    s.kv_heads = c.kv_heads;
    s.head_dim = c.head_dim;
    s.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    s.key_begin = c.key_begin;
    page_size = c.page_size;
    pages = (c.pos0 + c.n + c.page_size - 1) / c.page_size;
    pool_pages = c.shuffle ? pages + 3 : pages;
    stride = c.page_size * c.kv_heads * c.head_dim + c.stride_pad;
    std::mt19937_64 rng(seed);
    std::vector<int32_t> pool(pool_pages);
    std::iota(pool.begin(), pool.end(), 0);
    if (c.shuffle) std::shuffle(pool.begin(), pool.end(), rng);
    table.assign(pool.begin(), pool.begin() + pages);
    mask.assign(pages, 1);
    if (c.mask)  // the page holding key_begin stays selected: every query row sees a key
      for (int64_t i = 0; i < pages; ++i) mask[i] = i % 3 == 1 && i != c.key_begin / c.page_size ? 0 : 1;
    grad_table = table;
    if (c.holes)
      for (int64_t i = 0; i < pages; ++i)
        if (i % 4 == 2 || (pages > 1 && i == pages - 1 && pages % 2 == 0)) grad_table[i] = -1;
    const int64_t qn = c.n * c.heads * c.head_dim;
    q = Normal<T>(qn, seed + 1);
    k = Normal<T>(pool_pages * stride, seed + 2);
    v = Normal<T>(pool_pages * stride, seed + 3);
    dout = Normal<T>(qn, seed + 4);
    dk0 = Rand<T>(pool_pages * stride, seed + 5);
    dv0 = Rand<T>(pool_pages * stride, seed + 6);
    // Pages wholly before key_begin (earlier documents) hold NaN: a kernel that read them would show it.
    for (int64_t lp = 0; (lp + 1) * c.page_size <= c.key_begin; ++lp) {
      std::fill_n(k.begin() + table[lp] * stride, stride, Nan<T>());
      std::fill_n(v.begin() + table[lp] * stride, stride, Nan<T>());
    }
  }

  template <typename KV>
  PagedKV<KV> View(KV* kp, KV* vp, const std::vector<int32_t>& t) const {
    PagedKV<KV> p;
    p.k_pool = kp;
    p.v_pool = vp;
    p.page_table = t.data();
    p.page_size = page_size;
    p.page_stride = stride;
    p.kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    p.page_mask = mask.empty() || std::all_of(mask.begin(), mask.end(), [](uint8_t m) { return m != 0; })
                      ? nullptr
                      : mask.data();
    return p;
  }

  // Forward and backward on device d: out, lse, dq, dk pool, dv pool.
  Outs Run(Device d) const {
    const OpTable<T>& ops = OpsFor<T>(d);
    const int64_t qn = s.n * s.heads * s.head_dim;
    Buf<T> Q(d, q, "q"), K(d, k, "k pool"), V(d, v, "v pool"), DO(d, dout, "dout"), out(d, qn, Nan<T>(), "out"),
        lse(d, s.heads * s.n, Nan<T>(), "lse"), dq(d, qn, Nan<T>(), "dq"), dk(d, dk0, "dk pool"),
        dv(d, dv0, "dv pool");
    Buf<T> ws(d, std::max<int64_t>(1, ops.attention_workspace_elems(s, page_size)), T(0), "workspace");
    ops.attention_forward(s, Q.data(), View(K.data(), V.data(), table), out.data(), lse.data(), ws.data());
    ops.attention_backward(s, Q.data(), View(K.data(), V.data(), table), out.data(), lse.data(), DO.data(), dq.data(),
                           View(dk.data(), dv.data(), grad_table), ws.data());
    EXPECT_TRUE(ws.GuardsIntact()) << "the workspace overflowed attention_workspace_elems";
    EXPECT_EQ(Q.Raw(), q);
    EXPECT_TRUE(SameBits(K.Raw(), k)) << "the k pool changed";
    EXPECT_TRUE(SameBits(V.Raw(), v)) << "the v pool changed";
    Outs o;
    o.Add(out);
    o.Add(lse);
    o.Add(dq);
    o.Add(dk);
    o.Add(dv);
    return o;
  }
};

class CudaAttentionTest : public GpuTest, public ::testing::WithParamInterface<AttnCase> {};

// dut.v[3], dut.v[4]: the dK and dV pools after the backward, which started as dk0, dv0. Pool pages no gradient
// view names (unused, or logical pages marked -1) keep their values exactly; so do the gaps between pages (stride
// padding), the pages of unselected logical pages and the rows of keys before key_begin (an earlier document).
template <typename T, typename KV>
void ExpectGradientPagesOnly(const AttnSetup<T>& setup, const AttnCase& c, const Outs& dut,
                             const std::vector<KV>& dk0, const std::vector<KV>& dv0) {
  std::vector<bool> named(setup.pool_pages, false);
  for (int32_t p : setup.grad_table)
    if (p >= 0) named[p] = true;
  const int64_t used = setup.page_size * c.kv_heads * c.head_dim;
  for (size_t which : {3, 4}) {
    const std::vector<KV>& init = which == 3 ? dk0 : dv0;
    const std::vector<double>& got = dut.v[which].second;
    int64_t bad = 0;
    for (int64_t p = 0; p < setup.pool_pages; ++p)
      for (int64_t i = 0; i < setup.stride; ++i)
        if ((!named[p] || i >= used) && got[p * setup.stride + i] != AsDouble(init[p * setup.stride + i])) ++bad;
    EXPECT_EQ(bad, 0) << dut.v[which].first << ": elements outside the gradient view's pages were written";
  }
  if (c.mask)
    for (int64_t l = 0; l < setup.pages; ++l) {
      if (setup.mask[l] || setup.grad_table[l] < 0) continue;
      const int64_t p = setup.grad_table[l];
      for (int64_t i = 0; i < used; ++i)
        ASSERT_EQ(dut.v[3].second[p * setup.stride + i], AsDouble(dk0[p * setup.stride + i]))
            << "dK written for unselected logical page " << l;
    }
  const int64_t row = c.kv_heads * c.head_dim;
  for (int64_t j = 0; j < c.key_begin; ++j) {
    const int32_t p = setup.grad_table[j / setup.page_size];
    if (p < 0) continue;
    const int64_t at = p * setup.stride + j % setup.page_size * row;
    for (int64_t i = at; i < at + row; ++i) {
      ASSERT_EQ(dut.v[3].second[i], AsDouble(dk0[i])) << "dK written for key " << j << " before key_begin";
      ASSERT_EQ(dut.v[4].second[i], AsDouble(dv0[i])) << "dV written for key " << j << " before key_begin";
    }
  }
}

template <typename T>
void CheckAttention(const AttnCase& c) {
  SCOPED_TRACE(TypeName(T()));
  AttnSetup<T> setup(c, 1000 + c.n * 31 + c.head_dim);
  const Outs cpu = setup.Run(Device::kCPU), dut = setup.Run(Dut());
  ExpectClose(dut.v[0].second, cpu.v[0].second, kTight<T>, "out");
  ExpectClose(dut.v[1].second, cpu.v[1].second, kTight<T>, "lse");
  for (size_t i = 2; i < 5; ++i) ExpectClose(dut.v[i].second, cpu.v[i].second, kLoose<T>, cpu.v[i].first);
  ExpectGradientPagesOnly(setup, c, dut, setup.dk0, setup.dv0);
}

TEST_P(CudaAttentionTest, ForwardBackwardMatchesCpu) {
  CheckAttention<float>(GetParam());
  CheckAttention<double>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Paged, CudaAttentionTest,
    ::testing::Values(
        //       heads kv  hd  page   n   pos0 shuffle mask  holes pad
        AttnCase{4, 4, 8, 3, 5, 3, true, false, false, 0},        // the CPU test's shape, MHA
        AttnCase{4, 2, 8, 5, 1, 6, false, false, false, 0},       // one query, mid-page
        AttnCase{4, 2, 8, 5, 2, 0, false, false, false, 0},       // the first positions (query 0 sees one key)
        AttnCase{4, 2, 8, 1, 20, 5, true, true, true, 0},         // one-token pages
        AttnCase{4, 2, 64, 16, 37, 21, true, true, true, 0},      // GQA 2, mid-page start, everything on
        AttnCase{4, 1, 64, 7, 130, 0, true, false, false, 0},     // MQA, several query tiles
        AttnCase{4, 1, 128, 8, 70, 13, true, true, false, 0},     // head_dim 128, sparse
        AttnCase{4, 2, 128, 64, 100, 150, true, false, true, 0},  // long prefix, big pages
        AttnCase{4, 2, 64, 16, 43, 21, true, true, true, 0},      // the last page exactly full
        AttnCase{4, 2, 64, 16, 45, 200, true, true, true, 5},     // padded page stride
        AttnCase{4, 4, 32, 300, 77, 250, false, false, false, 0}, // one page larger than all
        AttnCase{4, 2, 100, 9, 33, 4, true, false, true, 0},      // head_dim not a power of two
        // Packed documents (key_begin: the queries' document starts there; pages wholly before it hold NaN):
        AttnCase{4, 2, 64, 16, 37, 21, true, true, true, 0, 19},   // inside a page, everything on
        AttnCase{4, 2, 8, 5, 12, 13, true, false, true, 0, 10},    // on a page boundary, gradient holes
        AttnCase{4, 1, 64, 7, 130, 20, true, true, false, 0, 20},  // = pos0 mid-page, several query tiles, sparse
        AttnCase{4, 2, 128, 8, 9, 40, false, false, false, 0, 40}, // = pos0 on a page boundary
        AttnCase{4, 2, 64, 16, 45, 200, true, true, true, 5, 70},  // several key tiles after it, padded stride
        AttnCase{4, 2, 8, 1, 20, 5, true, true, true, 0, 3}),      // one-token pages
    AttnName);

// ---------------------------------------------------------------------------------------------------------------
// Loss

TYPED_TEST(CudaOpsTest, CrossEntropyAndTokenLogprobs) {
  using T = TypeParam;
  for (int64_t vocab : {7, 1000, 32003}) {
    const int64_t n = 9;
    std::vector<int32_t> labels(n);
    for (int64_t i = 0; i < n; ++i) labels[i] = static_cast<int32_t>((i * 7919 + 3) % vocab);
    labels[2] = -100;
    labels[5] = -1;
    labels[n - 1] = static_cast<int32_t>(vocab - 1);
    const std::vector<double> scales = {0.5, -2.0, 7.0, 1.0, 0.0, 3.0, -0.25, 1.5, 2.0};
    std::vector<T> logits = Normal<T>(n * vocab, 80 + vocab, 3.0);
    for (int64_t j = 0; j < vocab; ++j) logits[3 * vocab + j] += T(50);  // a large offset: needs the max shift
    for (bool row_scale : {false, true}) {
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> grad(dev, logits, "dlogits"), L(dev, logits, "logits");
        HostBuf<double> lp(n, Nan<double>(), "logprobs");
        Outs o;
        o.scalar = ops.cross_entropy_forward_backward(grad.data(), labels.data(), n, vocab,
                                                      row_scale ? scales.data() : nullptr, 0.37, nullptr);
        // The sum left in device memory instead (added to what is there): the same bits, the same gradient.
        Buf<T> grad_kept(dev, logits, "dlogits (sum kept on the device)");
        Buf<double> kept(dev, std::vector<double>{0.25}, "loss sum");
        EXPECT_EQ(ops.cross_entropy_forward_backward(grad_kept.data(), labels.data(), n, vocab,
                                                     row_scale ? scales.data() : nullptr, 0.37, kept.data()),
                  0.0);
        const double kept_sum = kept.Raw()[0];
        if (kept_sum != 0.25 + o.scalar) {
          Buf<T> again(dev, logits, "dlogits (a third call)");
          ADD_FAILURE() << (dev == Device::kCPU ? "cpu" : "device") << ": " << std::hexfloat
                        << "the sum kept on the device " << kept_sum << " != 0.25 + " << o.scalar
                        << " (" << 0.25 + o.scalar << "); a third call returns "
                        << ops.cross_entropy_forward_backward(again.data(), labels.data(), n, vocab,
                                                              row_scale ? scales.data() : nullptr, 0.37, nullptr)
                        << std::defaultfloat;
        }
        EXPECT_EQ(grad_kept.Raw(), grad.Raw());
        ops.token_logprobs(L.data(), labels.data(), n, vocab, lp.data());
        // Read at once: the op's results are in host memory when it returns.
        const std::vector<double> logprobs = lp.Raw();
        o.Add(grad);
        o.Add("logprobs", logprobs);
        EXPECT_EQ(L.Raw(), logits);
        return o;
      });
      const std::string what = "cross entropy vocab=" + std::to_string(vocab) + (row_scale ? " row_scale" : "");
      ExpectAllClose(dut, cpu, kTight<T>, what);
      EXPECT_NEAR(dut.scalar, cpu.scalar, kTight<T> * std::max(1.0, std::abs(cpu.scalar))) << what << " loss";
      // Ignored rows: zero gradient, log-prob 0 exactly; the loss is minus the sum of the valid log-probs.
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (labels[i] < 0) {
          EXPECT_EQ(dut.v[1].second[i], 0.0) << what << " row " << i;
          for (int64_t j = 0; j < vocab; ++j) ASSERT_EQ(dut.v[0].second[i * vocab + j], 0.0) << what << " row " << i;
        } else {
          sum += dut.v[1].second[i];
        }
      }
      EXPECT_NEAR(dut.scalar, -sum, kTight<T> * std::max(1.0, std::abs(sum))) << what;
    }
  }
}

TYPED_TEST(CudaOpsTest, TokenArgmaxTiesAndNaN) {
  using T = TypeParam;
  const T nan = Nan<T>();
  for (int64_t vocab : {5, 1000, 40000}) {
    const int64_t n = 8;
    std::vector<T> logits = Rand<T>(n * vocab, 90 + vocab, -1, 1);
    std::vector<int32_t> labels(n, 0), expected(n);
    auto row = [&](int64_t i) { return logits.data() + i * vocab; };
    // 0: a tie between the first and the last column -> the first.
    row(0)[0] = 5, row(0)[vocab - 1] = 5, expected[0] = 0;
    // 1: a tie between two columns far apart (different warps / blocks) -> the lower.
    row(1)[vocab / 2] = 7, row(1)[vocab - 2] = 7, row(1)[vocab / 3 + 1] = 7, expected[1] = static_cast<int32_t>(vocab / 3 + 1);
    // 2: NaN in the first column and elsewhere; the max among the rest wins.
    row(2)[0] = nan, row(2)[vocab - 1] = nan, row(2)[1] = 3, expected[2] = 1;
    // 3: unlabelled -> -1.
    labels[3] = -100, expected[3] = -1;
    // 4: every entry equal -> 0.
    std::fill(row(4), row(4) + vocab, T(0.25)), expected[4] = 0;
    // 5: the max at the last column.
    row(5)[vocab - 1] = 9, expected[5] = static_cast<int32_t>(vocab - 1);
    // 6: -inf everywhere but one; 7: +inf ties.
    std::fill(row(6), row(6) + vocab, -std::numeric_limits<T>::infinity()), row(6)[vocab / 2] = -1e30,
        expected[6] = static_cast<int32_t>(vocab / 2);
    row(7)[2] = std::numeric_limits<T>::infinity(), row(7)[vocab - 1] = std::numeric_limits<T>::infinity(),
        expected[7] = 2;
    std::vector<std::vector<int32_t>> results;
    for (Device dev : {Device::kCPU, Dut()}) {
      Buf<T> L(dev, logits, "logits");
      HostBuf<int32_t> out(n, 12345, "argmax");
      OpsFor<T>(dev).token_argmax(L.data(), labels.data(), n, vocab, out.data());
      results.push_back(out.Raw());
    }
    EXPECT_EQ(results[0], expected) << "cpu, vocab " << vocab;
    EXPECT_EQ(results[1], expected) << "cuda, vocab " << vocab;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// State-space ops

TYPED_TEST(CudaOpsTest, Conv1dForwardBackward) {
  using T = TypeParam;
  const int64_t ch = 37, k = 4;
  for (int64_t n : {1, 2, 3, 7, 100}) {
    for (int variant = 0; variant < 4; ++variant) {
      const bool tails = variant & 1, bias = variant & 2;
      const std::vector<T> x = Rand<T>(n * ch, 100 + n), tail = Rand<T>((k - 1) * ch, 101 + n),
                           w = Rand<T>(ch * k, 102), b = Rand<T>(ch, 103), dy = Rand<T>(n * ch, 104 + n),
                           dtail_out = Rand<T>((k - 1) * ch, 105 + n), dw0 = Rand<T>(ch * k, 106),
                           db0 = Rand<T>(ch, 107);
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> X(dev, x, "x"), TI(dev, tail, "tail_in"), W(dev, w, "w"), B(dev, b, "b"), Y(dev, n * ch, Nan<T>(), "y"),
            TO(dev, (k - 1) * ch, Nan<T>(), "tail_out"), DY(dev, dy, "dy"), DTO(dev, dtail_out, "dtail_out"),
            DX(dev, n * ch, Nan<T>(), "dx"), DTI(dev, (k - 1) * ch, Nan<T>(), "dtail_in"), DW(dev, dw0, "dw"),
            DB(dev, db0, "db");
        ops.conv1d_forward(X.data(), tails ? TI.data() : nullptr, W.data(), bias ? B.data() : nullptr, n, ch, k,
                           Y.data(), tails ? TO.data() : nullptr);
        ops.conv1d_backward(DY.data(), tails ? DTO.data() : nullptr, X.data(), tails ? TI.data() : nullptr, W.data(),
                            n, ch, k, DX.data(), tails ? DTI.data() : nullptr, DW.data(), bias ? DB.data() : nullptr);
        Outs o;
        o.Add(Y);
        o.Add(TO);
        o.Add(DX);
        o.Add(DTI);
        o.Add(DW);
        o.Add(DB);
        return o;
      });
      ExpectAllClose(dut, cpu, n > 50 ? kLoose<T> : kTight<T>,
                     "conv1d n=" + std::to_string(n) + (tails ? " tails" : " no tails") + (bias ? " bias" : " no bias"));
    }
  }
}

// Selective-scan inputs of the CPU test (kernels/cpu/ssm_test.cc): positive steps, negative A.
template <typename T>
struct Scan {
  int64_t n, dim, N;
  std::vector<T> u, delta, A, B, C, D, h0;
  Scan(int64_t n, int64_t dim, int64_t N, uint64_t seed)
      : n(n), dim(dim), N(N), u(Normal<T>(n * dim, seed)), delta(Rand<T>(n * dim, seed + 1, 0.05, 0.6)),
        A(Rand<T>(dim * N, seed + 2, -1.5, -0.1)), B(Normal<T>(n * N, seed + 3)), C(Normal<T>(n * N, seed + 4)),
        D(Normal<T>(dim, seed + 5)), h0(Normal<T>(dim * N, seed + 6)) {}
};

struct ScanCase {
  int64_t n, dim, N;
};

TYPED_TEST(CudaOpsTest, SelectiveScanForwardBackward) {
  using T = TypeParam;
  for (ScanCase c : {ScanCase{1, 5, 4}, ScanCase{7, 37, 16}, ScanCase{64, 64, 16}, ScanCase{300, 24, 8},
                     ScanCase{19, 3, 33}, ScanCase{5, 2, 256}}) {
    const Scan<T> in(c.n, c.dim, c.N, 200 + c.n + c.N);
    const std::vector<T> dy = Normal<T>(c.n * c.dim, 210 + c.n), dh_final = Normal<T>(c.dim * c.N, 211 + c.n),
                         dA0 = Rand<T>(c.dim * c.N, 212), dD0 = Rand<T>(c.dim, 213);
    for (int variant = 0; variant < 8; ++variant) {
      const bool with_h0 = variant & 1, with_dh = variant & 2, with_d = variant & 4;
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> U(dev, in.u, "u"), DT(dev, in.delta, "delta"), A(dev, in.A, "A"), B(dev, in.B, "B"), C(dev, in.C, "C"),
            D(dev, in.D, "D"), H0(dev, in.h0, "h0"), Y(dev, c.n * c.dim, Nan<T>(), "y"),
            HF(dev, c.dim * c.N, Nan<T>(), "h_final"), DY(dev, dy, "dy"), DHF(dev, dh_final, "dh_final"),
            DU(dev, c.n * c.dim, Nan<T>(), "du"), DDT(dev, c.n * c.dim, Nan<T>(), "ddelta"), DA(dev, dA0, "dA"),
            DB(dev, c.n * c.N, Nan<T>(), "dB"), DC(dev, c.n * c.N, Nan<T>(), "dC"), DD(dev, dD0, "dD"),
            DH0(dev, c.dim * c.N, Nan<T>(), "dh0");
        const T* h0 = with_h0 ? H0.data() : nullptr;
        const T* Dp = with_d ? D.data() : nullptr;
        ops.selective_scan_forward(U.data(), DT.data(), A.data(), B.data(), C.data(), Dp, h0, c.n, c.dim, c.N,
                                   Y.data(), with_dh ? HF.data() : nullptr);
        ops.selective_scan_backward(DY.data(), with_dh ? DHF.data() : nullptr, U.data(), DT.data(), A.data(),
                                    B.data(), C.data(), Dp, h0, c.n, c.dim, c.N, DU.data(), DDT.data(), DA.data(),
                                    DB.data(), DC.data(), with_d ? DD.data() : nullptr,
                                    with_h0 ? DH0.data() : nullptr);
        Outs o;
        o.Add(Y);
        o.Add(HF);
        o.Add(DU);
        o.Add(DDT);
        o.Add(DA);
        o.Add(DB);
        o.Add(DC);
        o.Add(DD);
        o.Add(DH0);
        EXPECT_EQ(U.Raw(), in.u);
        EXPECT_EQ(DT.Raw(), in.delta);
        return o;
      });
      const std::string what = "scan n=" + std::to_string(c.n) + " dim=" + std::to_string(c.dim) + " N=" +
                               std::to_string(c.N) + (with_h0 ? " h0" : " no h0") + (with_dh ? " dh_final" : "") +
                               (with_d ? " D" : " no D");
      ExpectClose(dut.v[0].second, cpu.v[0].second, c.n > 50 ? kLoose<T> : kTight<T>, what + " y");
      ExpectClose(dut.v[1].second, cpu.v[1].second, c.n > 50 ? kLoose<T> : kTight<T>, what + " h_final");
      for (size_t i = 2; i < dut.v.size(); ++i)
        ExpectClose(dut.v[i].second, cpu.v[i].second, kLoose<T>, what + " " + cpu.v[i].first);
    }
  }
}

TYPED_TEST(CudaOpsTest, SelectiveScanBackwardPairs) {
  using T = TypeParam;
  const int64_t n = 23, dim = 9, N = 4, later = 6;
  const Scan<T> in(n + later, dim, N, 300);
  // The chunk is the first n tokens; the later tokens are the next `later` ones.
  const std::vector<T> dy = Normal<T>((n + later) * dim, 301), dA0 = Rand<T>(dim * N, 302), dD0 = Rand<T>(dim, 303);
  for (int64_t window : {int64_t{1} << 40, int64_t{n + later}, int64_t{5}, int64_t{1}}) {
    for (int variant = 0; variant < 8; ++variant) {
      const bool with_h0 = variant & 1, with_later = variant & 2, with_d = variant & 4;
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> U(dev, in.u, "u"), DT(dev, in.delta, "delta"), A(dev, in.A, "A"), B(dev, in.B, "B"), C(dev, in.C, "C"),
            D(dev, in.D, "D"), H0(dev, in.h0, "h0"), DY(dev, dy, "dy"), DU(dev, n * dim, Nan<T>(), "du"),
            DDT(dev, n * dim, Nan<T>(), "ddelta"), DA(dev, dA0, "dA"), DB(dev, n * N, Nan<T>(), "dB"),
            DC(dev, n * N, Nan<T>(), "dC"), DD(dev, dD0, "dD");
        // The later tokens' arrays as separate buffers (guarded, so reads past `later` rows stay in bounds).
        Buf<T> LDY(dev, std::vector<T>(dy.begin() + n * dim, dy.end()), "later_dy"),
            LDT(dev, std::vector<T>(in.delta.begin() + n * dim, in.delta.end()), "later_delta"),
            LC(dev, std::vector<T>(in.C.begin() + n * N, in.C.end()), "later_C");
        Outs o;
        o.scalar = static_cast<double>(ops.selective_scan_backward_pairs(
            DY.data(), U.data(), DT.data(), A.data(), B.data(), C.data(), with_d ? D.data() : nullptr,
            with_h0 ? H0.data() : nullptr, n, dim, N, with_later ? LDY.data() : nullptr,
            with_later ? LDT.data() : nullptr, with_later ? LC.data() : nullptr, with_later ? later : 0, window,
            DU.data(), DDT.data(), DA.data(), DB.data(), DC.data(), with_d ? DD.data() : nullptr));
        o.Add(DU);
        o.Add(DDT);
        o.Add(DA);
        o.Add(DB);
        o.Add(DC);
        o.Add(DD);
        return o;
      });
      const std::string what = "pairs window=" + std::to_string(window) + (with_h0 ? " h0" : "") +
                               (with_later ? " later" : "") + (with_d ? " D" : "");
      EXPECT_EQ(dut.scalar, cpu.scalar) << what << ": pair counts";
      ExpectAllClose(dut, cpu, kLoose<T>, what);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Gated DeltaNet

struct GatedDeltaCase {
  int64_t n, k_heads, v_heads, dk, dv;
};

// Shapes: one token; the CPU test's (k_heads < v_heads); dv not a multiple of 32 over two warps; a short last
// checkpoint block (40 tokens, blocks of 7); no tokens (s_final = s0, ds0 = ds_final).
TYPED_TEST(CudaOpsTest, GatedDeltaForwardBackward) {
  using T = TypeParam;
  for (GatedDeltaCase c : {GatedDeltaCase{1, 1, 1, 3, 5}, GatedDeltaCase{9, 2, 4, 3, 5},
                           GatedDeltaCase{37, 2, 4, 8, 40}, GatedDeltaCase{40, 1, 3, 16, 32},
                           GatedDeltaCase{0, 2, 4, 3, 5}}) {
    const int64_t qk = c.n * c.k_heads * c.dk, values = c.n * c.v_heads * c.dv, gates = c.n * c.v_heads,
                  state = c.v_heads * c.dk * c.dv;
    const uint64_t seed = 400 + c.n + c.dv;
    const std::vector<T> q = Normal<T>(qk, seed), k = Normal<T>(qk, seed + 1, 0.5), v = Normal<T>(values, seed + 2),
                         g = Rand<T>(gates, seed + 3, -0.8, -0.01), beta = Rand<T>(gates, seed + 4, 0.05, 0.95),
                         s0 = Normal<T>(state, seed + 5), dout = Normal<T>(values, seed + 6),
                         ds_final = Normal<T>(state, seed + 7);
    // Variants: every state argument given; none; a state in and its gradient out only; a state out and its
    // gradient in only; every one given, s_final written over s0 and ds0 over ds_final.
    for (int variant = 0; variant < 5; ++variant) {
      const bool with_s0 = variant != 1 && variant != 3, with_sf = variant != 1 && variant != 2, alias = variant == 4;
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> Q(dev, q, "q"), K(dev, k, "k"), V(dev, v, "v"), G(dev, g, "g"), BE(dev, beta, "beta"), S0(dev, s0, "s0"),
            OUT(dev, values, Nan<T>(), "out"), SF(dev, state, Nan<T>(), "s_final"), DOUT(dev, dout, "dout"),
            DSF(dev, ds_final, "ds_final"), DQ(dev, qk, Nan<T>(), "dq"), DK(dev, qk, Nan<T>(), "dk"),
            DV(dev, values, Nan<T>(), "dv"), DG(dev, gates, Nan<T>(), "dg"), DBE(dev, gates, Nan<T>(), "dbeta"),
            DS0(dev, state, Nan<T>(), "ds0"),
            W(dev, ops.gated_delta_workspace_elems(c.n, c.v_heads, c.dk, c.dv), Nan<T>(), "workspace");
        const T* s0p = with_s0 ? S0.data() : nullptr;
        Buf<T>& sf = alias ? S0 : SF;
        Buf<T>& ds0 = alias ? DSF : DS0;
        Buf<T> S0_copy(dev, s0, "s0 (backward)");  // the backward's s0 when the forward overwrote S0
        ops.gated_delta_forward(Q.data(), K.data(), V.data(), G.data(), BE.data(), s0p, c.n, c.k_heads, c.v_heads,
                                c.dk, c.dv, OUT.data(), with_sf ? sf.data() : nullptr);
        ops.gated_delta_backward(DOUT.data(), with_sf ? DSF.data() : nullptr, Q.data(), K.data(), V.data(), G.data(),
                                 BE.data(), alias ? S0_copy.data() : s0p, c.n, c.k_heads, c.v_heads, c.dk, c.dv,
                                 DQ.data(), DK.data(), DV.data(), DG.data(), DBE.data(),
                                 with_s0 ? ds0.data() : nullptr, W.data());
        Outs o;
        for (const Buf<T>* b : {&OUT, &sf, &DQ, &DK, &DV, &DG, &DBE, &ds0}) o.Add(*b);
        EXPECT_EQ(Q.Raw(), q);
        if (!alias) {
          EXPECT_EQ(S0.Raw(), s0);
        }
        W.GuardsIntact();
        return o;
      });
      ExpectAllClose(dut, cpu, kLoose<T>,
                     "gated_delta n=" + std::to_string(c.n) + " heads " + std::to_string(c.k_heads) + "/" +
                         std::to_string(c.v_heads) + " dk=" + std::to_string(c.dk) + " dv=" + std::to_string(c.dv) +
                         " variant " + std::to_string(variant));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Mamba-2

struct SsdCase {
  int64_t n, heads, head_dim, groups, N;
  double dt_min, dt_max;
};

// Shapes: one token; the CPU test's (two heads per group, dt clamped at both ends); head_dim over two warps with
// idle lanes and a short last checkpoint block (37 tokens, blocks of 7); one group; no tokens (s_final = s0,
// ds0 = ds_final).
TYPED_TEST(CudaOpsTest, SsdForwardBackward) {
  using T = TypeParam;
  const double inf = std::numeric_limits<double>::infinity();
  for (SsdCase c : {SsdCase{1, 1, 1, 1, 3, 0, inf}, SsdCase{9, 4, 3, 2, 5, 0.3, 1.5},
                    SsdCase{37, 4, 40, 2, 16, 0.2, inf}, SsdCase{40, 3, 32, 1, 8, 0, 2.0},
                    SsdCase{0, 4, 3, 2, 5, 0, inf}}) {
    const int64_t xs = c.n * c.heads * c.head_dim, dts = c.n * c.heads, bc = c.n * c.groups * c.N,
                  state = c.heads * c.head_dim * c.N;
    const uint64_t seed = 500 + c.n + c.head_dim;
    std::vector<T> dt_raw = Normal<T>(dts, seed + 1, 1.2);
    if (dts > 0) dt_raw[0] = 21;  // softplus past its threshold
    const std::vector<T> x = Normal<T>(xs, seed), dt_bias = Normal<T>(c.heads, seed + 2, 0.5),
                         A_log = Normal<T>(c.heads, seed + 3, 0.5), B = Normal<T>(bc, seed + 4),
                         C = Normal<T>(bc, seed + 5), D = Normal<T>(c.heads, seed + 6), s0 = Normal<T>(state, seed + 7),
                         dy = Normal<T>(xs, seed + 8), ds_final = Normal<T>(state, seed + 9),
                         acc0 = Normal<T>(c.heads, seed + 10);
    // Variants: every argument given; no state, no D; a state in and its gradient out only; a state out and its
    // gradient in only; every one given, s_final written over s0 and ds0 over ds_final.
    for (int variant = 0; variant < 5; ++variant) {
      const bool with_s0 = variant != 1 && variant != 3, with_sf = variant != 1 && variant != 2, alias = variant == 4,
                 with_d = variant != 1;
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> X(dev, x, "x"), DT(dev, dt_raw, "dt_raw"), BIAS(dev, dt_bias, "dt_bias"), AL(dev, A_log, "A_log"),
            BB(dev, B, "B"), CC(dev, C, "C"), DD(dev, D, "D"), S0(dev, s0, "s0"), Y(dev, xs, Nan<T>(), "y"),
            SF(dev, state, Nan<T>(), "s_final"), DY(dev, dy, "dy"), DSF(dev, ds_final, "ds_final"),
            DX(dev, xs, Nan<T>(), "dx"), DDT(dev, dts, Nan<T>(), "ddt_raw"), DBIAS(dev, acc0, "ddt_bias"),
            DAL(dev, acc0, "dA_log"), DB(dev, bc, Nan<T>(), "dB"), DC(dev, bc, Nan<T>(), "dC"), DDD(dev, acc0, "dD"),
            DS0(dev, state, Nan<T>(), "ds0"),
            W(dev, ops.ssd_workspace_elems(c.n, c.heads, c.head_dim, c.groups, c.N), Nan<T>(), "workspace");
        const T* s0p = with_s0 ? S0.data() : nullptr;
        const T* dp = with_d ? DD.data() : nullptr;
        Buf<T>& sf = alias ? S0 : SF;
        Buf<T>& ds0 = alias ? DSF : DS0;
        Buf<T> S0_copy(dev, s0, "s0 (backward)");  // the backward's s0 when the forward overwrote S0
        ops.ssd_forward(X.data(), DT.data(), BIAS.data(), AL.data(), BB.data(), CC.data(), dp, s0p, c.n, c.heads,
                        c.head_dim, c.groups, c.N, c.dt_min, c.dt_max, Y.data(), with_sf ? sf.data() : nullptr);
        ops.ssd_backward(DY.data(), with_sf ? DSF.data() : nullptr, X.data(), DT.data(), BIAS.data(), AL.data(),
                         BB.data(), CC.data(), dp, alias ? S0_copy.data() : s0p, c.n, c.heads, c.head_dim, c.groups,
                         c.N, c.dt_min, c.dt_max, DX.data(), DDT.data(), DBIAS.data(), DAL.data(), DB.data(),
                         DC.data(), with_d ? DDD.data() : nullptr, with_s0 ? ds0.data() : nullptr, W.data());
        Outs o;
        for (const Buf<T>* b : {&Y, &sf, &DX, &DDT, &DBIAS, &DAL, &DB, &DC, &DDD, &ds0}) o.Add(*b);
        EXPECT_EQ(X.Raw(), x);
        if (!alias) {
          EXPECT_EQ(S0.Raw(), s0);
        }
        W.GuardsIntact();
        return o;
      });
      ExpectAllClose(dut, cpu, kLoose<T>,
                     "ssd n=" + std::to_string(c.n) + " heads " + std::to_string(c.heads) + "/" +
                         std::to_string(c.groups) + " head_dim=" + std::to_string(c.head_dim) +
                         " N=" + std::to_string(c.N) + " variant " + std::to_string(variant));
    }
  }
}

// Adjoint sharding: a chunk with later tokens and every pair, a truncated window, a window past everything; with
// and without s0 and D; head_dim over two warps with idle lanes.
TYPED_TEST(CudaOpsTest, SsdBackwardPairs) {
  using T = TypeParam;
  const int64_t n = 13, later = 6, heads = 4, head_dim = 40, groups = 2, N = 8;
  const int64_t xs = n * heads * head_dim, dts = n * heads, bc = n * groups * N, state = heads * head_dim * N;
  const std::vector<T> x = Normal<T>(xs, 530), dt_raw = Normal<T>(dts, 531, 1.2), dt_bias = Normal<T>(heads, 532, 0.5),
                       A_log = Normal<T>(heads, 533, 0.5), B = Normal<T>(bc, 534), C = Normal<T>(bc, 535),
                       D = Normal<T>(heads, 536), s0 = Normal<T>(state, 537), dy = Normal<T>(xs, 538),
                       later_dy = Normal<T>(later * heads * head_dim, 539),
                       later_dt = Normal<T>(later * heads, 540, 1.2), later_C = Normal<T>(later * groups * N, 541),
                       acc0 = Normal<T>(heads, 542);
  for (auto [window, with_later, with_extras] :
       {std::tuple<int64_t, bool, bool>{int64_t(1) << 40, true, true}, {5, false, true}, {1, true, false}}) {
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> X(dev, x, "x"), DT(dev, dt_raw, "dt_raw"), BIAS(dev, dt_bias, "dt_bias"), AL(dev, A_log, "A_log"),
          BB(dev, B, "B"), CC(dev, C, "C"), DD(dev, D, "D"), S0(dev, s0, "s0"), DY(dev, dy, "dy"),
          LDY(dev, later_dy, "later_dy"), LDT(dev, later_dt, "later_dt_raw"), LC(dev, later_C, "later_C"),
          DX(dev, xs, Nan<T>(), "dx"), DDT(dev, dts, Nan<T>(), "ddt_raw"), DBIAS(dev, acc0, "ddt_bias"),
          DAL(dev, acc0, "dA_log"), DB(dev, bc, Nan<T>(), "dB"), DC(dev, bc, Nan<T>(), "dC"), DDD(dev, acc0, "dD"),
          W(dev, ops.ssd_workspace_elems(n, heads, head_dim, groups, N), Nan<T>(), "workspace");
      Outs o;
      o.scalar = static_cast<double>(ops.ssd_backward_pairs(
          DY.data(), X.data(), DT.data(), BIAS.data(), AL.data(), BB.data(), CC.data(),
          with_extras ? DD.data() : nullptr, with_extras ? S0.data() : nullptr, n, heads, head_dim, groups, N, 0.2,
          2.0, with_later ? LDY.data() : nullptr, with_later ? LDT.data() : nullptr,
          with_later ? LC.data() : nullptr, with_later ? later : 0, window, DX.data(), DDT.data(), DBIAS.data(),
          DAL.data(), DB.data(), DC.data(), with_extras ? DDD.data() : nullptr, W.data()));
      for (const Buf<T>* b : {&DX, &DDT, &DBIAS, &DAL, &DB, &DC, &DDD}) o.Add(*b);
      W.GuardsIntact();
      return o;
    });
    const std::string what = "ssd_backward_pairs window=" + std::to_string(window) + (with_later ? " later" : "") +
                             (with_extras ? " s0 D" : "");
    EXPECT_EQ(dut.scalar, cpu.scalar) << what << ": pair counts";
    ExpectAllClose(dut, cpu, kLoose<T>, what);
  }
}

// Groups of a row (group_size < dim) and one group per row; rows past the grid's first pass.
TYPED_TEST(CudaOpsTest, GatedGroupRmsnormForwardBackward) {
  using T = TypeParam;
  for (auto [rows, dim, group_size] : {std::tuple<int64_t, int64_t, int64_t>{7, 96, 24}, {300, 40, 40}, {0, 8, 4}}) {
    const int64_t count = rows * dim, groups = rows * (dim / group_size);
    const std::vector<T> x = Normal<T>(count, 520), z = Normal<T>(count, 521, 2), w = Normal<T>(dim, 522),
                         dout = Normal<T>(count, 523), dw0 = Normal<T>(dim, 524);
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> X(dev, x, "x"), Z(dev, z, "z"), W(dev, w, "w"), OUT(dev, count, Nan<T>(), "out"),
          R(dev, groups, Nan<T>(), "rstd"), DO(dev, dout, "dout"), DX(dev, count, Nan<T>(), "dx"),
          DZ(dev, count, Nan<T>(), "dz"), DW(dev, dw0, "dw");
      ops.gated_group_rmsnorm_forward(X.data(), Z.data(), W.data(), rows, dim, group_size, 1e-5, OUT.data(), R.data());
      ops.gated_group_rmsnorm_backward(DO.data(), X.data(), Z.data(), W.data(), R.data(), rows, dim, group_size, 1e-5,
                                       DX.data(), DZ.data(), DW.data());
      Outs o;
      for (const Buf<T>* b : {&OUT, &R, &DX, &DZ, &DW}) o.Add(*b);
      return o;
    });
    ExpectAllClose(dut, cpu, kLoose<T>, "gated_group_rmsnorm rows=" + std::to_string(rows) + " dim=" +
                                            std::to_string(dim) + " group_size=" + std::to_string(group_size));
  }
}

TYPED_TEST(CudaOpsTest, GdnGatesForwardBackward) {
  using T = TypeParam;
  const int64_t n = 300, heads = 5;
  std::vector<T> a = Normal<T>(n * heads, 450, 3);
  a[7] = 25;  // softplus above its threshold
  const std::vector<T> b = Normal<T>(n * heads, 451, 3), a_log = Normal<T>(heads, 452, 0.5),
                       dt_bias = Normal<T>(heads, 453), dg = Normal<T>(n * heads, 454),
                       dbeta = Normal<T>(n * heads, 455), da_log0 = Normal<T>(heads, 456),
                       ddt0 = Normal<T>(heads, 457);
  auto [dut, cpu] = RunBoth([&](Device dev) {
    const OpTable<T>& ops = OpsFor<T>(dev);
    Buf<T> A(dev, a, "a"), B(dev, b, "b"), AL(dev, a_log, "a_log"), DT(dev, dt_bias, "dt_bias"),
        G(dev, n * heads, Nan<T>(), "g"), BE(dev, n * heads, Nan<T>(), "beta"), DG(dev, dg, "dg"),
        DBE(dev, dbeta, "dbeta"), DA(dev, n * heads, Nan<T>(), "da"), DB(dev, n * heads, Nan<T>(), "db"),
        DAL(dev, da_log0, "da_log"), DDT(dev, ddt0, "ddt_bias");
    ops.gdn_gates_forward(A.data(), B.data(), AL.data(), DT.data(), n, heads, G.data(), BE.data());
    ops.gdn_gates_backward(DG.data(), DBE.data(), A.data(), B.data(), AL.data(), DT.data(), n, heads, DA.data(),
                           DB.data(), DAL.data(), DDT.data());
    Outs o;
    for (const Buf<T>* x : {&G, &BE, &DA, &DB}) o.Add(*x);
    o.Add(DAL);
    o.Add(DDT);
    return o;
  });
  // g, beta, da, db element by element; da_log and ddt_bias are sums over the tokens
  for (size_t i = 0; i < dut.v.size(); ++i)
    ExpectClose(dut.v[i].second, cpu.v[i].second, i < 4 ? kTight<T> : kLoose<T>, "gdn_gates " + cpu.v[i].first);
}

TYPED_TEST(CudaOpsTest, SigmoidGateAndCopyRows) {
  using T = TypeParam;
  const int64_t count = 1000, rows = 13, ld_src = 40, ld_dst = 24, cols = 17;
  const std::vector<T> gate = Normal<T>(count, 460, 3), x = Normal<T>(count, 461), dout = Normal<T>(count, 462),
                       src = Normal<T>(rows * ld_src, 463), dst0 = Normal<T>(rows * ld_dst, 464);
  auto [dut, cpu] = RunBoth([&](Device dev) {
    const OpTable<T>& ops = OpsFor<T>(dev);
    Buf<T> GA(dev, gate, "gate"), X(dev, x, "x"), DO(dev, dout, "dout"), OUT(dev, count, Nan<T>(), "out"),
        DGA(dev, count, Nan<T>(), "dgate"), DX(dev, count, Nan<T>(), "dx"), SRC(dev, src, "src"), DST(dev, dst0, "dst");
    ops.sigmoid_gate_forward(GA.data(), X.data(), count, OUT.data());
    ops.sigmoid_gate_backward(DO.data(), GA.data(), X.data(), count, DGA.data(), DX.data());
    // columns [5, 22) of src into columns [3, 20) of dst; the other columns of dst stay
    ops.copy_rows(DST.data() + 3, ld_dst, SRC.data() + 5, ld_src, rows, cols);
    Outs o;
    for (const Buf<T>* b : {&OUT, &DGA, &DX}) o.Add(*b);
    o.Add(DST);
    return o;
  });
  ExpectAllClose(dut, cpu, kTight<T>, "sigmoid_gate");
  EXPECT_EQ(dut.v[3].second, cpu.v[3].second) << "copy_rows";
}

// ---------------------------------------------------------------------------------------------------------------
// Mixture of experts

struct MoeRouteCase {
  int64_t n, experts, k;
  bool normalize;
};

// Shapes: a few experts, top 2; as many experts as the block's threads; more experts than threads (some threads
// scan three, some two); k = experts; k = 1; no tokens. Row 1 has exactly equal logits (picks in index order), row
// 2 two equal pairs, row 3 a NaN logit (all its probabilities NaN, picks in index order). With and without the
// load-balancing term.
TYPED_TEST(CudaOpsTest, MoeRouteForwardBackward) {
  using T = TypeParam;
  for (MoeRouteCase c : {MoeRouteCase{37, 8, 2, true}, MoeRouteCase{5, 128, 8, false}, MoeRouteCase{20, 300, 10, true},
                         MoeRouteCase{6, 6, 6, true}, MoeRouteCase{4, 5, 1, false}, MoeRouteCase{0, 8, 2, true}}) {
    const int64_t rows = c.n * c.experts, picks = c.n * c.k;
    const uint64_t seed = 500 + c.experts + c.k;
    std::vector<T> logits = Normal<T>(rows, seed, 2);
    if (c.n > 3) {
      std::fill(logits.begin() + c.experts, logits.begin() + 2 * c.experts, T(0.5));
      logits[2 * c.experts + 3] = logits[2 * c.experts + 1];
      logits[2 * c.experts + 4] = logits[2 * c.experts + 0];
      logits[3 * c.experts + 2] = Nan<T>();
    }
    const std::vector<T> dweights = Normal<T>(picks, seed + 1), extra = Normal<T>(c.experts, seed + 2);
    for (bool with_extra : {false, true}) {
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<T>& ops = OpsFor<T>(dev);
        Buf<T> X(dev, logits, "logits"), P(dev, rows, Nan<T>(), "probs"), W(dev, picks, Nan<T>(), "weights"),
            DW(dev, dweights, "dweights"), E(dev, extra, "dprobs_extra"), DX(dev, rows, Nan<T>(), "dlogits");
        Buf<int32_t> TOP(dev, picks, -1, "top");
        ops.moe_route(X.data(), c.n, c.experts, c.k, c.normalize, P.data(), TOP.data(), W.data());
        ops.moe_route_backward(DW.data(), P.data(), TOP.data(), c.n, c.experts, c.k, c.normalize,
                               with_extra ? E.data() : nullptr, DX.data());
        Outs o;
        o.Add(TOP);
        for (const Buf<T>* b : {&P, &W, &DX}) o.Add(*b);
        const std::vector<T> after = X.Raw();  // unchanged, bit for bit (a NaN is not equal to itself)
        EXPECT_EQ(std::memcmp(after.data(), logits.data(), rows * sizeof(T)), 0);
        return o;
      });
      const std::string what = "moe_route n=" + std::to_string(c.n) + " experts=" + std::to_string(c.experts) +
                               " k=" + std::to_string(c.k) + (c.normalize ? " normalized" : "") +
                               (with_extra ? " balance" : "");
      ExpectAllEqual(Outs{{dut.v[0]}}, Outs{{cpu.v[0]}}, what);
      for (size_t i = 1; i < cpu.v.size(); ++i)
        ExpectClose(dut.v[i].second, cpu.v[i].second, kTight<T>, what + " " + cpu.v[i].first);
    }
  }
}

// Rows gathered by index, scattered back (scaled or not) onto other values, and their dots; 70 columns span more
// than one grid-stride thread's share.
TYPED_TEST(CudaOpsTest, GatherScatterAddRowDots) {
  using T = TypeParam;
  const int64_t src_rows = 50, rows = 20, cols = 70;
  std::vector<int32_t> index(src_rows);
  std::iota(index.begin(), index.end(), 0);
  std::shuffle(index.begin(), index.end(), std::mt19937_64(510));
  index.resize(rows);
  const std::vector<T> src = Normal<T>(src_rows * cols, 511), dst0 = Normal<T>(src_rows * cols, 512),
                       scale = Normal<T>(rows, 513), other = Normal<T>(rows * cols, 514);
  for (bool scaled : {false, true}) {
    auto [dut, cpu] = RunBoth([&](Device dev) {
      const OpTable<T>& ops = OpsFor<T>(dev);
      Buf<T> SRC(dev, src, "src"), G(dev, rows * cols, Nan<T>(), "gathered"), S(dev, scale, "scale"),
          DST(dev, dst0, "dst"), B(dev, other, "b"), DOT(dev, rows, Nan<T>(), "dots");
      Buf<int32_t> I(dev, index, "index");
      ops.gather_rows(SRC.data(), I.data(), rows, cols, G.data());
      ops.scatter_add_rows(G.data(), I.data(), scaled ? S.data() : nullptr, rows, cols, DST.data());
      ops.row_dots(G.data(), B.data(), rows, cols, DOT.data());
      Outs o;
      for (const Buf<T>* b : {&G, &DST, &DOT}) o.Add(*b);
      return o;
    });
    const std::string what = scaled ? "rows scaled" : "rows";
    ExpectAllEqual(Outs{{dut.v[0]}}, Outs{{cpu.v[0]}}, what + " gather");  // a gather is exact
    ExpectClose(dut.v[1].second, cpu.v[1].second, kTight<T>, what + " scatter_add");
    ExpectClose(dut.v[2].second, cpu.v[2].second, kTight<T>, what + " row_dots");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 storage (--dtype=bf16): the f32 table's bf16 entries against the CPU table's. The device rounds where its
// tensor cores do (GEMM operands, attention's q, dO, P and dS), the CPU does not: a device result must be at most
// twice as far from the CPU table's as the bf16-rounded reference is, i.e. the CPU's computation on inputs rounded
// to bf16 with its result rounded to the output's storage type.

std::vector<uint16_t> Bf16Bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = F32ToBF16(x[i]);
  return b;
}
float RoundBf16(float x) { return BF16ToF32(F32ToBF16(x)); }
std::vector<float> RoundedBf16(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = RoundBf16(x[i]);
  return r;
}

// One bf16 step at x's magnitude (the spacing of bf16 values in [2^k, 2^(k+1))).
double Bf16Step(double x) { return x == 0 ? 0 : std::ldexp(1.0, std::ilogb(x) - 7); }

// max |dut - cpu| <= 2 max |rounded - cpu| + floor * max |cpu|; NaN where the CPU has none fails. With bf16_storage
// each element may also be one bf16 step off: the device's fp32 result, summed in another order, can fall on the
// other side of a rounding boundary than the CPU's.
void ExpectWithinTwiceRounded(const std::vector<double>& dut, const std::vector<double>& cpu,
                              const std::vector<double>& rounded, double floor, const std::string& what,
                              bool bf16_storage = false) {
  ASSERT_EQ(dut.size(), cpu.size()) << what;
  ASSERT_EQ(rounded.size(), cpu.size()) << what;
  double scale = 0, err = 0, ref_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isfinite(cpu[i])) scale = std::max(scale, std::abs(cpu[i]));
    if (dut[i] == cpu[i]) continue;  // also equal infinities (lse of rows without keys)
    double e = std::isfinite(dut[i]) && std::isfinite(cpu[i]) ? std::abs(dut[i] - cpu[i]) : INFINITY;
    if (bf16_storage && e <= Bf16Step(cpu[i])) e = 0;
    if (e > err) err = e, worst = i;
    if (rounded[i] != cpu[i] && std::isfinite(rounded[i]) && std::isfinite(cpu[i]))
      ref_err = std::max(ref_err, std::abs(rounded[i] - cpu[i]));
  }
  EXPECT_LE(err, 2 * ref_err + floor * scale)
      << what << ": max |cuda - cpu| = " << err << " at " << worst << " (cuda " << dut[worst] << ", cpu "
      << cpu[worst] << "), bf16-rounded reference's max |ref - cpu| = " << ref_err << ", max |cpu| = " << scale;
  if (std::getenv("SG_OPS_TEST_VERBOSE"))
    std::cout << what << ": max |cuda - cpu| " << err << ", rounded reference " << ref_err << ", max |cpu| " << scale
              << "\n";
}

struct MixedTypes {
  DType a, b, c;
};

// gemm_mixed over every supported combination the engine uses (activation x bf16 weight, bf16 x bf16, bf16 C),
// transposes, padded leading dimensions, alpha/beta and an empty product.
TEST_F(GpuTest, Bf16GemmMixedWithinTwiceRoundedReference) {
  const std::vector<MixedTypes> types = {{DType::kF32, DType::kBF16, DType::kF32},
                                         {DType::kBF16, DType::kBF16, DType::kF32},
                                         {DType::kBF16, DType::kBF16, DType::kBF16},
                                         {DType::kF32, DType::kF32, DType::kBF16},
                                         {DType::kBF16, DType::kF32, DType::kF32}};
  const std::vector<GemmShape> shapes = {{37, 29, 53}, {1, 70, 19}, {64, 48, 256}, {5, 3, 1}, {4, 6, 0}, {0, 5, 3}};
  uint64_t seed = 300;
  for (const MixedTypes& t : types)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (const GemmShape& g : shapes)
          for (auto [alpha, beta] : {std::pair<float, float>(1, 0), std::pair<float, float>(0.7f, -1.3f)}) {
            const int64_t pad = 3;
            const int64_t a_rows = ta ? g.k : g.m, a_cols = ta ? g.m : g.k;
            const int64_t b_rows = tb ? g.n : g.k, b_cols = tb ? g.k : g.n;
            const int64_t lda = std::max<int64_t>(a_cols, 1) + pad, ldb = std::max<int64_t>(b_cols, 1) + pad,
                          ldc = std::max<int64_t>(g.n, 1) + pad;
            // Values as stored: bf16 operands hold bf16-representable values.
            auto stored = [](DType d, std::vector<float> v) { return d == DType::kBF16 ? RoundedBf16(v) : v; };
            const std::vector<float> a = stored(t.a, Normal<float>(a_rows * lda, seed++)),
                                     b = stored(t.b, Normal<float>(b_rows * ldb, seed++)),
                                     c = stored(t.c, Normal<float>(g.m * ldc, seed++));
            auto run = [&](Device d, const std::vector<float>& av, const std::vector<float>& bv) {
              Buf<float> fa(d, av, "A"), fb(d, bv, "B"), fc(d, c, "C");
              Buf<uint16_t> ha(d, Bf16Bits(av), "A"), hb(d, Bf16Bits(bv), "B"), hc(d, Bf16Bits(c), "C");
              auto ptr = [](DType dt, Buf<float>& f, Buf<uint16_t>& h) -> void* {
                return dt == DType::kBF16 ? static_cast<void*>(h.data()) : static_cast<void*>(f.data());
              };
              OpsFor<float>(d).gemm_mixed(ta, tb, g.m, g.n, g.k, alpha, t.a, ptr(t.a, fa, ha), lda, t.b,
                                          ptr(t.b, fb, hb), ldb, beta, t.c, ptr(t.c, fc, hc), ldc);
              return t.c == DType::kBF16 ? hc.Values() : fc.Values();
            };
            const std::vector<double> cpu = run(Device::kCPU, a, b), dut = run(Dut(), a, b);
            // The bf16-rounded reference: fp64 over the operands rounded to bf16, rounded to C's type.
            std::vector<double> rounded(cpu.size());
            for (int64_t i = 0; i < g.m; ++i)
              for (int64_t j = 0; j < ldc; ++j) {
                if (j >= g.n) {
                  rounded[i * ldc + j] = c[i * ldc + j];  // padding: untouched
                  continue;
                }
                double acc = 0;
                for (int64_t p = 0; p < g.k; ++p)
                  acc += double(RoundBf16(ta ? a[p * lda + i] : a[i * lda + p])) *
                         RoundBf16(tb ? b[j * ldb + p] : b[p * ldb + j]);
                const double v = alpha * acc + (beta == 0 ? 0.0 : double(beta) * c[i * ldc + j]);
                rounded[i * ldc + j] = t.c == DType::kBF16 ? RoundBf16(static_cast<float>(v)) : static_cast<float>(v);
              }
            const std::string what = std::string("gemm_mixed ") + DTypeName(t.a) + "*" + DTypeName(t.b) + "->" +
                                     DTypeName(t.c) + " " + (ta ? "T" : "N") + (tb ? "T" : "N") + " " +
                                     std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k) +
                                     " beta " + std::to_string(beta);
            ExpectWithinTwiceRounded(dut, cpu, rounded, 1e-5, what, t.c == DType::kBF16);
            for (int64_t i = 0; i < g.m; ++i)
              for (int64_t j = g.n; j < ldc; ++j)
                ASSERT_EQ(dut[i * ldc + j], static_cast<double>(c[i * ldc + j]))  // bf16 C: representable
                    << what << ": padding of C row " << i << " written";
          }
}

TEST_F(GpuTest, Bf16ConversionsMatchCpuBitForBit) {
  std::vector<float> x = Normal<float>(5000, 310, 100.0);
  const float inf = std::numeric_limits<float>::infinity();
  for (float special : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 1.0f + 1.0f / 256,
                        1.0f + 3.0f / 256, -(1.0f + 1.0f / 256), 1e-40f, -1e-42f, 3.4e38f, -3.39e38f})
    x.push_back(special);
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), uint16_t{0});
  std::vector<std::vector<uint16_t>> narrowed;
  std::vector<std::vector<uint32_t>> widened;
  for (Device d : {Device::kCPU, Dut()}) {
    Buf<float> src(d, x, "f32"), wide(d, static_cast<int64_t>(all.size()), Nan<float>(), "widened");
    Buf<uint16_t> narrow(d, static_cast<int64_t>(x.size()), Nan<uint16_t>(), "bf16"), bits(d, all, "all bf16");
    OpsFor<float>(d).f32_to_bf16(src.data(), static_cast<int64_t>(x.size()), narrow.data());
    OpsFor<float>(d).bf16_to_f32(bits.data(), static_cast<int64_t>(all.size()), wide.data());
    narrowed.push_back(narrow.Raw());
    std::vector<uint32_t> w(all.size());
    const std::vector<float> wf = wide.Raw();
    std::memcpy(w.data(), wf.data(), w.size() * 4);
    widened.push_back(std::move(w));
  }
  EXPECT_TRUE(narrowed[0] == narrowed[1]) << "f32_to_bf16 differs from the CPU's rounding";
  EXPECT_TRUE(widened[0] == widened[1]) << "bf16_to_f32 differs from the CPU's";
  // round_bf16: the same rounding in one pass, x rounded in place and its bf16 bits out (more values than the CPU
  // rounds on one thread, so that it uses several).
  std::vector<float> many = Normal<float>(200000, 311, 10.0);
  many.insert(many.end(), x.begin(), x.end());
  const int64_t n = static_cast<int64_t>(many.size());
  for (Device d : {Device::kCPU, Dut()}) {
    Buf<float> v(d, many, "x");
    Buf<uint16_t> half(d, n, Nan<uint16_t>(), "half");
    OpsFor<float>(d).round_bf16(v.data(), n, half.data());
    const std::vector<float> rounded = v.Raw();
    const std::vector<uint16_t> bits = half.Raw();
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(bits[i], F32ToBF16(many[i])) << (d == Device::kCPU ? "cpu" : "cuda") << " round_bf16 bits of " << many[i];
      uint32_t got, want;
      const float want_f = BF16ToF32(bits[i]);
      std::memcpy(&got, &rounded[i], 4);
      std::memcpy(&want, &want_f, 4);
      ASSERT_EQ(got, want) << (d == Device::kCPU ? "cpu" : "cuda") << " round_bf16 value of " << many[i];
    }
  }
}

TEST_F(GpuTest, Bf16LossMatchesCpu) {
  for (int64_t vocab : {7, 1000, 32003}) {
    const int64_t n = 9;
    std::vector<int32_t> labels(n);
    for (int64_t i = 0; i < n; ++i) labels[i] = static_cast<int32_t>((i * 7919 + 3) % vocab);
    labels[2] = -100;
    labels[n - 1] = static_cast<int32_t>(vocab - 1);
    const std::vector<double> scales = {0.5, -2.0, 7.0, 1.0, 0.0, 3.0, -0.25, 1.5, 2.0};
    std::vector<float> logits = Normal<float>(n * vocab, 320 + vocab, 3.0);
    for (int64_t j = 0; j < vocab; ++j) logits[3 * vocab + j] += 50.0f;  // needs the max shift
    const std::vector<uint16_t> bits = Bf16Bits(logits);
    for (bool row_scale : {false, true}) {
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<float>& ops = OpsFor<float>(dev);
        Buf<uint16_t> grad(dev, bits, "dlogits"), L(dev, bits, "logits");
        HostBuf<double> lp(n, Nan<double>(), "logprobs");
        HostBuf<int32_t> am(n, 12345, "argmax");
        Outs o;
        o.scalar = ops.cross_entropy_bf16(grad.data(), labels.data(), n, vocab, row_scale ? scales.data() : nullptr,
                                          0.37, nullptr);
        ops.token_logprobs_bf16(L.data(), labels.data(), n, vocab, lp.data());
        ops.token_argmax_bf16(L.data(), labels.data(), n, vocab, am.data());
        o.Add(grad);
        o.Add("logprobs", lp.Raw());
        const std::vector<int32_t> a = am.Raw();
        o.Add("argmax", std::vector<double>(a.begin(), a.end()));
        EXPECT_EQ(L.Raw(), bits);
        return o;
      });
      const std::string what = "bf16 loss vocab=" + std::to_string(vocab) + (row_scale ? " row_scale" : "");
      // The same f32 arithmetic on the same widened rows: the gradient rows may differ by one bf16 rounding.
      ExpectClose(dut.v[0].second, cpu.v[0].second, 1.0 / 256, what + " dlogits");
      ExpectClose(dut.v[1].second, cpu.v[1].second, kTight<float>, what + " logprobs");
      EXPECT_EQ(dut.v[2].second, cpu.v[2].second) << what << " argmax";
      EXPECT_NEAR(dut.scalar, cpu.scalar, kTight<float> * std::max(1.0, std::abs(cpu.scalar))) << what << " loss";
    }
  }
}

TEST_F(GpuTest, Bf16AdamWStepsMastersAndRoundsWeights) {
  const int64_t count = 3001;
  const std::vector<float> p = Rand<float>(count, 330), g = Rand<float>(count, 331, -3, 3),
                           m = Rand<float>(count, 332, -0.1, 0.1), v = Rand<float>(count, 333, 0, 0.1);
  for (int64_t step : {1, 7}) {
    std::vector<uint16_t> dut_weights;
    std::vector<float> dut_master;
    auto [dut, cpu] = RunBoth([&](Device dev) {
      Buf<float> P(dev, p, "master"), G(dev, g, "g"), M(dev, m, "m"), V(dev, v, "v");
      Buf<uint16_t> W(dev, count, Nan<uint16_t>(), "weights");
      OpsFor<float>(dev).adamw_bf16(W.data(), P.data(), G.data(), M.data(), V.data(), count, 1e-3, 0.9, 0.95, 1e-8,
                                    0.1, step);
      dut_weights = W.Raw();  // the device's: RunBoth runs it last
      dut_master = P.Raw();
      Outs o;
      o.Add(P);
      o.Add(M);
      o.Add(V);
      return o;
    });
    ExpectAllClose(dut, cpu, kTight<float>, "adamw_bf16 step " + std::to_string(step));
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(dut_weights[i], F32ToBF16(dut_master[i])) << "weight " << i << " is not its master rounded to bf16";
  }
}

// Tensor-core attention over bf16 pages, forward and backward, on every shape of the f32/f64 test.
void CheckAttentionBf16(const AttnCase& c) {
  AttnSetup<float> setup(c, 2000 + c.n * 31 + c.head_dim);
  const std::vector<uint16_t> k = Bf16Bits(setup.k), v = Bf16Bits(setup.v), dk0 = Bf16Bits(setup.dk0),
                              dv0 = Bf16Bits(setup.dv0);
  // aligned: q, dO and the pools 16-byte aligned (the kernels' 16-byte tile loads, where head_dim and the page
  // stride allow them); otherwise misaligned (element loads).
  auto run = [&](Device d, const std::vector<float>& q, const std::vector<float>& dout, bool aligned) {
    const OpTable<float>& ops = OpsFor<float>(d);
    const AttentionShape& s = setup.s;
    const int64_t qn = s.n * s.heads * s.head_dim, guard = aligned ? kAlignedGuard : kGuard;
    Buf<float> Q(d, q, "q", guard), DO(d, dout, "dout", guard), out(d, qn, Nan<float>(), "out"),
        lse(d, s.heads * s.n, Nan<float>(), "lse"), dq(d, qn, Nan<float>(), "dq");
    Buf<uint16_t> K(d, k, "k pool", guard), V(d, v, "v pool", guard), dK(d, dk0, "dk pool"), dV(d, dv0, "dv pool");
    Buf<float> ws(d, std::max<int64_t>(1, ops.attention_workspace_elems(s, setup.page_size)), 0.0f, "workspace");
    ops.attention_forward_bf16(s, Q.data(), setup.View(K.data(), V.data(), setup.table), out.data(), lse.data(),
                               ws.data());
    ops.attention_backward_bf16(s, Q.data(), setup.View(K.data(), V.data(), setup.table), out.data(), lse.data(),
                                DO.data(), dq.data(), setup.View(dK.data(), dV.data(), setup.grad_table), ws.data());
    EXPECT_TRUE(ws.GuardsIntact()) << "the workspace overflowed attention_workspace_elems";
    EXPECT_EQ(K.Raw(), k);
    EXPECT_EQ(V.Raw(), v);
    Outs o;
    for (const Buf<float>* b : {&out, &lse, &dq}) o.Add(*b);
    o.Add(dK);
    o.Add(dV);
    return o;
  };
  const Outs cpu = run(Device::kCPU, setup.q, setup.dout, false);
  Outs rounded = run(Device::kCPU, RoundedBf16(setup.q), RoundedBf16(setup.dout), false);
  for (size_t i = 0; i < 3; ++i)  // out, lse, dq are f32: rounded to bf16 like the pools
    for (double& x : rounded.v[i].second) x = RoundBf16(static_cast<float>(x));
  const Outs dut = run(Dut(), setup.q, setup.dout, false);
  // The dK/dV pages: plus one bf16 ulp of the largest entry, as the device (once) and the CPU (per product) round
  // into the pages independently.
  for (size_t i = 0; i < cpu.v.size(); ++i)
    ExpectWithinTwiceRounded(dut.v[i].second, cpu.v[i].second, rounded.v[i].second, i < 3 ? 1e-6 : 1.0 / 128,
                             "bf16 attention " + cpu.v[i].first);
  ExpectGradientPagesOnly(setup, c, dut, dk0, dv0);
  // Deterministic, and the same bits whether the tiles move in 16-byte chunks or element by element.
  const Outs again = run(Dut(), setup.q, setup.dout, true);
  for (size_t i = 0; i < dut.v.size(); ++i)
    EXPECT_TRUE(again.v[i].second == dut.v[i].second) << "bf16 " << dut.v[i].first << " differs between runs";
}

TEST_P(CudaAttentionTest, Bf16TensorCoreMatchesCpu) { CheckAttentionBf16(GetParam()); }

// Head dims the shared list lacks: 256 (the widest tiles), 16 (one mma k-step), 24 (padded to 32).
TEST_F(GpuTest, Bf16TensorCoreAttentionHeadDims) {
  for (const AttnCase& c : {AttnCase{2, 1, 256, 16, 40, 30, true, true, true, 0},
                            AttnCase{4, 2, 16, 5, 67, 9, true, false, true, 2},
                            AttnCase{2, 2, 24, 4, 17, 70, false, true, false, 0}}) {
    SCOPED_TRACE("head_dim " + std::to_string(c.head_dim));
    CheckAttentionBf16(c);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Determinism: run twice, bitwise-identical results (no floating-point atomics in the order-sensitive sums).

TEST_F(GpuTest, AttentionBackwardIsDeterministic) {
  for (const AttnCase& c : {AttnCase{4, 1, 64, 16, 200, 100, true, false, false, 0},
                            AttnCase{4, 2, 128, 8, 97, 31, true, true, true, 0}}) {
    AttnSetup<float> f(c, 7);
    AttnSetup<double> d(c, 7);
    const Outs f1 = f.Run(Dut()), f2 = f.Run(Dut()), d1 = d.Run(Dut()), d2 = d.Run(Dut());
    for (size_t i = 0; i < f1.v.size(); ++i) {
      EXPECT_TRUE(f1.v[i].second == f2.v[i].second) << "f32 " << f1.v[i].first << " differs between runs";
      EXPECT_TRUE(d1.v[i].second == d2.v[i].second) << "f64 " << d1.v[i].first << " differs between runs";
    }
  }
}

TEST_F(GpuTest, EmbeddingBackwardIsDeterministic) {
  const int64_t vocab = 7, d = 96, n = 20000;
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * i + 3 * i) % vocab);
  const std::vector<float> dout = Normal<float>(n * d, 400);
  std::vector<std::vector<float>> runs;
  for (int r = 0; r < 3; ++r) {
    Buf<float> dy(Dut(), dout, "dout"), dtab(Dut(), vocab * d, 0.0f, "dtable");
    OpsFor<float>(Dut()).embedding_backward(ids.data(), n, dy.data(), d, dtab.data());
    runs.push_back(dtab.Raw());
  }
  EXPECT_TRUE(runs[0] == runs[1]);
  EXPECT_TRUE(runs[0] == runs[2]);
}

// The state-space backward passes sum over channels and time segments through scratch in a fixed order.
TEST_F(GpuTest, SsmBackwardIsDeterministic) {
  const int64_t n = 257, dim = 96, N = 16, ch = 96, k = 4;
  const Scan<float> in(n, dim, N, 500);
  const std::vector<float> dy = Normal<float>(n * dim, 501);
  const OpTable<float>& ops = OpsFor<float>(Dut());
  std::vector<std::vector<float>> runs;
  for (int r = 0; r < 2; ++r) {
    Buf<float> U(Dut(), in.u, "u"), DT(Dut(), in.delta, "delta"), A(Dut(), in.A, "A"), B(Dut(), in.B, "B"),
        C(Dut(), in.C, "C"), D(Dut(), in.D, "D"), DY(Dut(), dy, "dy"), DU(Dut(), n * dim, 0.f, "du"),
        DDT(Dut(), n * dim, 0.f, "ddelta"), DA(Dut(), dim * N, 0.f, "dA"), DB(Dut(), n * N, 0.f, "dB"),
        DC(Dut(), n * N, 0.f, "dC"), DD(Dut(), dim, 0.f, "dD"), W(Dut(), ch * k, 0.5f, "w"),
        DX(Dut(), n * ch, 0.f, "dx"), DW(Dut(), ch * k, 0.f, "dw"), DBias(Dut(), ch, 0.f, "db");
    ops.selective_scan_backward(DY.data(), nullptr, U.data(), DT.data(), A.data(), B.data(), C.data(), D.data(),
                                nullptr, n, dim, N, DU.data(), DDT.data(), DA.data(), DB.data(), DC.data(), DD.data(),
                                nullptr);
    std::vector<float> all;
    for (const Buf<float>* b : {&DU, &DDT, &DA, &DB, &DC, &DD}) {
      const std::vector<float> v = b->Raw();
      all.insert(all.end(), v.begin(), v.end());
    }
    DA = Buf<float>(Dut(), dim * N, 0.f, "dA");
    DD = Buf<float>(Dut(), dim, 0.f, "dD");
    ops.selective_scan_backward_pairs(DY.data(), U.data(), DT.data(), A.data(), B.data(), C.data(), D.data(), nullptr,
                                      n, dim, N, nullptr, nullptr, nullptr, 0, 32, DU.data(), DDT.data(), DA.data(),
                                      DB.data(), DC.data(), DD.data());
    for (const Buf<float>* b : {&DU, &DDT, &DA, &DB, &DC, &DD}) {
      const std::vector<float> v = b->Raw();
      all.insert(all.end(), v.begin(), v.end());
    }
    ops.conv1d_backward(DY.data(), nullptr, U.data(), nullptr, W.data(), n, ch, k, DX.data(), nullptr, DW.data(),
                        DBias.data());
    for (const Buf<float>* b : {&DX, &DW, &DBias}) {
      const std::vector<float> v = b->Raw();
      all.insert(all.end(), v.begin(), v.end());
    }
    runs.push_back(std::move(all));
  }
  EXPECT_TRUE(runs[0] == runs[1]) << "scan / pairs / conv1d backward differ between runs";
}

// ---------------------------------------------------------------------------------------------------------------
// Errors: an argument the kernels cannot take is an exception naming the op (the engine turns it into a status),
// not an abort; the backend stays usable afterwards.

// The dynamic type's (mangled) name: sg::cuda::CudaError is defined in a CUDA header this C++ test cannot include.
std::string TypeOf(const std::exception& e) { return typeid(e).name(); }

TEST_F(GpuTest, ErrorsAreExceptionsNamingTheOp) {
  if (SelfCheck()) GTEST_SKIP() << "CUDA argument checks";
  const OpTable<float>& ops = OpsFor<float>(Device::kCUDA);
  Buf<float> a(Device::kCUDA, 64, 1.0f, "A"), b(Device::kCUDA, 64, 1.0f, "B"), c(Device::kCUDA, 64, 0.0f, "C");
  // A leading dimension past cuBLAS's int range.
  const int64_t huge = static_cast<int64_t>(INT_MAX) + 1;
  try {
    ops.gemm(false, false, 2, 2, 2, 1.0f, a.data(), huge, b.data(), 2, 0.0f, c.data(), 2);
    ADD_FAILURE() << "gemm with lda = " << huge << " did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("lda"), std::string::npos) << e.what();
    EXPECT_NE(TypeOf(e).find("CudaError"), std::string::npos) << TypeOf(e);
  }
  EXPECT_EQ(c.Raw(), std::vector<float>(64, 0.0f));
  // A state size past the scan kernels' limit.
  {
    const int64_t n = 2, dim = 1, N = 100000;
    Buf<float> u(Device::kCUDA, n * dim, 0.1f, "u"), dt(Device::kCUDA, n * dim, 0.1f, "delta"),
        A(Device::kCUDA, dim * N, -1.0f, "A"), B(Device::kCUDA, n * N, 0.1f, "B"), C(Device::kCUDA, n * N, 0.1f, "C"),
        y(Device::kCUDA, n * dim, 0.0f, "y");
    try {
      ops.selective_scan_forward(u.data(), dt.data(), A.data(), B.data(), C.data(), nullptr, nullptr, n, dim, N,
                                 y.data(), nullptr);
      ADD_FAILURE() << "selective_scan_forward with N = " << N << " did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("selective_scan_forward"), std::string::npos) << e.what();
      EXPECT_NE(TypeOf(e).find("CudaError"), std::string::npos) << TypeOf(e);
    }
  }
  // A value head dim past the gated delta backward's limit, before anything runs (null tensors are never read).
  try {
    ops.gated_delta_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 1, 1, 8, 2000,
                             nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "gated_delta_backward with dv = 2000 did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("gated_delta_backward"), std::string::npos) << e.what();
    EXPECT_NE(TypeOf(e).find("CudaError"), std::string::npos) << TypeOf(e);
  }
  // A head_dim past the SSD backward's limit, before anything runs.
  try {
    ops.ssd_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 1, 2000,
                     1, 16, 0, 1, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "ssd_backward with head_dim = 2000 did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("ssd_backward"), std::string::npos) << e.what();
    EXPECT_NE(TypeOf(e).find("CudaError"), std::string::npos) << TypeOf(e);
  }
  // More experts per token than experts, before anything runs.
  try {
    ops.moe_route(nullptr, 4, 4, 5, true, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "moe_route with k = 5 of 4 experts did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("moe_route: k = 5"), std::string::npos) << e.what();
    EXPECT_NE(TypeOf(e).find("CudaError"), std::string::npos) << TypeOf(e);
  }
  // A head_dim past the attention kernels' limit (an exception naming the op; any std::exception is a status to
  // the engine's CatchStrategyErrors).
  {
    AttentionShape s;
    s.n = 1;
    s.heads = 1;
    s.kv_heads = 1;
    s.head_dim = 4096;
    s.scale = 1.0 / 64;
    const std::vector<int32_t> table = {0};
    Buf<float> q(Device::kCUDA, 4096, 0.1f, "q"), kv(Device::kCUDA, 4096, 0.1f, "kv"), out(Device::kCUDA, 4096, 0.0f, "out"),
        lse(Device::kCUDA, 1, 0.0f, "lse"), ws(Device::kCUDA, 64, 0.0f, "ws");
    // One one-token page holding both K and V.
    auto one_page = [&](auto* pool) {
      PagedKV<std::remove_pointer_t<decltype(pool)>> view;
      view.k_pool = pool;
      view.v_pool = pool;
      view.page_table = table.data();
      view.page_size = 1;
      view.page_stride = 4096;
      view.kv_heads = 1;
      view.head_dim = 4096;
      return view;
    };
    try {
      ops.attention_forward(s, q.data(), one_page(kv.data()), out.data(), lse.data(), ws.data());
      ADD_FAILURE() << "attention_forward with head_dim 4096 did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("attention_forward"), std::string::npos) << e.what();
    }
    // The tensor-core kernels over bf16 pages have the same limit.
    Buf<uint16_t> kv16(Device::kCUDA, 4096, F32ToBF16(0.1f), "kv bf16");
    try {
      ops.attention_forward_bf16(s, q.data(), one_page(kv16.data()), out.data(), lse.data(), ws.data());
      ADD_FAILURE() << "attention_forward_bf16 with head_dim 4096 did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("attention_forward_bf16"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("256"), std::string::npos) << e.what();
    }
    s.key_begin = 1;  // a document starting after its queries (pos0 = 0): refused naming key_begin
    try {
      ops.attention_forward(s, q.data(), one_page(kv.data()), out.data(), lse.data(), ws.data());
      ADD_FAILURE() << "attention_forward with key_begin > pos0 did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("key_begin 1"), std::string::npos) << e.what();
    }
  }
  // gemm_mixed over a type it does not take.
  try {
    ops.gemm_mixed(false, false, 2, 2, 2, 1.0f, DType::kF64, a.data(), 2, DType::kBF16, b.data(), 2, 0.0f,
                   DType::kF32, c.data(), 2);
    ADD_FAILURE() << "gemm_mixed with an f64 A did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm_mixed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
  // Still usable: a small GEMM after the failures.
  std::vector<float> av = {1, 2, 3, 4}, bv = {5, 6, 7, 8};
  Buf<float> A(Device::kCUDA, av, "A"), B(Device::kCUDA, bv, "B"), C(Device::kCUDA, 4, Nan<float>(), "C");
  ops.gemm(false, false, 2, 2, 2, 1.0f, A.data(), 2, B.data(), 2, 0.0f, C.data(), 2);
  EXPECT_EQ(C.Raw(), (std::vector<float>{19, 22, 43, 50}));
}

// ---------------------------------------------------------------------------------------------------------------
// Fused layer ops (one pass where the unfused sequence takes several)

// RoPE into the K/V page write: pages as the CPU writes them, through a reversed page table with one page absent
// (its pool page keeps its sentinel) and a chunk that starts mid-page. KV: the page element type (T or bf16).
template <typename T, typename KV, typename Write>
std::pair<Outs, Outs> RopeKvWriteBoth(int64_t n, int64_t pos0, int64_t page_size, int64_t kv_heads, int64_t hd,
                                      KV sentinel, Write write) {
  const int64_t row = kv_heads * hd, pages = (pos0 + n + page_size - 1) / page_size;
  std::vector<int32_t> table(pages);
  for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(pages - i);  // pool page 0 unused
  table[pages / 2] = -1;
  std::vector<double> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(10000.0, -2.0 * i / hd);
  const std::vector<T> k = Rand<T>(n * row, 60 + hd), v = Rand<T>(n * row, 61 + hd);
  return RunBoth([&](Device dev) {
    Buf<T> K(dev, k, "k"), V(dev, v, "v");
    Buf<KV> kp(dev, (pages + 1) * page_size * row, sentinel, "K pages"), vp(dev, (pages + 1) * page_size * row,
                                                                            sentinel, "V pages");
    PagedKV<KV> view;
    view.k_pool = kp.data();
    view.v_pool = vp.data();
    view.page_table = table.data();
    view.page_size = page_size;
    view.page_stride = page_size * row;
    view.kv_heads = kv_heads;
    view.head_dim = hd;
    write(OpsFor<T>(dev), K.data(), V.data(), n, pos0, inv_freq.data(), view);
    EXPECT_EQ(K.Raw(), k);  // only read
    EXPECT_EQ(V.Raw(), v);
    Outs o;
    o.Add(kp);
    o.Add(vp);
    return o;
  });
}

struct RopeKvShape {
  int64_t n, pos0, page_size, kv_heads, hd;
};
const RopeKvShape kRopeKvShapes[] = {{9, 3, 4, 2, 8}, {300, 37, 64, 2, 64}, {5, 0, 16, 1, 128}, {1, 1000, 8, 3, 2}};

TYPED_TEST(CudaOpsTest, RopeKvWrite) {
  using T = TypeParam;
  for (const RopeKvShape& s : kRopeKvShapes) {
    auto [dut, cpu] = RopeKvWriteBoth<T, T>(s.n, s.pos0, s.page_size, s.kv_heads, s.hd, T(7),
                                            [](const OpTable<T>& ops, auto... args) { ops.rope_kv_write(args...); });
    ExpectAllClose(dut, cpu, kTight<T>, "rope_kv_write n=" + std::to_string(s.n) + " hd=" + std::to_string(s.hd));
  }
}

// A bf16 output against the CPU's: equal, or (where the device's exp, sum order or FMA contraction moved the f32
// value across a rounding boundary) one bf16 step apart.
void ExpectBf16Near(const std::vector<uint16_t>& dut, const std::vector<uint16_t>& cpu, const std::string& what) {
  ASSERT_EQ(dut.size(), cpu.size()) << what;
  int64_t bad = 0, off_by_one = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (dut[i] == cpu[i]) continue;
    const float a = BF16ToF32(dut[i]), b = BF16ToF32(cpu[i]);
    if (std::abs(a - b) <= std::abs(b) / 128) ++off_by_one;
    else if (bad++ == 0) ADD_FAILURE() << what << ": element " << i << " cuda " << a << ", cpu " << b;
  }
  EXPECT_EQ(bad, 0) << what;
  EXPECT_LE(off_by_one, static_cast<int64_t>(cpu.size()) / 100 + 1) << what << ": bf16 values one step apart";
}
// The bf16 bits of values that are bf16 values (as Outs holds them).
std::vector<uint16_t> Bits(const std::vector<double>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = F32ToBF16(static_cast<float>(values[i]));
    if (std::isnan(values[i])) continue;  // the sentinel of pool pages nobody writes
    EXPECT_EQ(BF16ToF32(bits[i]), values[i]) << "not a bf16 value: element " << i;
  }
  return bits;
}

TEST_F(GpuTest, Bf16FusedOpsMatchCpu) {
  for (const RopeKvShape& s : kRopeKvShapes) {
    const std::string what = "rope_kv_write_bf16 n=" + std::to_string(s.n) + " hd=" + std::to_string(s.hd);
    auto [dut, cpu] = RopeKvWriteBoth<float, uint16_t>(
        s.n, s.pos0, s.page_size, s.kv_heads, s.hd, uint16_t{0x7fc1},
        [](const OpTable<float>& ops, auto... args) { ops.rope_kv_write_bf16(args...); });
    ExpectBf16Near(Bits(dut.v[0].second), Bits(cpu.v[0].second), what + " K");
    ExpectAllEqual(Outs{{dut.v[1]}}, Outs{{cpu.v[1]}}, what + " V");  // one rounding: exact
  }
  // rmsnorm_forward_bf16, with and without the kept copy.
  for (auto [n, d] : {std::pair<int64_t, int64_t>{13, 7}, {300, 257}, {3, 2048}}) {
    const std::vector<float> x = Rand<float>(n * d, 70 + d, -2, 2), w = Rand<float>(d, 71 + d, 0.5, 1.5);
    for (bool keep : {true, false}) {
      const std::string what = "rmsnorm_forward_bf16 n=" + std::to_string(n) + " d=" + std::to_string(d) +
                               (keep ? "" : " (no half)");
      auto [dut, cpu] = RunBoth([&](Device dev) {
        Buf<float> X(dev, x, "x"), W(dev, w, "w"), Y(dev, n * d, Nan<float>(), "y"), R(dev, n, Nan<float>(), "rstd");
        Buf<uint16_t> H(dev, n * d, uint16_t{0x7fc1}, "half");
        OpsFor<float>(dev).rmsnorm_forward_bf16(X.data(), W.data(), n, d, 1e-5, Y.data(), R.data(),
                                                keep ? H.data() : nullptr);
        Outs o;
        o.Add(Y);
        o.Add(H);
        o.Add(R);
        return o;
      });
      ExpectBf16Near(Bits(dut.v[0].second), Bits(cpu.v[0].second), what + " y");
      if (keep) {
        EXPECT_EQ(dut.v[0].second, dut.v[1].second) << what << ": half holds y's values";
      }
      else ExpectAllEqual(Outs{{dut.v[1]}}, Outs{{cpu.v[1]}}, what + ": half untouched");
      ExpectClose(dut.v[2].second, cpu.v[2].second, kTight<float>, what + " rstd");
    }
  }
  // swiglu_forward_bf16 (with and without the kept copies) and swiglu_backward_bf16 over the kept gate and up.
  for (int64_t count : {1, 1000, 4097}) {
    std::vector<float> g = Rand<float>(count, 80 + count, -12, 12), u = Rand<float>(count, 81 + count, -3, 3);
    const std::vector<float> dout = Rand<float>(count, 82 + count);
    if (count > 4) g[0] = 30, g[1] = -30, g[2] = 0;
    for (bool keep : {true, false}) {
      const std::string what = "swiglu bf16 count=" + std::to_string(count) + (keep ? "" : " (no halves)");
      auto [dut, cpu] = RunBoth([&](Device dev) {
        const OpTable<float>& ops = OpsFor<float>(dev);
        Buf<float> G(dev, g, "gate"), U(dev, u, "up"), O(dev, count, Nan<float>(), "out"), DO(dev, dout, "dout"),
            DG(dev, count, Nan<float>(), "dgate"), DU(dev, count, Nan<float>(), "dup");
        Buf<uint16_t> GH(dev, count, uint16_t{0x7fc1}, "gate half"), UH(dev, count, uint16_t{0x7fc1}, "up half"),
            OH(dev, count, uint16_t{0x7fc1}, "out half");
        ops.swiglu_forward_bf16(G.data(), U.data(), count, O.data(), keep ? GH.data() : nullptr,
                                keep ? UH.data() : nullptr, keep ? OH.data() : nullptr);
        Outs o;
        o.Add(O);
        o.Add(GH);
        o.Add(UH);
        o.Add(OH);
        if (keep) {
          ops.swiglu_backward_bf16(DO.data(), GH.data(), UH.data(), count, DG.data(), DU.data());
          o.Add(DG);
          o.Add(DU);
        }
        EXPECT_EQ(G.Raw(), g) << "gate is only read";
        return o;
      });
      ExpectBf16Near(Bits(dut.v[0].second), Bits(cpu.v[0].second), what + " out");
      ExpectAllEqual(Outs{{dut.v[1], dut.v[2]}}, Outs{{cpu.v[1], cpu.v[2]}}, what + " gate/up halves");
      if (keep) {
        EXPECT_EQ(dut.v[0].second, dut.v[3].second) << what << ": out half holds out's values";
        ExpectClose(dut.v[4].second, cpu.v[4].second, kTight<float>, what + " dgate");
        ExpectClose(dut.v[5].second, cpu.v[5].second, kTight<float>, what + " dup");
      } else {
        ExpectAllEqual(Outs{{dut.v[3]}}, Outs{{cpu.v[3]}}, what + ": out half untouched");
      }
    }
  }
}

}  // namespace
}  // namespace sg
