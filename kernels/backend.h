// The backend table: every op the engine runs, as free functions over raw pointers with explicit sizes.
// CPU (OpenMP + OpenBLAS) fills it for float and double; the CUDA backend fills its own copy.
// Conventions (as in llm.c): parameter gradients accumulate (+=); activation gradients are assigned
// unless the name says "accumulate". Layouts are row-major; a token's heads are contiguous: [n][heads][head_dim].
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/dtype.h"

namespace sg {

// A paged view of one layer's K and V (or dK and dV) for attention kernels. Page p (a pool index from
// page_table) holds page_size tokens: keys at k_pool + p * page_stride, laid out [page_size][kv_heads][head_dim],
// and values at v_pool + p * page_stride. This is the layout the CUDA backend uses too.
template <typename T>
struct PagedKV {
  T* k_pool = nullptr;
  T* v_pool = nullptr;
  // logical page i -> pool page; in a gradient view, -1 marks a page whose gradient nobody needs (backward
  // skips computing it)
  const int32_t* page_table = nullptr;
  int64_t page_size = 0;
  int64_t page_stride = 0;  // elements between consecutive pool pages
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  T* k_page(int64_t logical) const { return k_pool + page_table[logical] * page_stride; }
  T* v_page(int64_t logical) const { return v_pool + page_table[logical] * page_stride; }
  bool has_page(int64_t logical) const { return page_table[logical] >= 0; }
  // Page-level sparse attention (SeCOv2 §4.3): when set, attention reads (and backward writes dK/dV of) only
  // the logical pages with page_mask[i] != 0; null = every page (dense).
  const uint8_t* page_mask = nullptr;
  bool selected(int64_t logical) const { return page_mask == nullptr || page_mask[logical] != 0; }
};

// Geometry of one attention call: a chunk of n queries at absolute positions [pos0, pos0 + n), causal over
// keys [0, pos0 + n) held in the paged cache.
struct AttentionShape {
  int64_t n = 0;
  int64_t pos0 = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double scale = 0;  // softmax scale, 1/sqrt(head_dim)
};

template <typename T>
struct OpTable {
  // C[M,N] = alpha * op(A) op(B) + beta * C, row-major, op = transpose if trans_*.
  void (*gemm)(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

  // out[i,:] = table[ids[i],:]; dtable[ids[i],:] += dout[i,:]
  void (*embedding_forward)(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out);
  void (*embedding_backward)(const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable);

  // y = x * rstd * w, rstd saved per row. Backward: dx (assigned unless accumulate), dw +=.
  void (*rmsnorm_forward)(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd);
  void (*rmsnorm_backward)(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx,
                           T* dw, bool accumulate_dx);

  // In-place rotary embedding of x[n][heads][head_dim] at positions pos0.., using inv_freq[head_dim/2]
  // (HF rotate_half convention). inverse=true applies the transpose rotation (the backward).
  void (*rope)(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq,
               bool inverse);

  // y[n][m] += b[m]; db[m] += sum_i dy[i][m]
  void (*add_bias)(T* y, const T* b, int64_t n, int64_t m);
  void (*bias_backward)(const T* dy, int64_t n, int64_t m, T* db);

  // out = silu(gate) * up; backward assigns dgate, dup.
  void (*swiglu_forward)(const T* gate, const T* up, int64_t count, T* out);
  void (*swiglu_backward)(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup);

  // y += x (residual); dst = src; x[:] = value; x *= factor (all on the backend's memory)
  void (*add_inplace)(T* y, const T* x, int64_t count);
  void (*copy)(T* dst, const T* src, int64_t count);
  void (*fill)(T* x, int64_t count, T value);
  void (*scale)(T* x, int64_t count, double factor);

  // Causal GQA attention of q[n][heads][head_dim] against the paged cache. Saves lse[heads][n].
  // `workspace` holds attention_workspace_elems(s, page_size) elements (O(query block x page), not O(T)).
  void (*attention_forward)(const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse,
                            T* workspace);
  // Backward: dq assigned; dK/dV accumulated into dkv pages for all keys [0, pos0 + n).
  void (*attention_backward)(const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out,
                             const T* lse, const T* dout, T* dq, const PagedKV<T>& dkv, T* workspace);
  int64_t (*attention_workspace_elems)(const AttentionShape& s, int64_t page_size);

  // Cross-entropy over logits[n][vocab], overwritten by d loss / d logits * grad_scale * row_scale[i] (row_scale
  // null: 1), i.e. row i becomes s_i (softmax - onehot(label)). labels < 0 are ignored (their gradient rows are
  // zero). The sum of per-token losses -logp of valid rows (in row order): device_sum null: returned (the host
  // waits for it); else added to *device_sum (one double in device memory) on the device, and 0 returned, so a
  // chunk never waits. Other objectives f(logp) pass row_scale[i] = -f'(logp_i).
  double (*cross_entropy_forward_backward)(T* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                           const double* row_scale, double grad_scale, double* device_sum);
  // Per-row log-probabilities of labels only (no gradient); rows with label < 0 get 0.
  void (*token_logprobs)(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);
  // Per-row arg max of the logits over the vocabulary (the lowest id among ties; NaN entries never win), for
  // rows with label >= 0; rows with label < 0 get -1. Evaluation's accuracy (core/eval.h).
  void (*token_argmax)(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out);

  // State-space ops (Mamba-1), kernels/cpu/ssm.cc. Channels are the last (contiguous) dimension.
  // Causal depthwise conv1d over a chunk: with xx = tail_in[k-1][ch] ++ x[n][ch] (tail_in: the inputs of the k-1
  // positions before the chunk; null = zeros), y[t][c] = b[c] + sum_j w[c][j] xx[t+j][c] (b may be null);
  // tail_out (may be null) = the last k-1 rows of xx, the tail of the next chunk.
  void (*conv1d_forward)(const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch, int64_t k,
                         T* y, T* tail_out);
  // Backward, given dy and dtail_out (the gradient of tail_out; null = zero): dx and dtail_in (may be null)
  // assigned; dw[ch][k] and db (may be null) accumulated.
  void (*conv1d_backward)(const T* dy, const T* dtail_out, const T* x, const T* tail_in, const T* w, int64_t n,
                          int64_t ch, int64_t k, T* dx, T* dtail_in, T* dw, T* db);
  // Selective scan over a chunk, per channel d and state s: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,
  // y_t = C_t . h_t + D u_t. u, delta, y: [n][dim]; A: [dim][N]; B, C: [n][N]; D: [dim] (may be null); h0: the
  // state before the chunk [dim][N] (null = zeros); h_final (may be null): the state after it.
  void (*selective_scan_forward)(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D,
                                 const T* h0, int64_t n, int64_t dim, int64_t N, T* y, T* h_final);
  // Backward (recomputes the states from h0), given dy and dh_final (null = zero): du, ddelta, dB, dC and dh0
  // (may be null) assigned; dA, dD (may be null) accumulated.
  void (*selective_scan_backward)(const T* dy, const T* dh_final, const T* u, const T* delta, const T* A,
                                  const T* B, const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N,
                                  T* du, T* ddelta, T* dA, T* dB, T* dC, T* dD, T* dh0);
  // The same gradients by adjoint sharding (arXiv 2501.00692): dh_i assembled from independent vector-Jacobian
  // products over pairs (t, i), i <= t < i + window (window >= the tokens left: exact), with adjoint states
  // lambda^{t,i} = C_t exp(A (delta_{i+1} + ... + delta_t)). The pairs with t past the chunk read later_dy,
  // later_delta [later][dim] and later_C [later][N]: the tokens right after the chunk. No dh0: what earlier chunks
  // need are these cotangents. du, ddelta, dB, dC assigned; dA, dD accumulated. Returns the pairs per channel.
  int64_t (*selective_scan_backward_pairs)(const T* dy, const T* u, const T* delta, const T* A, const T* B,
                                           const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N,
                                           const T* later_dy, const T* later_delta, const T* later_C, int64_t later,
                                           int64_t window, T* du, T* ddelta, T* dA, T* dB, T* dC, T* dD);
  // y = silu(x), y = softplus(x) (torch's, threshold 20); backward assigns dx.
  void (*silu_forward)(const T* x, int64_t count, T* y);
  void (*silu_backward)(const T* dy, const T* x, int64_t count, T* dx);
  void (*softplus_forward)(const T* x, int64_t count, T* y);
  void (*softplus_backward)(const T* dy, const T* x, int64_t count, T* dx);

  // AdamW on a flat parameter: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
  void (*adamw)(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step);

  // bf16 storage (--dtype=bf16): filled in the f32 table of backends that have it, null otherwise.
  // gemm's contract where each of A, B, C is f32 or bf16; products accumulate in fp32, a bf16 C is rounded once.
  void (*gemm_mixed)(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, DType a_type,
                     const void* a, int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type,
                     void* c, int64_t ldc) = nullptr;
  void (*bf16_to_f32)(const uint16_t* src, int64_t count, float* dst) = nullptr;
  void (*f32_to_bf16)(const float* src, int64_t count, uint16_t* dst) = nullptr;
  // cross_entropy_forward_backward, token_logprobs, token_argmax over a bf16 logits chunk.
  double (*cross_entropy_bf16)(uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                               const double* row_scale, double grad_scale, double* device_sum) = nullptr;
  void (*token_logprobs_bf16)(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                              double* out) = nullptr;
  void (*token_argmax_bf16)(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                            int32_t* out) = nullptr;
  // attention_forward / attention_backward over KV and KV-gradient pages stored in bf16.
  void (*attention_forward_bf16)(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, float* out,
                                 float* lse, float* workspace) = nullptr;
  void (*attention_backward_bf16)(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv,
                                  const float* out, const float* lse, const float* dout, float* dq,
                                  const PagedKV<uint16_t>& dkv, float* workspace) = nullptr;
  // adamw on fp32 master weights, then weights = the masters rounded to bf16.
  void (*adamw_bf16)(uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step) = nullptr;

  // ---- Work inside a chunk that host loops did over copies of device memory (kernels/cpu/chunk_ops.cc,
  // kernels/cuda/chunk_ops.cu): a chunk reads nothing back but sparse attention's page scores. ----
  // LoRA dropout over x [n][cols], rows at positions pos0.., columns at input features col0.. (the mask of
  // kernels/dropout_mask.h with `seed`, `module`): y = x / (1 - p) where kept, 0 elsewhere; accumulate: y += x /
  // (1 - p) where kept, untouched elsewhere.
  void (*lora_dropout)(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0,
                       int64_t col0, double p, bool accumulate, T* y) = nullptr;
  // Mamba's A = -exp(a_log), and its backward da_log += dA * A (count elements).
  void (*ssm_neg_exp)(const T* a_log, int64_t count, T* a) = nullptr;
  void (*ssm_neg_exp_backward)(const T* da, const T* a, int64_t count, T* da_log) = nullptr;
  // sums[j] = the f64 sum over rows i = 0, 1, .. (in order) of x[i][j], x [rows][cols]; sums assigned. Sparse
  // attention's key sums of a page and query sums of a chunk.
  void (*column_sums_f64)(const T* x, int64_t rows, int64_t cols, double* sums) = nullptr;
  // Sparse attention's page scores, in f64: g[kv][e] = sum over the query heads h of KV head kv (in order) of
  // q_sums[h][e] / n, then scores[i] = (sum over kv, e in order of g[kv][e] key_sums[first + i][kv][e]) /
  // page_size for i < count. q_sums [heads][head_dim] (a chunk of n queries), key_sums [pages][kv_heads][head_dim].
  void (*page_scores)(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      const double* key_sums, int64_t first, int64_t count, int64_t page_size,
                      double* scores) = nullptr;
  // Attention over page groups (core/paged_attention.h, dense offload streams the cache a group at a time).
  // Merges attention over a second set of keys (out_b, lse_b) into attention over the first (out, lse), per query
  // row and head: with L = logaddexp(lse, lse_b), out = out e^(lse - L) + out_b e^(lse_b - L), lse = L. out, out_b:
  // [n][heads][head_dim]; lse, lse_b: [heads][n]. A side whose lse is -inf (no key visible) contributes nothing,
  // whatever its out holds (a row without keys comes out of attention_forward as NaN).
  void (*attention_merge)(const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b) = nullptr;
  // ---- Tensor parallelism: a vocabulary split over a group of ranks (kernels/cpu/vocab_parallel.cc,
  // kernels/cuda/vocab_parallel.cu; used by core/lm_head.h and core/param_store.h) ----
  // This rank holds rows [v0, v0 + rows) of the embedding table and columns [v0, v0 + vocab) of a logits chunk
  // [n][vocab]; ids and labels name the whole vocabulary. Pointer arguments to host arrays (ids, labels, row_*,
  // argmax, sums) are host memory, as for token_logprobs; the others are the backend's.
  // out[i] = table[ids[i] - v0] for the ids this rank holds, 0 for the others; backward: dtable[ids[i] - v0] +=
  // dout[i] for those only (per row in token order).
  void (*embedding_shard_forward)(const int32_t* ids, int64_t n, const T* table, int64_t rows, int64_t v0, int64_t d,
                                  T* out) = nullptr;
  void (*embedding_shard_backward)(const int32_t* ids, int64_t n, const T* dout, int64_t rows, int64_t v0,
                                   int64_t d, T* dtable) = nullptr;
  // Per row with a label: the largest of this rank's logits (as double) and the whole-vocabulary id of its first
  // column (NaN never wins; -1 when no entry beats -inf); rows without a label get -inf and -1.
  void (*vocab_shard_max)(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                          double* row_max, int64_t* argmax) = nullptr;
  // Given the group's row maxima, per row with a label: sums[i] = sum over this rank's columns of
  // exp(logit - row_max[i]), sums[n + i] = the label's logit if this rank holds it, else 0 (rows without: 0, 0).
  void (*vocab_shard_sums)(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                           const double* row_max, double* sums) = nullptr;
  // Given the group's row_max and row_sum: row i becomes grad_scale row_scale[i] (exp(logit - row_max[i]) /
  // row_sum[i] - [column is the label]), computed in double (row_scale null: 1; rows without a label: 0).
  void (*vocab_shard_gradient)(T* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                               const double* row_max, const double* row_sum, const double* row_scale,
                               double grad_scale) = nullptr;
  // The same over a bf16 table or logits chunk (f32 tables of backends with bf16 storage).
  void (*embedding_shard_forward_bf16)(const int32_t* ids, int64_t n, const uint16_t* table, int64_t rows,
                                       int64_t v0, int64_t d, float* out) = nullptr;
  void (*vocab_shard_max_bf16)(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                               double* row_max, int64_t* argmax) = nullptr;
  void (*vocab_shard_sums_bf16)(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                                const double* row_max, double* sums) = nullptr;
  void (*vocab_shard_gradient_bf16)(uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                                    const double* row_max, const double* row_sum, const double* row_scale,
                                    double grad_scale) = nullptr;
  // bf16 activations (ParamStore::RoundAndKeep, core/param_store.h), f32 table of backends with bf16 storage:
  // x := x rounded to bf16 values (f32_to_bf16's rounding) and half := those bf16 bits, in one pass where
  // f32_to_bf16 and then bf16_to_f32 take two.
  void (*round_bf16)(float* x, int64_t count, uint16_t* half) = nullptr;

  // ---- Fused layer ops: one pass over memory where the unfused sequence takes several (same bits). ----
  // RoPE into the K/V page write: rows [pos0, pos0 + n) of kv's pages get k [n][kv_heads][head_dim] roped as
  // `rope` does and v unchanged (rope, then PagePool::Scatter); pages absent from the table (-1) are skipped. k and
  // v are only read.
  void (*rope_kv_write)(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq,
                        const PagedKV<T>& kv) = nullptr;
  // The bf16 entries below: f32 table of backends with bf16 storage. rope_kv_write into bf16 pages, each value
  // rounded once (f32_to_bf16's rounding).
  void (*rope_kv_write_bf16)(const float* k, const float* v, int64_t n, int64_t pos0, const double* inv_freq,
                             const PagedKV<uint16_t>& kv) = nullptr;
  // rmsnorm_forward, then round_bf16(y, half): y holds bf16 values, and their bits go to half unless it is null.
  void (*rmsnorm_forward_bf16)(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y,
                               float* rstd, uint16_t* half) = nullptr;
  // swiglu_forward over gate and up rounded to bf16 values, out rounded too: round_bf16 of gate and of up,
  // swiglu_forward, round_bf16 of out. gate and up are only read; the bf16 bits of gate, up and out go to
  // gate_half, up_half and out_half, each unless null.
  void (*swiglu_forward_bf16)(const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                              uint16_t* up_half, uint16_t* out_half) = nullptr;
  // swiglu_backward reading the bf16 gate and up that swiglu_forward_bf16 kept (no widened copies).
  void (*swiglu_backward_bf16)(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count,
                               float* dgate, float* dup) = nullptr;
};

// A weight matrix as a model stores it: in the compute type, or in bf16 (--dtype=bf16 over f32 compute).
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// gemm with B a weight: C = alpha op(A) op(W) + beta C, through gemm_mixed when W is bf16.
template <typename T>
void GemmWeight(const OpTable<T>& ops, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
                const T* a, int64_t lda, WeightView w, int64_t ldw, T beta, T* c, int64_t ldc) {
  if (w.dtype != DType::kBF16) {
    ops.gemm(trans_a, trans_b, m, n, k, alpha, a, lda, static_cast<const T*>(w.data), ldw, beta, c, ldc);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (ops.gemm_mixed) {
      ops.gemm_mixed(trans_a, trans_b, m, n, k, alpha, DType::kF32, a, lda, DType::kBF16, w.data, ldw, beta,
                     DType::kF32, c, ldc);
      return;
    }
  }
  throw std::invalid_argument("--dtype=bf16: this backend has no bf16 GEMM");
}

template <typename T>
const OpTable<T>& CpuOps();

// Asynchronous copies between a device's memory and pinned host memory, in lanes (CUDA: a stream per lane; CPU:
// a worker thread per lane), for KV offload. Copies issued to one lane run in order; wait(lane) returns once every
// copy issued to it has finished.
struct CopyEngine {
  void* (*alloc_host)(size_t bytes) = nullptr;  // pinned on CUDA
  void (*free_host)(void* p) = nullptr;
  void (*copy_async)(void* dst, const void* src, size_t bytes, int lane) = nullptr;
  void (*wait)(int lane) = nullptr;
};

// What a device backend registers (the CUDA library does so when linked in, built with --config=cuda).
struct DeviceBackend {
  const OpTable<float>* f32 = nullptr;
  const OpTable<double>* f64 = nullptr;
  // "" when a device is usable; otherwise why not (e.g. "no CUDA device: ...").
  std::string (*probe)() = nullptr;
  // Free and total device memory in bytes.
  void (*memory_info)(int64_t* free_bytes, int64_t* total_bytes) = nullptr;
  // Waits for the device's work (a step's end); throws naming the work that failed.
  void (*synchronize)() = nullptr;
  // Asynchronous backends, at the start of each pass of a chunk: reports (throws) a fault of earlier work that has
  // already shown, without waiting for the device, and labels the work that follows ("chunk [0, 512)") in error
  // messages. Null: nothing to do.
  void (*begin_chunk)(const std::string& label) = nullptr;
  // How f32 matmuls multiply: "fp32" (exact), "tf32" or "bf16" (tensor cores; bf16 inputs, f32 accumulation).
  // Returns "" or why the mode is refused. Null: "fp32" only.
  std::string (*set_matmul)(const std::string& mode) = nullptr;
  // The device's name and its peak dense matmul FLOP/s in the current mode (the denominator of MFU; 0 = unknown).
  std::string (*name)() = nullptr;
  double (*peak_flops)(bool f64) = nullptr;
  CopyEngine copies;
};
void RegisterBackend(Device d, const DeviceBackend& b);
// The registered backend of d (CPU always is); null when none (CUDA in a build without --config=cuda).
const DeviceBackend* FindBackend(Device d);
// Waits for d's work when its backend has any (a step's end); throws naming the work that failed.
inline void SynchronizeDevice(Device d) {
  if (const DeviceBackend* b = FindBackend(d); b && b->synchronize) b->synchronize();
}
// "" when d can run: CPU always; CUDA when the CUDA backend is linked in and a GPU is usable.
std::string DeviceUnavailableReason(Device d);
// The op table of d for T; throws std::runtime_error naming the device if it has none.
template <typename T>
const OpTable<T>& OpsFor(Device d);

}  // namespace sg
