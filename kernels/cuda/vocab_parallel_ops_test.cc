// The tensor-parallel block of the CUDA op table (kernels/cuda/vocab_parallel.cu) against the CPU table's
// (kernels/cpu/vocab_parallel.cc): a vocabulary shard's embedding rows and their gradient, and the per-row maximum
// (with ties, NaN and all -inf rows), sums and gradient of a logits chunk whose labels fall inside the shard,
// outside it or are ignored; f32, f64 and bf16 logits. On the emulated backend (default build) and on a GPU
// (--config=cuda; skips without one).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "kernels/backend.h"
#include "kernels/cuda/ops_test_support.h"

namespace sg {
namespace {

using namespace ops_test;  // NOLINT: the shared harness

// S: the logits' storage (T, or bf16 bits for T = float).
template <typename S>
struct Shard {
  using T = std::conditional_t<std::is_same_v<S, uint16_t>, float, S>;
  static constexpr int64_t kRows = 7, kVocab = 1100, kV0 = 1100;  // the second shard of a vocabulary of 3300
  std::vector<int32_t> labels = {1100 + 3, -100, 1100 + 1099, 5, 1100 + 7, 3000, 1100 + 500};
  std::vector<S> logits;
  Shard() {
    const std::vector<double> x = Normal<double>(kRows * kVocab, 11, 3.0);
    for (double v : x) logits.push_back(Store(v));
    logits[2 * kVocab + 17] = logits[2 * kVocab + 900] = Store(40.0);  // a tie: the first column wins
    logits[3 * kVocab + 0] = logits[3 * kVocab + 5] = Nan<S>();        // NaN never wins
    for (int64_t v = 0; v < kVocab; ++v) logits[5 * kVocab + v] = Store(-INFINITY);  // nothing beats -inf
  }
  static S Store(double v) {
    if constexpr (std::is_same_v<S, uint16_t>) return F32ToBF16(static_cast<float>(v));
    else return static_cast<S>(v);
  }
  static const OpTable<T>& Ops(Device d) { return OpsFor<T>(d); }
  static auto Max(Device d) {
    if constexpr (std::is_same_v<S, uint16_t>) return Ops(d).vocab_shard_max_bf16;
    else return Ops(d).vocab_shard_max;
  }
  static auto Sums(Device d) {
    if constexpr (std::is_same_v<S, uint16_t>) return Ops(d).vocab_shard_sums_bf16;
    else return Ops(d).vocab_shard_sums;
  }
  static auto Gradient(Device d) {
    if constexpr (std::is_same_v<S, uint16_t>) return Ops(d).vocab_shard_gradient_bf16;
    else return Ops(d).vocab_shard_gradient;
  }
  // Row maxima and argmax, sums given the maxima of a whole vocabulary (here: this shard's, raised on two rows as
  // if another shard held a larger logit), and the chunk's gradient.
  Outs Run(Device d) const {
    Outs o;
    Buf<S> x(d, logits, "logits");
    HostBuf<double> row_max(kRows, 0, "row_max");
    HostBuf<int64_t> argmax(kRows, 0, "argmax");
    Max(d)(x.data(), labels.data(), kRows, kVocab, kV0, row_max.data(), argmax.data());
    std::vector<double> max = row_max.Raw(), ids;
    for (int64_t id : argmax.Raw()) ids.push_back(static_cast<double>(id));
    o.Add("row_max", max);
    o.Add("argmax", ids);
    max[0] += 2.5, max[4] += 0.5;
    max[5] = 1;  // row 5 (all -inf here) as if another shard held its maximum
    HostBuf<double> sums(2 * kRows, 0, "sums");
    Sums(d)(x.data(), labels.data(), kRows, kVocab, kV0, max.data(), sums.data());
    std::vector<double> s = sums.Raw();
    o.Add("sums", s);
    std::vector<double> row_sum(s.begin(), s.begin() + kRows), scale = {1.0, 2.0, -0.5, 3.0, 0.25, 1.0, 1.5};
    for (double& v : row_sum) v = v > 0 ? v * 1.25 : 1.0;  // the group's sum: larger than the shard's
    Gradient(d)(x.data(), labels.data(), kRows, kVocab, kV0, max.data(), row_sum.data(), scale.data(), 0.125);
    o.Add(x);
    return o;
  }
};

template <typename S>
class VocabParallelOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = DeviceUnavailableReason(Device::kCUDA); !why.empty()) GTEST_SKIP() << why;
  }
};
using Storage = ::testing::Types<float, double, uint16_t>;
TYPED_TEST_SUITE(VocabParallelOps, Storage);

