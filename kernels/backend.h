// The backend table: every op the engine runs, as free functions over raw pointers with explicit sizes.
// CPU (OpenMP + OpenBLAS) fills it for float and double; the CUDA backend fills its own copy.
// Conventions (as in llm.c): parameter gradients accumulate (+=); activation gradients are assigned
// unless the name says "accumulate". Layouts are row-major; a token's heads are contiguous: [n][heads][head_dim].
#pragma once

#include <cstdint>

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

  // y += x (residual)
  void (*add_inplace)(T* y, const T* x, int64_t count);

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
  // zero). Returns the sum of per-token losses -logp of valid rows. Other objectives f(logp) pass
  // row_scale[i] = -f'(logp_i).
  double (*cross_entropy_forward_backward)(T* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                           const double* row_scale, double grad_scale);
  // Per-row log-probabilities of labels only (no gradient); rows with label < 0 get 0.
  void (*token_logprobs)(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out);

  // AdamW on a flat parameter: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
  void (*adamw)(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step);
};

template <typename T>
const OpTable<T>& CpuOps();

}  // namespace sg
