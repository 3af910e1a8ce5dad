// CUDA implementations of the backend table (declarations; one .cu per op family), mirroring kernels/cpu/cpu_ops.h.
// Same signatures and semantics as the CPU kernels. Tensors (T*) are device memory (runtime.cu's caching
// allocator over cudaMalloc: not host-addressable); the small index and parameter arrays of the
// table (ids, labels, page_table, page_mask, inv_freq, row_scale, and the outputs of token_logprobs/token_argmax)
// are host memory in every backend: the kernels stage them through sg::cuda::Stage / copy results back.
// Instantiated for float and double; the bf16 entries of the f32 table (--dtype=bf16) are declared last.
#pragma once

#include "kernels/backend.h"

namespace sg::cuda {

// gemm.cu
template <typename T>
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);

// pointwise.cu
template <typename T> void EmbeddingForward(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out);
template <typename T> void EmbeddingBackward(const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable);
template <typename T>
void RmsNormForward(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd);
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx, T* dw,
                     bool accumulate_dx);
template <typename T>
void Rope(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq, bool inverse);
template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv);
template <typename T> void AddBias(T* y, const T* b, int64_t n, int64_t m);
template <typename T> void BiasBackward(const T* dy, int64_t n, int64_t m, T* db);
template <typename T> void SwigluForward(const T* gate, const T* up, int64_t count, T* out);
template <typename T>
void SwigluBackward(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup);
template <typename T> void AddInplace(T* y, const T* x, int64_t count);
template <typename T> void Copy(T* dst, const T* src, int64_t count);
template <typename T> void Fill(T* x, int64_t count, T value);
template <typename T> void Scale(T* x, int64_t count, double factor);
template <typename T> void SiluForward(const T* x, int64_t count, T* y);
template <typename T> void SiluBackward(const T* dy, const T* x, int64_t count, T* dx);
template <typename T> void SoftplusForward(const T* x, int64_t count, T* y);
template <typename T> void SoftplusBackward(const T* dy, const T* x, int64_t count, T* dx);

// attention.cu
template <typename T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse, T* workspace);
template <typename T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<T>& dkv, T* workspace);
int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t page_size);
// attention_merge.cu
template <typename T>
void AttentionMerge(const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b);

// loss.cu
template <typename T>
double CrossEntropyForwardBackward(T* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale, double* device_sum);
template <typename T>
void TokenLogprobs(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);
template <typename T>
void TokenArgmax(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out);

// ssm.cu
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

// optimizer.cu
template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
           double weight_decay, int64_t step);

// ---- bf16 storage over f32 compute (the f32 table's bf16 entries) ----
// gemm.cu: cuBLASLt, fp32 compute. pointwise.cu: conversions. loss.cu: the loss templates above instantiated for
// uint16_t (bf16 logits). attention_tc.cu: tensor-core attention over bf16 pages. optimizer.cu: AdamW on fp32
// masters, then the bf16 weights.
void GemmMixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
               int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c, int64_t ldc);
void Bf16ToF32(const uint16_t* src, int64_t count, float* dst);
void F32ToBf16(const float* src, int64_t count, uint16_t* dst);
void RoundBf16(float* x, int64_t count, uint16_t* half);
void RopeKvWriteBf16(const float* k, const float* v, int64_t n, int64_t pos0, const double* inv_freq,
                     const PagedKV<uint16_t>& kv);
void RmsNormForwardBf16(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y, float* rstd,
                        uint16_t* half);
void SwigluForwardBf16(const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                       uint16_t* up_half, uint16_t* out_half);
void SwigluBackwardBf16(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count, float* dgate,
                        float* dup);
void AttentionForwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, float* out,
                          float* lse, float* workspace);
void AttentionBackwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, const float* out,
                           const float* lse, const float* dout, float* dq, const PagedKV<uint16_t>& dkv,
                           float* workspace);
void AdamWBf16(uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step);

// chunk_ops.cu: work inside a chunk that core once did on the host (backend.h's last block).
template <typename T>
void LoraDropout(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0, int64_t col0,
                 double p, bool accumulate, T* y);
template <typename T> void SsmNegExp(const T* a_log, int64_t count, T* a);
template <typename T> void SsmNegExpBackward(const T* da, const T* a, int64_t count, T* da_log);
template <typename T> void ColumnSumsF64(const T* x, int64_t rows, int64_t cols, double* sums);
void PageScores(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const double* key_sums, int64_t first, int64_t count, int64_t page_size, double* scores);

}  // namespace sg::cuda
