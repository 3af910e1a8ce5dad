// Fills the backend table with the CUDA kernels and registers the backend when the library is linked in.
#include <type_traits>

#include "kernels/cuda/cuda_ops.cuh"

namespace sg {
namespace cuda {
void RegisterRuntime(DeviceBackend& b);  // runtime.cu
template <typename T>
void AddVocabParallelOps(OpTable<T>& t);  // vocab_parallel.cu
}  // namespace cuda

template <typename T>
static OpTable<T> MakeCudaTable() {
  OpTable<T> t;
  t.gemm = cuda::Gemm<T>;
  t.embedding_forward = cuda::EmbeddingForward<T>;
  t.embedding_backward = cuda::EmbeddingBackward<T>;
  t.rmsnorm_forward = cuda::RmsNormForward<T>;
  t.rmsnorm_backward = cuda::RmsNormBackward<T>;
  t.rope = cuda::Rope<T>;
  t.add_bias = cuda::AddBias<T>;
  t.bias_backward = cuda::BiasBackward<T>;
  t.swiglu_forward = cuda::SwigluForward<T>;
  t.swiglu_backward = cuda::SwigluBackward<T>;
  t.add_inplace = cuda::AddInplace<T>;
  t.copy = cuda::Copy<T>;
  t.fill = cuda::Fill<T>;
  t.scale = cuda::Scale<T>;
  t.rope_kv_write = cuda::RopeKvWrite<T, T>;
  t.attention_forward = cuda::AttentionForward<T>;
  t.attention_backward = cuda::AttentionBackward<T>;
  t.attention_workspace_elems = cuda::AttentionWorkspaceElems;
  t.cross_entropy_forward_backward = cuda::CrossEntropyForwardBackward<T>;
  t.token_logprobs = cuda::TokenLogprobs<T>;
  t.token_argmax = cuda::TokenArgmax<T>;
  t.conv1d_forward = cuda::Conv1dForward<T>;
  t.conv1d_backward = cuda::Conv1dBackward<T>;
  t.selective_scan_forward = cuda::SelectiveScanForward<T>;
  t.selective_scan_backward = cuda::SelectiveScanBackward<T>;
  t.selective_scan_backward_pairs = cuda::SelectiveScanBackwardPairs<T>;
  t.silu_forward = cuda::SiluForward<T>;
  t.silu_backward = cuda::SiluBackward<T>;
  t.relu2_forward = cuda::Relu2Forward<T>;
  t.relu2_backward = cuda::Relu2Backward<T>;
  t.softplus_forward = cuda::SoftplusForward<T>;
  t.softplus_backward = cuda::SoftplusBackward<T>;
  t.copy_rows = cuda::CopyRows<T>;
  t.sigmoid_gate_forward = cuda::SigmoidGateForward<T>;
  t.sigmoid_gate_backward = cuda::SigmoidGateBackward<T>;
  t.gdn_gates_forward = cuda::GdnGatesForward<T>;
  t.gdn_gates_backward = cuda::GdnGatesBackward<T>;
  t.gated_delta_forward = cuda::GatedDeltaForward<T>;
  t.gated_delta_backward = cuda::GatedDeltaBackward<T>;
  t.gated_delta_workspace_elems = cuda::GatedDeltaWorkspaceElems;
  t.ssd_forward = cuda::SsdForward<T>;
  t.ssd_backward = cuda::SsdBackward<T>;
  t.ssd_backward_pairs = cuda::SsdBackwardPairs<T>;
  t.ssd_workspace_elems = cuda::SsdWorkspaceElems;
  t.gated_group_rmsnorm_forward = cuda::GatedGroupRmsnormForward<T>;
  t.gated_group_rmsnorm_backward = cuda::GatedGroupRmsnormBackward<T>;
  t.moe_route = cuda::MoeRoute<T>;
  t.moe_route_backward = cuda::MoeRouteBackward<T>;
  t.gather_rows = cuda::GatherRows<T>;
  t.scatter_add_rows = cuda::ScatterAddRows<T>;
  t.row_dots = cuda::RowDots<T>;
  t.adamw = cuda::AdamW<T>;
  t.lora_dropout = cuda::LoraDropout<T>;
  t.ssm_neg_exp = cuda::SsmNegExp<T>;
  t.ssm_neg_exp_backward = cuda::SsmNegExpBackward<T>;
  t.column_sums_f64 = cuda::ColumnSumsF64<T>;
  t.page_scores = cuda::PageScores;
  if constexpr (std::is_same_v<T, float>) {
    t.gemm_mixed = cuda::GemmMixed;
    t.bf16_to_f32 = cuda::BF16ToF32Row;
    t.f32_to_bf16 = cuda::F32ToBF16Row;
    t.cross_entropy_bf16 = cuda::CrossEntropyForwardBackward<uint16_t>;
    t.token_logprobs_bf16 = cuda::TokenLogprobs<uint16_t>;
    t.token_argmax_bf16 = cuda::TokenArgmax<uint16_t>;
    t.attention_forward_bf16 = cuda::AttentionForwardBf16;
    t.attention_backward_bf16 = cuda::AttentionBackwardBf16;
    t.adamw_bf16 = cuda::AdamWBF16;
    t.round_bf16 = cuda::RoundBF16;
    t.rope_kv_write_bf16 = cuda::RopeKvWriteBf16;
    t.rmsnorm_forward_bf16 = cuda::RmsNormForwardBF16;
    t.swiglu_forward_bf16 = cuda::SwigluForwardBF16;
    t.swiglu_backward_bf16 = cuda::SwigluBackwardBF16;
  }
  t.attention_merge = cuda::AttentionMerge<T>;
  cuda::AddVocabParallelOps(t);
  return t;
}

namespace {
// Static registration: linking //kernels/cuda (alwayslink) makes Device::kCUDA available. Nothing here touches
// the GPU; the first op or allocation does.
const bool registered = [] {
  static const OpTable<float> f32 = MakeCudaTable<float>();
  static const OpTable<double> f64 = MakeCudaTable<double>();
  DeviceBackend b;
  b.f32 = &f32;
  b.f64 = &f64;
  cuda::RegisterRuntime(b);
  RegisterBackend(Device::kCUDA, b);
  return true;
}();
}  // namespace

}  // namespace sg
