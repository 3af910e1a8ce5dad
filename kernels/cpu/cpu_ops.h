// CPU implementations of the backend table (declarations; one .cc per op family).
#pragma once

#include <string>

#include "kernels/backend.h"

namespace sg::cpu {

// How f32 products multiply (--matmul; process-wide, like the CUDA backend's): "fp32" (the default, exact) or
// "bf16" (each f32 operand rounded to bf16, products accumulated in fp32: PyTorch's bf16 autocast). Covers Gemm<float>,
// GemmMixed and the f32 attention kernels; f64 never changes. Returns "" or why the mode is refused (tf32: the CPU
// has none).
std::string SetMatmul(const std::string& mode);
bool MatmulRoundsToBF16();
// How many bf16 matmul primitives the calling thread keeps (bounded; for tests).
size_t MatmulShapesCached();

// The table's kernels, with kernels/ops.inc's signatures (one .cc per op family). Gemm<float> follows --matmul, and
// so does GemmMixed: under --matmul=bf16 its f32 operands are rounded to bf16 first (bf16.cc). BF16ToF32Row and
// F32ToBF16Row convert element by element, rounding to nearest even on the way down; RoundBF16 runs over the
// threads (a layer's activations: millions of values).
#include "kernels/op_kernels.inc"

// Sgemm is fp32 whatever --matmul says.
void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc);

// The table's own entries (ops.inc's SG_OP_OWN). Attention and the fused RoPE page write are templates over the
// pages' storage type KV (P): T, or bf16 (uint16_t, T = float) for the f32 table's _bf16 entries.
template <typename T, typename KV = T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, T* out, T* lse, T* workspace);
template <typename T, typename KV = T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<KV>& dkv, T* workspace);
template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv);
// The loss ops over a bf16 logits chunk (--dtype=bf16), one row widened to fp32 at a time.
double CrossEntropyForwardBackwardBF16(uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                       const double* row_scale, double grad_scale, double* device_sum);
void TokenLogprobsBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);
void TokenArgmaxBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out);

// What the scans share (gated_delta.cc): dst = src [count], or zeros when src is null; and dst[t][g][:] = the sum,
// in head order, of rows[t][h][:] [width] over the heads h of group g (heads / groups adjacent heads each), the
// gradient of an input that a group of heads reads.
template <typename T>
void CopyOrZero(const T* src, int64_t count, T* dst);
template <typename T>
void SumOverHeadGroups(const T* rows, int64_t n, int64_t groups, int64_t heads, int64_t width, T* dst);

// Worker-thread lanes of memcpy (copy_engine.cc).
CopyEngine HostCopyEngine();

}  // namespace sg::cpu
