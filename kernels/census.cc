#include "kernels/census.h"

#include <stdexcept>
#include <type_traits>

namespace sg {

const char* OpFamilyName(OpFamily f) {
  static const char* const kNames[kNumOpFamilies] = {
      "gemm", "bf16_round", "attention_fwd", "attention_bwd", "norm", "rope",
      "pointwise", "embedding", "convert", "loss", "ssm", "optimizer"};
  return kNames[static_cast<int>(f)];
}

double RooflineLimits::Seconds(const OpRecord& r) const {
  return std::max(static_cast<double>(r.flops) / peak_flops,
                  static_cast<double>(r.bytes_read + r.bytes_written) / bandwidth);
}

bool RooflineLimits::ComputeBound(const OpRecord& r) const {
  return static_cast<double>(r.flops) / peak_flops > static_cast<double>(r.bytes_read + r.bytes_written) / bandwidth;
}

void OpCensus::Add(const OpRecord& r) {
  FamilyTotals& f = families_[static_cast<int>(r.family)];
  const double s = limits_.Seconds(r);
  ++f.calls;
  f.flops += r.flops;
  f.bytes += r.bytes_read + r.bytes_written;
  f.seconds += s;
  if (limits_.ComputeBound(r)) f.compute_seconds += s;
  if (keep_) records_.push_back(r);
}

void OpCensus::Clear() {
  records_.clear();
  families_ = {};
}

FamilyTotals OpCensus::Total() const {
  FamilyTotals t;
  for (const FamilyTotals& f : families_) {
    t.calls += f.calls;
    t.flops += f.flops;
    t.bytes += f.bytes;
    t.seconds += f.seconds;
    t.compute_seconds += f.compute_seconds;
  }
  return t;
}

namespace {

// The scope's state: the op tables are plain function pointers without a context, so the counting entries find
// the census and the wrapped tables here.
OpCensus* g_census = nullptr;
const OpTable<float>* g_f32 = nullptr;
const OpTable<double>* g_f64 = nullptr;

template <typename T>
const OpTable<T>& Inner() {
  if constexpr (std::is_same_v<T, double>) return *g_f64;
  else return *g_f32;
}

void Count(const char* op, OpFamily family, int64_t flops, int64_t read, int64_t written) {
  g_census->Add(OpRecord{op, family, flops, read, written});
}

constexpr int64_t kBf16 = 2, kF32 = 4;
int64_t Size(DType t) { return t == DType::kBF16 ? kBf16 : t == DType::kF64 ? 8 : kF32; }

// A GEMM C[m,n] (+)= A[m,k] B[k,n] whose operands are read at a_size, b_size bytes per element and C at c_size.
void CountGemm(const char* op, int64_t m, int64_t n, int64_t k, int64_t a_size, int64_t b_size, int64_t c_size,
               bool reads_c) {
  Count(op, OpFamily::kGemm, 2 * m * n * k, m * k * a_size + k * n * b_size + (reads_c ? m * n * c_size : 0),
        m * n * c_size);
}

// How many of the keys [0, pos0 + n) lie on the pages kept by keep.
template <typename Keep>
int64_t KeyTokens(const AttentionShape& s, int64_t page_size, Keep keep) {
  int64_t tokens = 0;
  const int64_t end = s.pos0 + s.n;
  for (int64_t p = 0; p * page_size < end; ++p)
    if (keep(p)) tokens += std::min(end, (p + 1) * page_size) - p * page_size;
  return tokens;
}

// Attention over paged K/V stored as KV (q, out, lse, dout, dq in T).
template <typename T, typename KV>
void CountAttentionForward(const char* op, const AttentionShape& s, const PagedKV<KV>& kv) {
  auto sel = [&](int64_t p) { return kv.selected(p); };
  const int64_t rows = s.n * s.heads * s.head_dim, kv_row = s.kv_heads * s.head_dim * int64_t(sizeof(KV));
  const int64_t pairs = CausalPairs(s, kv.page_size, sel);
  Count(op, OpFamily::kAttentionForward, 2 * 2 * s.head_dim * s.heads * pairs,
        rows * int64_t(sizeof(T)) + 2 * KeyTokens(s, kv.page_size, sel) * kv_row,
        (rows + s.heads * s.n) * int64_t(sizeof(T)));
}

template <typename T, typename KV>
void CountAttentionBackward(const char* op, const AttentionShape& s, const PagedKV<KV>& kv, const PagedKV<KV>& dkv) {
  auto sel = [&](int64_t p) { return kv.selected(p); };
  auto grad = [&](int64_t p) { return kv.selected(p) && dkv.selected(p) && dkv.has_page(p); };
  const int64_t rows = s.n * s.heads * s.head_dim, kv_row = s.kv_heads * s.head_dim * int64_t(sizeof(KV));
  const int64_t flops = 2 * s.head_dim * s.heads *
                        (3 * CausalPairs(s, kv.page_size, sel) + 4 * CausalPairs(s, kv.page_size, grad));
  const int64_t grad_bytes = 2 * KeyTokens(s, kv.page_size, grad) * kv_row;  // dK and dV, accumulated
  // reads q, out, dout, lse, K, V of the selected keys; writes dq
  Count(op, OpFamily::kAttentionBackward, flops,
        (3 * rows + s.heads * s.n) * int64_t(sizeof(T)) + 2 * KeyTokens(s, kv.page_size, sel) * kv_row + grad_bytes,
        rows * int64_t(sizeof(T)) + grad_bytes);
}

// RoPE into the K/V page write: the chunk's K and V read at in_size bytes an element (and the frequencies), written
// into the pages at page_size bytes (rows of absent pages are skipped, but counted: an upper bound).
template <typename P>
void CountRopeKvWrite(const char* op, int64_t n, const PagedKV<P>& kv, int64_t in_size, int64_t page_size) {
  const int64_t values = 2 * n * kv.kv_heads * kv.head_dim;
  Count(op, OpFamily::kRope, 0, values * in_size + kv.head_dim / 2 * 8, values * page_size);
}

template <typename T>
OpTable<T> MakeCounting(const OpTable<T>& inner) {
  constexpr int64_t S = sizeof(T);
  OpTable<T> t = inner;  // entries the inner table lacks stay null
  t.gemm = [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
              int64_t ldb, T beta, T* c, int64_t ldc) {
    CountGemm("gemm", m, n, k, S, S, S, beta != T(0));
    Inner<T>().gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  };
  t.embedding_forward = [](const int32_t* ids, int64_t n, const T* table, int64_t d, T* out) {
    Count("embedding_forward", OpFamily::kEmbedding, 0, n * 4 + n * d * S, n * d * S);
    Inner<T>().embedding_forward(ids, n, table, d, out);
  };
  t.embedding_backward = [](const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable) {
    Count("embedding_backward", OpFamily::kEmbedding, 0, n * 4 + 2 * n * d * S, n * d * S);
    Inner<T>().embedding_backward(ids, n, dout, d, dtable);
  };
  t.rmsnorm_forward = [](const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd) {
    Count("rmsnorm_forward", OpFamily::kNorm, 0, (n * d + d) * S, (n * d + n) * S);
    Inner<T>().rmsnorm_forward(x, w, n, d, eps, y, rstd);
  };
  t.rmsnorm_backward = [](const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx, T* dw,
                          bool accumulate_dx) {
    // dy, x, w, rstd (and dx when accumulated) read; dx written; dw accumulated
    Count("rmsnorm_backward", OpFamily::kNorm, 0, ((accumulate_dx ? 3 : 2) * n * d + 2 * d + n) * S,
          (n * d + d) * S);
    Inner<T>().rmsnorm_backward(dy, x, w, rstd, n, d, dx, dw, accumulate_dx);
  };
  t.rope = [](T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq,
              bool inverse) {
    Count("rope", OpFamily::kRope, 0, n * heads * head_dim * S + head_dim / 2 * 8, n * heads * head_dim * S);
    Inner<T>().rope(x, n, heads, head_dim, pos0, inv_freq, inverse);
  };
  t.add_bias = [](T* y, const T* b, int64_t n, int64_t m) {
    Count("add_bias", OpFamily::kPointwise, 0, (n * m + m) * S, n * m * S);
    Inner<T>().add_bias(y, b, n, m);
  };
  t.bias_backward = [](const T* dy, int64_t n, int64_t m, T* db) {
    Count("bias_backward", OpFamily::kPointwise, 0, (n * m + m) * S, m * S);
    Inner<T>().bias_backward(dy, n, m, db);
  };
  t.swiglu_forward = [](const T* gate, const T* up, int64_t count, T* out) {
    Count("swiglu_forward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
    Inner<T>().swiglu_forward(gate, up, count, out);
  };
  t.swiglu_backward = [](const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup) {
    Count("swiglu_backward", OpFamily::kPointwise, 0, 3 * count * S, 2 * count * S);
    Inner<T>().swiglu_backward(dout, gate, up, count, dgate, dup);
  };
  t.add_inplace = [](T* y, const T* x, int64_t count) {
    Count("add_inplace", OpFamily::kPointwise, 0, 2 * count * S, count * S);
    Inner<T>().add_inplace(y, x, count);
  };
  t.copy = [](T* dst, const T* src, int64_t count) {
    Count("copy", OpFamily::kPointwise, 0, count * S, count * S);
    Inner<T>().copy(dst, src, count);
  };
  t.fill = [](T* x, int64_t count, T value) {
    Count("fill", OpFamily::kPointwise, 0, 0, count * S);
    Inner<T>().fill(x, count, value);
  };
  t.scale = [](T* x, int64_t count, double factor) {
    Count("scale", OpFamily::kPointwise, 0, count * S, count * S);
    Inner<T>().scale(x, count, factor);
  };
  // Attention over page groups: each group's output and logsumexp merged into the running ones (4 flops a value).
  t.attention_merge = [](const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b) {
    const int64_t values = s.n * s.heads * s.head_dim, rows = s.n * s.heads;
    Count("attention_merge", OpFamily::kPointwise, 4 * values, (2 * values + 2 * rows) * S, (values + rows) * S);
    Inner<T>().attention_merge(s, out, lse, out_b, lse_b);
  };
  t.attention_forward = [](const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse, T* ws) {
    CountAttentionForward<T, T>("attention_forward", s, kv);
    Inner<T>().attention_forward(s, q, kv, out, lse, ws);
  };
  t.attention_backward = [](const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out, const T* lse,
                            const T* dout, T* dq, const PagedKV<T>& dkv, T* ws) {
    CountAttentionBackward<T, T>("attention_backward", s, kv, dkv);
    Inner<T>().attention_backward(s, q, kv, out, lse, dout, dq, dkv, ws);
  };
  // Loss ops read the logits and labels (and row scales); cross-entropy overwrites the logits with the gradient.
  t.cross_entropy_forward_backward = [](T* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                        const double* row_scale, double grad_scale, double* device_sum) {
    Count("cross_entropy", OpFamily::kLoss, 0, n * vocab * S + n * 4 + (row_scale ? n * 8 : 0), n * vocab * S);
    return Inner<T>().cross_entropy_forward_backward(logits, labels, n, vocab, row_scale, grad_scale, device_sum);
  };
  t.token_logprobs = [](const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
    Count("token_logprobs", OpFamily::kLoss, 0, n * vocab * S + n * 4, n * 8);
    Inner<T>().token_logprobs(logits, labels, n, vocab, out);
  };
  t.token_argmax = [](const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
    Count("token_argmax", OpFamily::kLoss, 0, n * vocab * S + n * 4, n * 4);
    Inner<T>().token_argmax(logits, labels, n, vocab, out);
  };
  t.conv1d_forward = [](const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch, int64_t k,
                        T* y, T* tail_out) {
    const int64_t tail = (k - 1) * ch;
    Count("conv1d_forward", OpFamily::kSsm, 0, (n * ch + (tail_in ? tail : 0) + ch * k + (b ? ch : 0)) * S,
          (n * ch + (tail_out ? tail : 0)) * S);
    Inner<T>().conv1d_forward(x, tail_in, w, b, n, ch, k, y, tail_out);
  };
  t.conv1d_backward = [](const T* dy, const T* dtail_out, const T* x, const T* tail_in, const T* w, int64_t n,
                         int64_t ch, int64_t k, T* dx, T* dtail_in, T* dw, T* db) {
    const int64_t tail = (k - 1) * ch;
    // dw and db accumulate: read and written
    Count("conv1d_backward", OpFamily::kSsm, 0,
          (2 * n * ch + (dtail_out ? tail : 0) + (tail_in ? tail : 0) + 2 * ch * k + (db ? ch : 0)) * S,
          (n * ch + (dtail_in ? tail : 0) + ch * k + (db ? ch : 0)) * S);
    Inner<T>().conv1d_backward(dy, dtail_out, x, tail_in, w, n, ch, k, dx, dtail_in, dw, db);
  };
  t.selective_scan_forward = [](const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D,
                                const T* h0, int64_t n, int64_t dim, int64_t N, T* y, T* h_final) {
    Count("selective_scan_forward", OpFamily::kSsm, 0,
          (2 * n * dim + dim * N + 2 * n * N + (D ? dim : 0) + (h0 ? dim * N : 0)) * S,
          (n * dim + (h_final ? dim * N : 0)) * S);
    Inner<T>().selective_scan_forward(u, delta, A, B, C, D, h0, n, dim, N, y, h_final);
  };
  t.selective_scan_backward = [](const T* dy, const T* dh_final, const T* u, const T* delta, const T* A, const T* B,
                                 const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, T* du,
                                 T* ddelta, T* dA, T* dB, T* dC, T* dD, T* dh0) {
    // dy, u, delta, A, B, C, D, h0, dh_final read; dA, dD accumulated; du, ddelta, dB, dC, dh0 written
    Count("selective_scan_backward", OpFamily::kSsm, 0,
          (3 * n * dim + 2 * dim * N + 2 * n * N + (D ? 2 * dim : 0) + (h0 ? dim * N : 0) +
           (dh_final ? dim * N : 0)) * S,
          (2 * n * dim + dim * N + 2 * n * N + (dD ? dim : 0) + (dh0 ? dim * N : 0)) * S);
    Inner<T>().selective_scan_backward(dy, dh_final, u, delta, A, B, C, D, h0, n, dim, N, du, ddelta, dA, dB, dC, dD,
                                       dh0);
  };
  t.selective_scan_backward_pairs = [](const T* dy, const T* u, const T* delta, const T* A, const T* B, const T* C,
                                       const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, const T* later_dy,
                                       const T* later_delta, const T* later_C, int64_t later, int64_t window, T* du,
                                       T* ddelta, T* dA, T* dB, T* dC, T* dD) {
    Count("selective_scan_backward_pairs", OpFamily::kSsm, 0,
          (3 * n * dim + 2 * dim * N + 2 * n * N + (D ? 2 * dim : 0) + (h0 ? dim * N : 0) +
           later * (2 * dim + N)) * S,
          (2 * n * dim + dim * N + 2 * n * N + (dD ? dim : 0)) * S);
    return Inner<T>().selective_scan_backward_pairs(dy, u, delta, A, B, C, D, h0, n, dim, N, later_dy, later_delta,
                                                    later_C, later, window, du, ddelta, dA, dB, dC, dD);
  };
  t.silu_forward = [](const T* x, int64_t count, T* y) {
    Count("silu_forward", OpFamily::kPointwise, 0, count * S, count * S);
    Inner<T>().silu_forward(x, count, y);
  };
  t.silu_backward = [](const T* dy, const T* x, int64_t count, T* dx) {
    Count("silu_backward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
    Inner<T>().silu_backward(dy, x, count, dx);
  };
  t.softplus_forward = [](const T* x, int64_t count, T* y) {
    Count("softplus_forward", OpFamily::kPointwise, 0, count * S, count * S);
    Inner<T>().softplus_forward(x, count, y);
  };
  t.softplus_backward = [](const T* dy, const T* x, int64_t count, T* dx) {
    Count("softplus_backward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
    Inner<T>().softplus_backward(dy, x, count, dx);
  };
  if (inner.rope_kv_write)
    t.rope_kv_write = [](const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq,
                         const PagedKV<T>& kv) {
      CountRopeKvWrite("rope_kv_write", n, kv, S, S);
      Inner<T>().rope_kv_write(k, v, n, pos0, inv_freq, kv);
    };
  t.adamw = [](T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step) {
    Count("adamw", OpFamily::kOptimizer, 0, 4 * count * S, 3 * count * S);
    Inner<T>().adamw(p, g, m, v, count, lr, beta1, beta2, eps, weight_decay, step);
  };
  if constexpr (std::is_same_v<T, float>) {
    if (inner.gemm_mixed)
      t.gemm_mixed = [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
                        int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
                        int64_t ldc) {
        const bool all_f32 = a_type == DType::kF32 && b_type == DType::kF32 && c_type == DType::kF32;
        if (!all_f32 && k > 0 && m > 0 && n > 0) {
          // cuBLASLt multiplies bf16 by bf16: an f32 operand is rounded into scratch first
          for (auto [type, elems] : {std::pair{a_type, m * k}, std::pair{b_type, k * n}})
            if (type == DType::kF32) Count("gemm_mixed", OpFamily::kBf16Round, 0, elems * kF32, elems * kBf16);
          CountGemm("gemm_mixed", m, n, k, kBf16, kBf16, Size(c_type), beta != 0.0f);
        } else {
          CountGemm("gemm_mixed", m, n, k, Size(a_type), Size(b_type), Size(c_type), beta != 0.0f);
        }
        Inner<float>().gemm_mixed(ta, tb, m, n, k, alpha, a_type, a, lda, b_type, b, ldb, beta, c_type, c, ldc);
      };
    if (inner.bf16_to_f32)
      t.bf16_to_f32 = [](const uint16_t* src, int64_t count, float* dst) {
        Count("bf16_to_f32", OpFamily::kConvert, 0, count * kBf16, count * kF32);
        Inner<float>().bf16_to_f32(src, count, dst);
      };
    if (inner.f32_to_bf16)
      t.f32_to_bf16 = [](const float* src, int64_t count, uint16_t* dst) {
        Count("f32_to_bf16", OpFamily::kConvert, 0, count * kF32, count * kBf16);
        Inner<float>().f32_to_bf16(src, count, dst);
      };
    if (inner.round_bf16)
      t.round_bf16 = [](float* x, int64_t count, uint16_t* half) {
        Count("round_bf16", OpFamily::kConvert, 0, count * kF32, count * (kF32 + kBf16));
        Inner<float>().round_bf16(x, count, half);
      };
    if (inner.rope_kv_write_bf16)
      t.rope_kv_write_bf16 = [](const float* k, const float* v, int64_t n, int64_t pos0, const double* inv_freq,
                                const PagedKV<uint16_t>& kv) {
        CountRopeKvWrite("rope_kv_write_bf16", n, kv, kF32, kBf16);
        Inner<float>().rope_kv_write_bf16(k, v, n, pos0, inv_freq, kv);
      };
    if (inner.rmsnorm_forward_bf16)
      t.rmsnorm_forward_bf16 = [](const float* x, const float* w, int64_t n, int64_t d, double eps, float* y,
                                  float* rstd, uint16_t* half) {
        Count("rmsnorm_forward_bf16", OpFamily::kNorm, 0, (n * d + d) * kF32,
              (n * d + n) * kF32 + (half ? n * d * kBf16 : 0));
        Inner<float>().rmsnorm_forward_bf16(x, w, n, d, eps, y, rstd, half);
      };
    if (inner.swiglu_forward_bf16)
      t.swiglu_forward_bf16 = [](const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                                 uint16_t* up_half, uint16_t* out_half) {
        const int64_t halves = (gate_half ? 1 : 0) + (up_half ? 1 : 0) + (out_half ? 1 : 0);
        Count("swiglu_forward_bf16", OpFamily::kPointwise, 0, 2 * count * kF32, count * (kF32 + halves * kBf16));
        Inner<float>().swiglu_forward_bf16(gate, up, count, out, gate_half, up_half, out_half);
      };
    if (inner.swiglu_backward_bf16)
      t.swiglu_backward_bf16 = [](const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count,
                                  float* dgate, float* dup) {
        Count("swiglu_backward_bf16", OpFamily::kPointwise, 0, count * (kF32 + 2 * kBf16), 2 * count * kF32);
        Inner<float>().swiglu_backward_bf16(dout, gate, up, count, dgate, dup);
      };
    if (inner.cross_entropy_bf16)
      t.cross_entropy_bf16 = [](uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                const double* row_scale, double grad_scale, double* device_sum) {
        Count("cross_entropy_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4 + (row_scale ? n * 8 : 0),
              n * vocab * kBf16);
        return Inner<float>().cross_entropy_bf16(logits, labels, n, vocab, row_scale, grad_scale, device_sum);
      };
    if (inner.token_logprobs_bf16)
      t.token_logprobs_bf16 = [](const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                 double* out) {
        Count("token_logprobs_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4, n * 8);
        Inner<float>().token_logprobs_bf16(logits, labels, n, vocab, out);
      };
    if (inner.token_argmax_bf16)
      t.token_argmax_bf16 = [](const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                               int32_t* out) {
        Count("token_argmax_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4, n * 4);
        Inner<float>().token_argmax_bf16(logits, labels, n, vocab, out);
      };
    if (inner.attention_forward_bf16)
      t.attention_forward_bf16 = [](const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, float* out,
                                    float* lse, float* ws) {
        CountAttentionForward<float, uint16_t>("attention_forward_bf16", s, kv);
        Inner<float>().attention_forward_bf16(s, q, kv, out, lse, ws);
      };
    if (inner.attention_backward_bf16)
      t.attention_backward_bf16 = [](const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv,
                                     const float* out, const float* lse, const float* dout, float* dq,
                                     const PagedKV<uint16_t>& dkv, float* ws) {
        CountAttentionBackward<float, uint16_t>("attention_backward_bf16", s, kv, dkv);
        Inner<float>().attention_backward_bf16(s, q, kv, out, lse, dout, dq, dkv, ws);
      };
    if (inner.adamw_bf16)
      t.adamw_bf16 = [](uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count,
                        double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
        // master, g, m, v read; master, m, v written, and the weights rounded from the master
        Count("adamw_bf16", OpFamily::kOptimizer, 0, 4 * count * kF32, count * (3 * kF32 + kBf16));
        Inner<float>().adamw_bf16(weights, master, g, m, v, count, lr, beta1, beta2, eps, weight_decay, step);
      };
  }
  return t;
}

// The counting tables of the live scope (rebuilt per scope: the wrapped tables' null entries stay null).
OpTable<float> g_counting_f32;
OpTable<double> g_counting_f64;

}  // namespace

CensusScope::CensusScope(Device d, OpCensus* census) : device_(d) {
  if (g_census) throw std::logic_error("CensusScope: a census is already counting (one at a time)");
  const DeviceBackend* b = FindBackend(d);
  if (!b || !b->f32 || !b->f64) throw std::invalid_argument("CensusScope: the device has no op tables to count");
  previous_ = *b;
  g_census = census;
  g_f32 = b->f32;
  g_f64 = b->f64;
  g_counting_f32 = MakeCounting(*g_f32);
  g_counting_f64 = MakeCounting(*g_f64);
  DeviceBackend counting = previous_;
  counting.f32 = &g_counting_f32;
  counting.f64 = &g_counting_f64;
  RegisterBackend(d, counting);
}

CensusScope::~CensusScope() {
  RegisterBackend(device_, previous_);
  g_census = nullptr;
  g_f32 = nullptr;
  g_f64 = nullptr;
}

}  // namespace sg
