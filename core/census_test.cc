#include "core/census.h"

#include <gtest/gtest.h>

#include <string_view>
#include <vector>

#include "core/models/transformer/transformer.h"
#include "core/plan.h"
#include "kernels/backend.h"

namespace sg {
namespace {

// tiny: vocab 97, d 32, 3 layers, 4 heads of 8, 2 KV heads, ffn 48, untied head.
constexpr int64_t kT = 40, kChunk = 16, kLast = kT - 2 * kChunk;  // chunks 16, 16, 8

StrategyOptions Strategy(const std::string& name) {
  StrategyOptions s;
  s.name = name;
  s.chunk = kChunk;
  s.page_size = 8;
  s.lm_chunk = 16;
  return s;
}

StepCensus Census(const std::string& strategy, DType dtype, Device device = Device::kMeta, bool keep = false) {
  absl::StatusOr<StepCensus> c = CensusOfStep("tiny", dtype, Strategy(strategy), kT, device, {}, keep);
  if (!c.ok()) ADD_FAILURE() << c.status();
  return c.ok() ? *std::move(c) : StepCensus();
}

struct Shape {
  int64_t L, d, H, G, hd, f, V;
  int64_t Kv() const { return 2 * d * G * hd; }                        // k and v projection parameters of a layer
  int64_t Layer() const { return Kv() + 2 * d * H * hd + 3 * d * f; }  // q, o, gate, up, down added
  int64_t Rest() const { return Layer() - Kv(); }
};
Shape Tiny() {
  const TransformerConfig c = *TransformerPreset("tiny");
  return {c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size};
}
int64_t Pairs(int64_t t) { return t * (t + 1) / 2; }  // causal (query, key) pairs of t tokens

// GEMM FLOPs by hand: 2 per parameter and token forward, 4 backward (dX and dW), plus what each strategy recomputes.
TEST(Census, GemmFlopsMatchTheFormulas) {
  const Shape s = Tiny();
  const int64_t head = 6 * s.V * s.d * kT;
  const int64_t full = 6 * s.L * s.Layer() * kT + head;
  // seco: stage 1 runs chunks but the last through every layer but the top one (whose K/V it only projects);
  // stage 2 recomputes every chunk with K/V already cached (the last chunk's projected there for the first time).
  const int64_t seco = s.L * (2 * s.Kv() * kT + 4 * s.Layer() * kT) + (s.L - 1) * 2 * s.Rest() * (2 * kT - kLast) +
                       2 * s.Rest() * kT + head;
  // streambp: layers but the top forward once; every layer in backward: K/V of the whole sequence, the partitions
  // recomputed, backprop.
  const int64_t streambp = (s.L - 1) * 2 * s.Layer() * kT + s.L * 6 * s.Layer() * kT + head;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    EXPECT_EQ(Census("full", dtype).ops.family(OpFamily::kGemm).flops, full);
    EXPECT_EQ(Census("seco", dtype).ops.family(OpFamily::kGemm).flops, seco);
    EXPECT_EQ(Census("streambp", dtype).ops.family(OpFamily::kGemm).flops, streambp);
  }
}

TEST(Census, AttentionFlopsMatchTheCausalFormula) {
  const Shape s = Tiny();
  const int64_t per_pair = 2 * s.hd * s.H;  // one product over one (query, key) pair, every head
  struct Case {
    std::string strategy;
    int64_t forward_pairs;  // over all layers
  };
  const std::vector<Case> cases = {
      {"full", s.L * Pairs(kT)},
      // stage 1: every layer but the top over the tokens before the last chunk; stage 2: all of them again
      {"seco", (s.L - 1) * Pairs(kT - kLast) + s.L * Pairs(kT)},
      {"streambp", (s.L - 1) * Pairs(kT) + s.L * Pairs(kT)},
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.strategy + " " + DTypeName(dtype));
      const StepCensus census = Census(c.strategy, dtype);
      EXPECT_EQ(census.ops.family(OpFamily::kAttentionForward).flops, 2 * per_pair * c.forward_pairs);
      // backward: dQ pass (3 products) and dK/dV pass (4) over every pair once
      EXPECT_EQ(census.ops.family(OpFamily::kAttentionBackward).flops, 7 * per_pair * s.L * Pairs(kT));
    }
  }
}