TYPED_TEST(VocabParallelOps, CrossEntropyRows) {
  const Shard<TypeParam> shard;
  const Outs cuda = shard.Run(Device::kCUDA), cpu = shard.Run(Device::kCPU);
  // The maxima, arg maxima and label logits are values of the chunk: equal. Sums and exponentials: in double on
  // both sides, in another order / another exp.
  ExpectAllEqual(Outs{{cuda.v[0], cuda.v[1]}}, Outs{{cpu.v[0], cpu.v[1]}}, "vocab_shard_max");
  EXPECT_EQ(cpu.v[1].second[2], 1100 + 17) << "a tie: the first column";
  EXPECT_EQ(cpu.v[1].second[1], -1) << "no label";
  EXPECT_EQ(cpu.v[1].second[5], -1) << "nothing beats -inf";
  EXPECT_EQ(cuda.v[2].second.size(), cpu.v[2].second.size());
  ExpectClose(cuda.v[2].second, cpu.v[2].second, 1e-13, "vocab_shard_sums");
  ExpectClose(cuda.v[3].second, cpu.v[3].second, std::is_same_v<TypeParam, double> ? 1e-13 : 1e-6,
              "vocab_shard_gradient");
}

template <typename T>
class EmbeddingShardOps : public VocabParallelOps<T> {};
using Compute = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EmbeddingShardOps, Compute);

TYPED_TEST(EmbeddingShardOps, ForwardBackward) {
  using T = TypeParam;
  constexpr int64_t rows = 40, v0 = 40, d = 33, n = 23;  // the second of three shards
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((i * 37 + 5) % 120));
  ids[3] = ids[9] = ids[17] = 41;  // one row, three tokens: added in token order
  const std::vector<T> table = Rand<T>(rows * d, 3), dout = Rand<T>(n * d, 4);
  std::vector<uint16_t> table16;
  for (T v : table) table16.push_back(F32ToBF16(static_cast<float>(v)));
  auto run = [&](Device dev) {
    Outs o;
    const OpTable<T>& ops = OpsFor<T>(dev);
    Buf<T> w(dev, table, "table"), out(dev, n * d, Nan<T>(), "out"), g(dev, table, "dtable"), dy(dev, dout, "dout");
    ops.embedding_shard_forward(ids.data(), n, w.data(), rows, v0, d, out.data());
    ops.embedding_shard_backward(ids.data(), n, dy.data(), rows, v0, d, g.data());
    o.Add(out);
    o.Add(g);
    if constexpr (std::is_same_v<T, float>) {
      Buf<uint16_t> w16(dev, table16, "table (bf16)");
      Buf<float> out16(dev, n * d, Nan<float>(), "out (bf16 table)");
      ops.embedding_shard_forward_bf16(ids.data(), n, w16.data(), rows, v0, d, out16.data());
      o.Add(out16);
    }
    return o;
  };
  const Outs cuda = run(Device::kCUDA), cpu = run(Device::kCPU);
  ExpectAllEqual(cuda, cpu, "embedding_shard");
  int64_t zero_rows = 0;  // the other shards' tokens
  for (int64_t i = 0; i < n; ++i) zero_rows += ids[i] < v0 || ids[i] >= v0 + rows;
  EXPECT_GT(zero_rows, 0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < v0 || ids[i] >= v0 + rows) {
      EXPECT_EQ(cpu.v[0].second[i * d], 0.0) << "token " << i;
    }
}

}  // namespace
}  // namespace sg
