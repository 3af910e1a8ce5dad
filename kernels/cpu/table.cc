// Fills the backend table with the CPU kernels.
//
// SG_PROFILE_OPS=1 wraps every entry in a timer and prints, at exit, the wall time spent per op family (GEMM,
// attention forward/backward, norms, pointwise, loss, bf16 conversion, optimizer) to stderr: where a step's time
// goes. Kernels that call each other directly (attention's GEMMs) count under the caller.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/vocab_parallel.h"

namespace sg {
namespace {

enum OpFamily { kGemm, kAttentionForward, kAttentionBackward, kNorm, kPointwise, kLoss, kConvert, kSsm,
                kOptimizer, kNumFamilies };
constexpr const char* kFamilyNames[kNumFamilies] = {"gemm",      "attention_fwd", "attention_bwd",
                                                    "norm",      "pointwise",     "loss",
                                                    "bf16_convert", "ssm",       "optimizer"};

struct OpProfile {
  std::atomic<int64_t> ns[kNumFamilies] = {};
  std::atomic<int64_t> calls[kNumFamilies] = {};
  ~OpProfile() {
    int64_t total = 0;
    for (const auto& n : ns) total += n.load();
    if (total == 0) return;
    std::fprintf(stderr, "SG_PROFILE_OPS: wall time inside the CPU op table, by family\n");
    std::fprintf(stderr, "  %-14s %10s %6s %10s\n", "family", "seconds", "share", "calls");
    for (int f = 0; f < kNumFamilies; ++f) {
      if (calls[f] == 0) continue;
      std::fprintf(stderr, "  %-14s %10.3f %5.1f%% %10lld\n", kFamilyNames[f], ns[f] * 1e-9, 100.0 * ns[f] / total,
                   static_cast<long long>(calls[f].load()));
    }
    std::fprintf(stderr, "  %-14s %10.3f\n", "total", total * 1e-9);
  }
};

OpProfile& Profile() {
  static OpProfile p;
  return p;
}

bool ProfilingOps() {
  const char* v = std::getenv("SG_PROFILE_OPS");
  return v && *v && std::string_view(v) != "0";
}

// Timed<family, F>::Call has F's signature: it times the call into its family's total.
template <int Family, auto F> struct Timed;
template <int Family, typename R, typename... A, R (*F)(A...)>
struct Timed<Family, F> {
  static R Call(A... args) {
    struct Stop {
      std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
      ~Stop() {
        const auto dt = std::chrono::steady_clock::now() - t0;
        Profile().ns[Family] += std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count();
        Profile().calls[Family] += 1;
      }
    } stop;
    return F(args...);
  }
};

template <typename T>
OpTable<T> MakeCpuTable() {
  OpTable<T> t;
  const bool profile = ProfilingOps();
  if (profile) Profile();  // constructed before the first call, so destroyed (and printed) after the last
#define SG_ENTRY(field, family, fn) t.field = profile ? &Timed<family, fn>::Call : fn
  SG_ENTRY(gemm, kGemm, cpu::Gemm<T>);
  SG_ENTRY(embedding_forward, kPointwise, cpu::EmbeddingForward<T>);
  SG_ENTRY(embedding_backward, kPointwise, cpu::EmbeddingBackward<T>);
  SG_ENTRY(rmsnorm_forward, kNorm, cpu::RmsNormForward<T>);
  SG_ENTRY(rmsnorm_backward, kNorm, cpu::RmsNormBackward<T>);
  SG_ENTRY(rope, kPointwise, cpu::Rope<T>);
  SG_ENTRY(add_bias, kPointwise, cpu::AddBias<T>);
  SG_ENTRY(bias_backward, kPointwise, cpu::BiasBackward<T>);
  SG_ENTRY(swiglu_forward, kPointwise, cpu::SwigluForward<T>);
  SG_ENTRY(swiglu_backward, kPointwise, cpu::SwigluBackward<T>);
  SG_ENTRY(add_inplace, kPointwise, cpu::AddInplace<T>);
  SG_ENTRY(copy, kPointwise, cpu::Copy<T>);
  SG_ENTRY(fill, kPointwise, cpu::Fill<T>);
  SG_ENTRY(scale, kPointwise, cpu::Scale<T>);
  SG_ENTRY(rope_kv_write, kPointwise, (cpu::RopeKvWrite<T, T>));
  SG_ENTRY(attention_forward, kAttentionForward, (cpu::AttentionForward<T, T>));
  SG_ENTRY(attention_backward, kAttentionBackward, (cpu::AttentionBackward<T, T>));
  t.attention_workspace_elems = cpu::AttentionWorkspaceElems;
  SG_ENTRY(cross_entropy_forward_backward, kLoss, cpu::CrossEntropyForwardBackward<T>);
  SG_ENTRY(token_logprobs, kLoss, cpu::TokenLogprobs<T>);
  SG_ENTRY(token_argmax, kLoss, cpu::TokenArgmax<T>);
  SG_ENTRY(conv1d_forward, kSsm, cpu::Conv1dForward<T>);
  SG_ENTRY(conv1d_backward, kSsm, cpu::Conv1dBackward<T>);
  SG_ENTRY(selective_scan_forward, kSsm, cpu::SelectiveScanForward<T>);
  SG_ENTRY(selective_scan_backward, kSsm, cpu::SelectiveScanBackward<T>);
  SG_ENTRY(selective_scan_backward_pairs, kSsm, cpu::SelectiveScanBackwardPairs<T>);
  SG_ENTRY(silu_forward, kSsm, cpu::SiluForward<T>);
  SG_ENTRY(silu_backward, kSsm, cpu::SiluBackward<T>);
  SG_ENTRY(relu2_forward, kPointwise, cpu::Relu2Forward<T>);
  SG_ENTRY(relu2_backward, kPointwise, cpu::Relu2Backward<T>);
  SG_ENTRY(softplus_forward, kSsm, cpu::SoftplusForward<T>);
  SG_ENTRY(softplus_backward, kSsm, cpu::SoftplusBackward<T>);
  SG_ENTRY(copy_rows, kPointwise, cpu::CopyRows<T>);
  SG_ENTRY(sigmoid_gate_forward, kPointwise, cpu::SigmoidGateForward<T>);
  SG_ENTRY(sigmoid_gate_backward, kPointwise, cpu::SigmoidGateBackward<T>);
  SG_ENTRY(gdn_gates_forward, kSsm, cpu::GdnGatesForward<T>);
  SG_ENTRY(gdn_gates_backward, kSsm, cpu::GdnGatesBackward<T>);
  SG_ENTRY(gated_delta_forward, kSsm, cpu::GatedDeltaForward<T>);
  SG_ENTRY(gated_delta_backward, kSsm, cpu::GatedDeltaBackward<T>);
  t.gated_delta_workspace_elems = cpu::GatedDeltaWorkspaceElems;
  SG_ENTRY(ssd_forward, kSsm, cpu::SsdForward<T>);
  SG_ENTRY(ssd_backward, kSsm, cpu::SsdBackward<T>);
  SG_ENTRY(ssd_backward_pairs, kSsm, cpu::SsdBackwardPairs<T>);
  t.ssd_workspace_elems = cpu::SsdWorkspaceElems;
  SG_ENTRY(gated_group_rmsnorm_forward, kNorm, cpu::GatedGroupRmsnormForward<T>);
  SG_ENTRY(gated_group_rmsnorm_backward, kNorm, cpu::GatedGroupRmsnormBackward<T>);
  SG_ENTRY(moe_route, kPointwise, cpu::MoeRoute<T>);
  SG_ENTRY(moe_route_backward, kPointwise, cpu::MoeRouteBackward<T>);
  SG_ENTRY(gather_rows, kPointwise, cpu::GatherRows<T>);
  SG_ENTRY(scatter_add_rows, kPointwise, cpu::ScatterAddRows<T>);
  SG_ENTRY(row_dots, kPointwise, cpu::RowDots<T>);
  SG_ENTRY(adamw, kOptimizer, cpu::AdamW<T>);
  SG_ENTRY(lora_dropout, kPointwise, cpu::LoraDropout<T>);
  SG_ENTRY(ssm_neg_exp, kSsm, cpu::SsmNegExp<T>);
  SG_ENTRY(ssm_neg_exp_backward, kSsm, cpu::SsmNegExpBackward<T>);
  SG_ENTRY(column_sums_f64, kPointwise, cpu::ColumnSumsF64<T>);
  SG_ENTRY(page_scores, kPointwise, cpu::PageScores);
  if constexpr (std::is_same_v<T, float>) {
    SG_ENTRY(gemm_mixed, kGemm, cpu::GemmMixed);
    SG_ENTRY(bf16_to_f32, kConvert, cpu::BF16ToF32Row);
    SG_ENTRY(f32_to_bf16, kConvert, cpu::F32ToBF16Row);
    SG_ENTRY(cross_entropy_bf16, kLoss, cpu::CrossEntropyForwardBackwardBF16);
    SG_ENTRY(token_logprobs_bf16, kLoss, cpu::TokenLogprobsBF16);
    SG_ENTRY(token_argmax_bf16, kLoss, cpu::TokenArgmaxBF16);
    SG_ENTRY(attention_forward_bf16, kAttentionForward, (cpu::AttentionForward<float, uint16_t>));
    SG_ENTRY(attention_backward_bf16, kAttentionBackward, (cpu::AttentionBackward<float, uint16_t>));
    SG_ENTRY(adamw_bf16, kOptimizer, cpu::AdamWBF16);
    SG_ENTRY(round_bf16, kConvert, cpu::RoundBF16);
    SG_ENTRY(rope_kv_write_bf16, kPointwise, (cpu::RopeKvWrite<float, uint16_t>));
    SG_ENTRY(rmsnorm_forward_bf16, kNorm, cpu::RmsNormForwardBF16);
    SG_ENTRY(swiglu_forward_bf16, kPointwise, cpu::SwigluForwardBF16);
    SG_ENTRY(swiglu_backward_bf16, kPointwise, cpu::SwigluBackwardBF16);
  }
  SG_ENTRY(attention_merge, kAttentionForward, cpu::AttentionMerge<T>);
#undef SG_ENTRY
  cpu::AddVocabParallelOps(t);  // tensor parallelism (not profiled)
  return t;
}

}  // namespace

template <typename T>
const OpTable<T>& CpuOps() {
  static const OpTable<T> table = MakeCpuTable<T>();
  return table;
}

template const OpTable<float>& CpuOps<float>();
template const OpTable<double>& CpuOps<double>();

}  // namespace sg