// Model FLOPs from the parameters the model holds (every matrix but the embedding lookup), not from its config.
TEST(Census, ModelFlopsCountEveryMatmulParameter) {
  const Shape s = Tiny();
  const StepCensus census = Census("seco", DType::kF32);
  absl::StatusOr<std::unique_ptr<Model>> model = CreatePlanModel("tiny", DType::kF32, Device::kMeta, {}, 1);
  ASSERT_TRUE(model.ok());
  int64_t matmul = 0;
  for (const Param& p : (*model)->params())
    if (p.value.shape().size() == 2 && p.name.find("embed_tokens") == std::string::npos) matmul += p.value.numel();
  EXPECT_EQ(census.model_flops, 6 * matmul * kT + 12 * s.hd * s.H * s.L * Pairs(kT));
  EXPECT_GT(census.MfuBound(), 0);
  EXPECT_LT(census.MfuBound(), 1);
}

// The CPU (and, linked into census_emulated_cuda_test, the emulated CUDA backend) executes the step, meta does
// not: the records, one by one, are the same.
TEST(Census, ExecutingAndMetaGiveIdenticalRecords) {
  std::vector<Device> executing = {Device::kCPU};
#ifdef SG_CENSUS_ON_CUDA
  ASSERT_EQ(DeviceUnavailableReason(Device::kCUDA), "");
  executing.push_back(Device::kCUDA);
#endif
  for (Device device : executing) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (const std::string strategy : {"full", "seco", "streambp"}) {
        SCOPED_TRACE(strategy + " " + DTypeName(dtype) + " on " + (device == Device::kCPU ? "cpu" : "cuda"));
        const StepCensus run = Census(strategy, dtype, device, /*keep=*/true);
        const StepCensus meta = Census(strategy, dtype, Device::kMeta, /*keep=*/true);
        // A device clips on the device (core/optimizer.cc): the gradient norm as 1x1 GEMM dot products and the
        // rescale as `scale` ops, where the CPU and meta loop on the host. Those records are the device's own; every
        // other record equals meta's, in order.
        const std::vector<OpRecord>& executed = run.ops.records();
        const std::vector<OpRecord>& planned = meta.ops.records();
        ASSERT_GT(executed.size(), 100u);
        size_t j = 0;
        int64_t clipping = 0;
        for (size_t i = 0; i < executed.size(); ++i) {
          const OpRecord& r = executed[i];
          if (j < planned.size() && r == planned[j]) {
            ++j;
            continue;
          }
          const bool norm_dot = std::string_view(r.op) == "gemm" &&
                                r.bytes_written == static_cast<int64_t>(sizeof(float)) &&
                                r.flops * static_cast<int64_t>(sizeof(float)) == r.bytes_read;
          ASSERT_TRUE(device != Device::kCPU && (norm_dot || std::string_view(r.op) == "scale"))
              << "record " << i << ": " << r.op << " is not meta's record " << j << ": "
              << (j < planned.size() ? planned[j].op : "(none left)");
          ++clipping;
        }
        EXPECT_EQ(j, planned.size()) << "meta's records past " << j << " were not executed";
        if (device != Device::kCPU) {
          EXPECT_GT(clipping, 0);
        }
        EXPECT_GT(meta.ops.family(OpFamily::kOptimizer).calls, 0);
        if (dtype == DType::kBF16) {
          EXPECT_GT(meta.ops.family(OpFamily::kBf16Round).bytes, 0);
        }
      }
    }
  }
}

TEST(Census, CausalPairsAgainstBruteForce) {
  for (int64_t pos0 : {0, 3, 8, 21}) {
    for (int64_t n : {1, 5, 8, 19}) {
      for (int64_t ps : {1, 4, 8}) {
        for (int64_t key_begin : {int64_t{0}, pos0 / 2, pos0}) {  // packed documents: keys from key_begin
          AttentionShape s;
          s.n = n;
          s.pos0 = pos0;
          s.key_begin = key_begin;
          auto keep = [](int64_t p) { return p % 3 != 1; };
          int64_t brute = 0;
          for (int64_t q = pos0; q < pos0 + n; ++q)
            for (int64_t k = key_begin; k <= q; ++k) brute += keep(k / ps);
          EXPECT_EQ(CausalPairs(s, ps, keep), brute) << pos0 << " " << n << " " << ps << " " << key_begin;
        }
      }
    }
  }
}

