// Fills the backend table with the CPU kernels.
#include <type_traits>

#include "kernels/cpu/cpu_ops.h"

namespace sg {

template <typename T>
static OpTable<T> MakeCpuTable() {
  OpTable<T> t;
  t.gemm = cpu::Gemm<T>;
  t.embedding_forward = cpu::EmbeddingForward<T>;
  t.embedding_backward = cpu::EmbeddingBackward<T>;
  t.rmsnorm_forward = cpu::RmsNormForward<T>;
  t.rmsnorm_backward = cpu::RmsNormBackward<T>;
  t.rope = cpu::Rope<T>;
  t.add_bias = cpu::AddBias<T>;
  t.bias_backward = cpu::BiasBackward<T>;
  t.swiglu_forward = cpu::SwigluForward<T>;
  t.swiglu_backward = cpu::SwigluBackward<T>;
  t.add_inplace = cpu::AddInplace<T>;
  t.copy = cpu::Copy<T>;
  t.fill = cpu::Fill<T>;
  t.scale = cpu::Scale<T>;
  t.attention_forward = cpu::AttentionForward<T>;
  t.attention_backward = cpu::AttentionBackward<T>;
  t.attention_workspace_elems = cpu::AttentionWorkspaceElems;
  t.cross_entropy_forward_backward = cpu::CrossEntropyForwardBackward<T>;
  t.token_logprobs = cpu::TokenLogprobs<T>;
  t.token_argmax = cpu::TokenArgmax<T>;
  t.conv1d_forward = cpu::Conv1dForward<T>;
  t.conv1d_backward = cpu::Conv1dBackward<T>;
  t.selective_scan_forward = cpu::SelectiveScanForward<T>;
  t.selective_scan_backward = cpu::SelectiveScanBackward<T>;
  t.selective_scan_backward_pairs = cpu::SelectiveScanBackwardPairs<T>;
  t.silu_forward = cpu::SiluForward<T>;
  t.silu_backward = cpu::SiluBackward<T>;
  t.softplus_forward = cpu::SoftplusForward<T>;
  t.softplus_backward = cpu::SoftplusBackward<T>;
  t.adamw = cpu::AdamW<T>;
  if constexpr (std::is_same_v<T, float>) {
    t.gemm_mixed = cpu::GemmMixed;
    t.bf16_to_f32 = cpu::BF16ToF32Row;
    t.f32_to_bf16 = cpu::F32ToBF16Row;
    t.cross_entropy_bf16 = cpu::CrossEntropyForwardBackwardBF16;
    t.token_logprobs_bf16 = cpu::TokenLogprobsBF16;
    t.token_argmax_bf16 = cpu::TokenArgmaxBF16;
    t.attention_forward_bf16 = cpu::AttentionForward<float, uint16_t>;
    t.attention_backward_bf16 = cpu::AttentionBackward<float, uint16_t>;
    t.adamw_bf16 = cpu::AdamWBF16;
  }
  return t;
}

template <typename T>
const OpTable<T>& CpuOps() {
  static const OpTable<T> table = MakeCpuTable<T>();
  return table;
}

template const OpTable<float>& CpuOps<float>();
template const OpTable<double>& CpuOps<double>();

}  // namespace sg
