// CUDA implementations of the backend table (declarations; one .cu per op family), mirroring kernels/cpu/cpu_ops.h.
// Same signatures and semantics as the CPU kernels. Tensors (T*) are device memory (runtime.cu's caching
// allocator over cudaMalloc: not host-addressable); the small index and parameter arrays of the
// table (ids, labels, page_table, page_mask, inv_freq, row_scale, and the outputs of token_logprobs/token_argmax)
// are host memory in every backend: the kernels stage them through sg::cuda::Stage / copy results back. The mixture
// of experts' indices (moe_route's top, the row ops' index) are device memory, as the tensors.
// Instantiated for float and double; the bf16 entries of the f32 table (--dtype=bf16) are plain functions.
#pragma once

#include "kernels/backend.h"

namespace sg::cuda {

// The table's kernels, with kernels/ops.inc's signatures: gemm.cu (GemmMixed: cuBLASLt, fp32 compute), pointwise.cu
// (conversions too), attention.cu, attention_merge.cu, loss.cu, ssm.cu, gated_delta.cu, ssd.cu, moe.cu, optimizer.cu
// (AdamWBF16: AdamW on fp32 masters, then the bf16 weights), chunk_ops.cu (work inside a chunk that core once did on
// the host).
#include "kernels/op_kernels.inc"

// dst[t][g][:] = the sum, in head order, of rows[t][h][:] [width] over the heads h of group g (heads / groups
// adjacent heads each), enqueued on the compute stream: the gradient of an input that a group of heads reads
// (gated_delta.cu; ssd.cu uses it too).
template <typename T>
void SumOverHeadGroups(const T* rows, int64_t n, int64_t groups, int64_t heads, int64_t width, T* dst);

// The table's own entries (ops.inc's SG_OP_OWN). loss.cu instantiates the loss templates for uint16_t (bf16
// logits); attention_tc.cu holds the tensor-core attention over bf16 pages.
template <typename T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse, T* workspace);
template <typename T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<T>& dkv, T* workspace);
template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv);
void RopeKvWriteBf16(const float* k, const float* v, int64_t n, int64_t pos0, const double* inv_freq,
                     const PagedKV<uint16_t>& kv);
void AttentionForwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, float* out, float* lse,
                          float* workspace);
void AttentionBackwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, const float* out,
                           const float* lse, const float* dout, float* dq, const PagedKV<uint16_t>& dkv,
                           float* workspace);

}  // namespace sg::cuda