// Single calls through the decorator on meta: a GEMM, a mixed GEMM's rounding pass, attention with a page mask
// and a gradient page left out, by hand.
TEST(Census, OneCallRecords) {
  OpCensus census({/*peak_flops=*/1e12, /*bandwidth=*/1e9}, /*keep_records=*/true);
  {
    CensusScope scope(Device::kMeta, &census);
    EXPECT_THROW(CensusScope(Device::kMeta, &census), std::logic_error);
    const OpTable<float>& ops = OpsFor<float>(Device::kMeta);
    ops.gemm(false, true, 3, 5, 7, 1.0f, nullptr, 7, nullptr, 7, 1.0f, nullptr, 5);
    ops.gemm_mixed(false, true, 3, 5, 7, 1.0f, DType::kF32, nullptr, 7, DType::kBF16, nullptr, 7, 0.0f, DType::kBF16,
                   nullptr, 5);
    // 6 queries at positions 10..15 over pages of 4 (keys 0..15: pages 0..3), page 1 unselected; in backward
    // page 2 has no gradient page.
    AttentionShape s{/*n=*/6, /*pos0=*/10, /*heads=*/4, /*kv_heads=*/2, /*head_dim=*/8, 0.35};
    const int32_t table[4] = {0, 1, 2, 3}, grad_table[4] = {0, 1, -1, 3};
    const uint8_t mask[4] = {1, 0, 1, 1};
    PagedKV<uint16_t> kv{nullptr, nullptr, table, 4, 64, 2, 8, mask};
    PagedKV<uint16_t> dkv{nullptr, nullptr, grad_table, 4, 64, 2, 8, mask};
    ops.attention_forward_bf16(s, nullptr, kv, nullptr, nullptr, nullptr);
    ops.attention_backward_bf16(s, nullptr, kv, nullptr, nullptr, nullptr, nullptr, dkv, nullptr);
  }
  // the scope has ended: the meta table counts nothing any more
  OpsFor<float>(Device::kMeta).gemm(false, false, 2, 2, 2, 1.0f, nullptr, 2, nullptr, 2, 0.0f, nullptr, 2);
  const std::vector<OpRecord>& r = census.records();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0], (OpRecord{"gemm", OpFamily::kGemm, 2 * 3 * 5 * 7, (21 + 35 + 15) * 4, 15 * 4}));
  EXPECT_EQ(r[1], (OpRecord{"gemm_mixed", OpFamily::kBf16Round, 0, 21 * 4, 21 * 2}));
  EXPECT_EQ(r[2], (OpRecord{"gemm_mixed", OpFamily::kGemm, 2 * 3 * 5 * 7, (21 + 35) * 2, 15 * 2}));
  // selected keys seen: pages 0, 2, 3 = keys 0-3, 8-11, 12-15 (12 keys); pairs: queries 10..15 see keys 0-3 (4
  // each: 24), keys 8..11 (8,9: 6 each; 10: 6; 11: 5 -> 23), keys 12..15 (4+3+2+1 = 10): 57
  const int64_t pairs = 24 + 23 + 10, grad_pairs = 24 + 10, rows = 6 * 4 * 8, key_row = 2 * 8 * 2;
  EXPECT_EQ(r[3], (OpRecord{"attention_forward_bf16", OpFamily::kAttentionForward, 2 * 2 * 8 * 4 * pairs,
                            rows * 4 + 2 * 12 * key_row, (rows + 4 * 6) * 4}));
  EXPECT_EQ(r[4],
            (OpRecord{"attention_backward_bf16", OpFamily::kAttentionBackward, 2 * 8 * 4 * (3 * pairs + 4 * grad_pairs),
                      (3 * rows + 4 * 6) * 4 + 2 * 12 * key_row + 2 * 8 * key_row, rows * 4 + 2 * 8 * key_row}));
  // roofline: the GEMM at 1 TFLOP/s and 1 GB/s is memory-bound
  EXPECT_DOUBLE_EQ(census.family(OpFamily::kGemm).seconds, ((21 + 35 + 15) * 4 + 60 + (21 + 35) * 2 + 30) / 1e9);
  EXPECT_EQ(census.family(OpFamily::kGemm).compute_seconds, 0);
  EXPECT_EQ(census.Total().calls, 5);
}

