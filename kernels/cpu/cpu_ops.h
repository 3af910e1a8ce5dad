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

// Gemm<float> follows --matmul; Sgemm is fp32 whatever it says.
template <typename T>
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);
void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

template <typename T> void EmbeddingForward(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out);
template <typename T> void EmbeddingBackward(const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable);

template <typename T>
void RmsNormForward(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd);
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx, T* dw,
                     bool accumulate_dx);

template <typename T>
void Rope(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq, bool inverse);

template <typename T> void AddBias(T* y, const T* b, int64_t n, int64_t m);
template <typename T> void BiasBackward(const T* dy, int64_t n, int64_t m, T* db);
template <typename T> void SwigluForward(const T* gate, const T* up, int64_t count, T* out);
template <typename T>
void SwigluBackward(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup);
template <typename T> void AddInplace(T* y, const T* x, int64_t count);
template <typename T> void Copy(T* dst, const T* src, int64_t count);
template <typename T> void Fill(T* x, int64_t count, T value);
template <typename T> void Scale(T* x, int64_t count, double factor);

// KV: the pages' storage type, T or bf16 (uint16_t, T = float).
template <typename T, typename KV = T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, T* out, T* lse, T* workspace);
template <typename T, typename KV = T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<KV>& dkv, T* workspace);
// Fused layer ops (pointwise.cc): one pass where the unfused sequence made two or four.
template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv);
void RmsNormForwardBF16(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y, float* rstd,
                        uint16_t* half);
void SwigluForwardBF16(const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                       uint16_t* up_half, uint16_t* out_half);
void SwigluBackwardBF16(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count, float* dgate,
                        float* dup);
int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t page_size);
template <typename T>
void AttentionMerge(const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b);

template <typename T>
double CrossEntropyForwardBackward(T* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale, double* device_sum);
template <typename T>
void TokenLogprobs(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);
template <typename T>
void TokenArgmax(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out);
// The same over a bf16 logits chunk (--dtype=bf16), one row widened to fp32 at a time.
double CrossEntropyForwardBackwardBF16(uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                       const double* row_scale, double grad_scale, double* device_sum);
void TokenLogprobsBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);
void TokenArgmaxBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out);

template <typename T>
void Conv1dForward(const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch, int64_t k, T* y,
                   T* tail_out);
template <typename T>
void Conv1dBackward(const T* dy, const T* dtail_out, const T* x, const T* tail_in, const T* w, int64_t n, int64_t ch,
                    int64_t k, T* dx, T* dtail_in, T* dw, T* db);
template <typename T>
void SelectiveScanForward(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D, const T* h0,
                          int64_t n, int64_t dim, int64_t N, T* y, T* h_final);
template <typename T>
void SelectiveScanBackward(const T* dy, const T* dh_final, const T* u, const T* delta, const T* A, const T* B,
                           const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, T* du, T* ddelta,
                           T* dA, T* dB, T* dC, T* dD, T* dh0);
template <typename T>
int64_t SelectiveScanBackwardPairs(const T* dy, const T* u, const T* delta, const T* A, const T* B, const T* C,
                                   const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, const T* later_dy,
                                   const T* later_delta, const T* later_C, int64_t later, int64_t window, T* du,
                                   T* ddelta, T* dA, T* dB, T* dC, T* dD);
template <typename T> void SiluForward(const T* x, int64_t count, T* y);
template <typename T> void SiluBackward(const T* dy, const T* x, int64_t count, T* dx);
template <typename T> void SoftplusForward(const T* x, int64_t count, T* y);
template <typename T> void SoftplusBackward(const T* dy, const T* x, int64_t count, T* dx);

// Worker-thread lanes of memcpy (copy_engine.cc).
CopyEngine HostCopyEngine();

// bf16 storage (bf16.cc). Rows converted element by element, rounding to nearest even on the way down.
void BF16ToF32Row(const uint16_t* src, int64_t count, float* dst);
void F32ToBF16Row(const float* src, int64_t count, uint16_t* dst);
// OpTable::round_bf16, over the threads (a layer's activations: millions of values).
void RoundBF16(float* x, int64_t count, uint16_t* half);
// Gemm<float>'s contract where each of A, B and C is f32 or bf16 (a_type, b_type, c_type): products accumulate in
// fp32 and a bf16 C is rounded once, after the whole sum. Under --matmul=bf16 the f32 operands are rounded to bf16
// first (bf16.cc).
void GemmMixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
               int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
               int64_t ldc);

template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
           double weight_decay, int64_t step);
// AdamW on fp32 master weights (with fp32 gradient and moments), then the bf16 weights the model computes with
// are the masters rounded.
void AdamWBF16(uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step);

// Work inside a chunk that core once did on the host (chunk_ops.cc; backend.h's last block).
template <typename T>
void LoraDropout(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0, int64_t col0,
                 double p, bool accumulate, T* y);
template <typename T> void SsmNegExp(const T* a_log, int64_t count, T* a);
template <typename T> void SsmNegExpBackward(const T* da, const T* a, int64_t count, T* da_log);
template <typename T> void ColumnSumsF64(const T* x, int64_t rows, int64_t cols, double* sums);
void PageScores(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const double* key_sums, int64_t first, int64_t count, int64_t page_size, double* scores);

}  // namespace sg::cpu