// Gated DeltaNet's ops on meta, by hand: the delta rule's state products and compulsory bytes, its gates'; the
// workspace size is the CPU's (plans size the backward's checkpoints as a CPU run does).
TEST(Census, GatedDeltaRecords) {
  OpCensus census({/*peak_flops=*/1e12, /*bandwidth=*/1e9}, /*keep_records=*/true);
  {
    CensusScope scope(Device::kMeta, &census);
    const OpTable<double>& ops = OpsFor<double>(Device::kMeta);
    EXPECT_EQ(ops.gated_delta_workspace_elems(10, 4, 8, 16),
              CpuOps<double>().gated_delta_workspace_elems(10, 4, 8, 16));
    EXPECT_GE(ops.gated_delta_workspace_elems(10, 4, 8, 16), 4 * (4 + 1) * 8 * 16);  // checkpoints + a block's states
    // 10 tokens, 2 key heads, 4 value heads, dk 8, dv 16; a state in, none out, no state gradients
    const double state_in = 0;
    ops.gated_delta_forward(nullptr, nullptr, nullptr, nullptr, nullptr, &state_in, 10, 2, 4, 8, 16, nullptr, nullptr);
    ops.gated_delta_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &state_in, 10, 2, 4, 8, 16,
                             nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    ops.gdn_gates_forward(nullptr, nullptr, nullptr, nullptr, 10, 4, nullptr, nullptr);
  }
  const std::vector<OpRecord>& r = census.records();
  ASSERT_EQ(r.size(), 3u);
  const int64_t state = 4 * 8 * 16, qk = 10 * 2 * 8, values = 10 * 4 * 16, gates = 10 * 4;
  EXPECT_EQ(r[0], (OpRecord{"gated_delta_forward", OpFamily::kSsm, 3 * 2 * 10 * state,
                            (2 * qk + values + 2 * gates + state) * 8, values * 8}));
  EXPECT_EQ(r[1], (OpRecord{"gated_delta_backward", OpFamily::kSsm, 11 * 2 * 10 * state,
                            (2 * qk + 2 * values + 2 * gates + state) * 8, (2 * qk + values + 2 * gates) * 8}));
  EXPECT_EQ(r[2], (OpRecord{"gdn_gates_forward", OpFamily::kSsm, 0, (2 * gates + 2 * 4) * 8, 2 * gates * 8}));
}

// The mixture-of-experts ops on meta, by hand: the router (its backward with and without the load-balancing
// term), the row gathers, scatters (scaled or not) and dots.
TEST(Census, MoeRecords) {
  OpCensus census({/*peak_flops=*/1e12, /*bandwidth=*/1e9}, /*keep_records=*/true);
  {
    CensusScope scope(Device::kMeta, &census);
    const OpTable<float>& ops = OpsFor<float>(Device::kMeta);
    const float extra = 0;
    // 10 tokens, 8 experts, top 2; 6 rows of 16
    ops.moe_route(nullptr, 10, 8, 2, true, nullptr, nullptr, nullptr);
    ops.moe_route_backward(nullptr, nullptr, nullptr, 10, 8, 2, true, &extra, nullptr);
    ops.moe_route_backward(nullptr, nullptr, nullptr, 10, 8, 2, false, nullptr, nullptr);
    ops.gather_rows(nullptr, nullptr, 6, 16, nullptr);
    ops.scatter_add_rows(nullptr, nullptr, &extra, 6, 16, nullptr);
    ops.scatter_add_rows(nullptr, nullptr, nullptr, 6, 16, nullptr);
    ops.row_dots(nullptr, nullptr, 6, 16, nullptr);
  }
  const std::vector<OpRecord>& r = census.records();
  ASSERT_EQ(r.size(), 7u);
  const OpFamily f = OpFamily::kPointwise;
  const int64_t probs = 10 * 8 * 4, picks = 10 * 2 * (4 + 4), rows = 6 * 16 * 4;
  EXPECT_EQ(r[0], (OpRecord{"moe_route", f, 0, probs, probs + picks}));
  EXPECT_EQ(r[1], (OpRecord{"moe_route_backward", f, 0, probs + picks + 8 * 4, probs}));
  EXPECT_EQ(r[2], (OpRecord{"moe_route_backward", f, 0, probs + picks, probs}));
  EXPECT_EQ(r[3], (OpRecord{"gather_rows", f, 0, 6 * 4 + rows, rows}));
  EXPECT_EQ(r[4], (OpRecord{"scatter_add_rows", f, 0, 6 * 4 + 6 * 4 + 2 * rows, rows}));
  EXPECT_EQ(r[5], (OpRecord{"scatter_add_rows", f, 0, 6 * 4 + 2 * rows, rows}));
  EXPECT_EQ(r[6], (OpRecord{"row_dots", f, 0, 2 * rows, 6 * 4}));
}

// Mamba-2's ops on meta, by hand: the SSD scan's state products and compulsory bytes (its backward by pairs too), the
// gated norm's bytes; the workspace size is the CPU's.
TEST(Census, SsdRecords) {
  OpCensus census({/*peak_flops=*/1e12, /*bandwidth=*/1e9}, /*keep_records=*/true);
  {
    CensusScope scope(Device::kMeta, &census);
    const OpTable<double>& ops = OpsFor<double>(Device::kMeta);
    EXPECT_EQ(ops.ssd_workspace_elems(10, 4, 8, 2, 16), CpuOps<double>().ssd_workspace_elems(10, 4, 8, 2, 16));
    EXPECT_GE(ops.ssd_workspace_elems(10, 4, 8, 2, 16), 4 * (4 + 1) * 8 * 16);  // checkpoints + a block's states
    // 10 tokens, 4 heads of head_dim 8 in 2 groups, N 16; D and a state in, none out, no state gradients
    const double param = 0, state_in = 0;
    ops.ssd_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &param, &state_in, 10, 4, 8, 2, 16, 0, 1,
                    nullptr, nullptr);
    ops.ssd_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &param, &state_in, 10, 4,
                     8, 2, 16, 0, 1, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    // 3 later tokens, a window of 4: 4 pairs for each of the 10 tokens (the last window ends at token 13)
    ops.ssd_backward_pairs(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &param, &state_in, 10, 4, 8,
                           2, 16, 0, 1, nullptr, nullptr, nullptr, 3, 4, nullptr, nullptr, nullptr, nullptr, nullptr,
                           nullptr, nullptr, nullptr);
    ops.gated_group_rmsnorm_forward(nullptr, nullptr, nullptr, 10, 32, 8, 1e-6, nullptr, nullptr);
    ops.gated_group_rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 10, 32, 8, 1e-6, nullptr, nullptr,
                                     nullptr);
  }
  const std::vector<OpRecord>& r = census.records();
  ASSERT_EQ(r.size(), 5u);
  const int64_t state = 4 * 8 * 16, xs = 10 * 4 * 8, bc = 10 * 2 * 16, dts = 10 * 4, heads = 4;
  EXPECT_EQ(r[0], (OpRecord{"ssd_forward", OpFamily::kSsm, 2 * 2 * 10 * state,
                            (xs + dts + 2 * bc + 3 * heads + state) * 8, xs * 8}));
  EXPECT_EQ(r[1], (OpRecord{"ssd_backward", OpFamily::kSsm, 8 * 2 * 10 * state,
                            (2 * xs + dts + 2 * bc + 6 * heads + state) * 8, (xs + dts + 2 * bc + 3 * heads) * 8}));
  EXPECT_EQ(r[2], (OpRecord{"ssd_backward_pairs", OpFamily::kSsm, 2 * state * (10 * 4 + 7 * 10),
                            (2 * xs + dts + 2 * bc + 6 * heads + state + 3 * (32 + 4 + 32)) * 8,
                            (xs + dts + 2 * bc + 3 * heads) * 8}));
  EXPECT_EQ(r[3], (OpRecord{"gated_group_rmsnorm_forward", OpFamily::kNorm, 0, (2 * 320 + 32) * 8, (320 + 40) * 8}));
  EXPECT_EQ(r[4], (OpRecord{"gated_group_rmsnorm_backward", OpFamily::kNorm, 0, (3 * 320 + 2 * 32 + 40) * 8,
                            (2 * 320 + 32) * 8}));
}

}  // namespace
}  // namespace sg
