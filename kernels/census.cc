#include "kernels/census.h"

#include <stdexcept>
#include <type_traits>

#include "kernels/ssd_workspace.h"

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

// How many of the keys [0, pos0 + n) lie on the pages kept by keep, from the page holding key_begin (the pages a
// call reads).
template <typename Keep>
int64_t KeyTokens(const AttentionShape& s, int64_t page_size, Keep keep) {
  int64_t tokens = 0;
  const int64_t end = s.pos0 + s.n;
  for (int64_t p = s.key_begin / page_size; p * page_size < end; ++p)
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

// The counting half of each counted op: its arguments, no result; null for the ops that are not counted (LoRA
// dropout, Mamba's A, page sums and scores, the vocabulary shards, the workspace sizes of attention, gated delta and
// SSD). The counters name only the arguments they read, by position in ops.inc's signature; the others are `auto`.
template <typename T>
struct Counters {
#define SG_OP(name, Kernel, ret, params) void(*name) params = nullptr;
#include "kernels/ops.inc"
};

// The bf16 storage entries of the f32 table.
void AddBf16Counters(Counters<float>& c) {
  c.gemm_mixed = [](auto, auto, int64_t m, int64_t n, int64_t k, auto, DType a_type, auto, auto, DType b_type, auto,
                    auto, float beta, DType c_type, auto, auto) {
    const bool all_f32 = a_type == DType::kF32 && b_type == DType::kF32 && c_type == DType::kF32;
    if (!all_f32 && k > 0 && m > 0 && n > 0) {
      // cuBLASLt multiplies bf16 by bf16: an f32 operand is rounded into scratch first
      for (auto [type, elems] : {std::pair{a_type, m * k}, std::pair{b_type, k * n}})
        if (type == DType::kF32) Count("gemm_mixed", OpFamily::kBf16Round, 0, elems * kF32, elems * kBf16);
      CountGemm("gemm_mixed", m, n, k, kBf16, kBf16, Size(c_type), beta != 0.0f);
    } else {
      CountGemm("gemm_mixed", m, n, k, Size(a_type), Size(b_type), Size(c_type), beta != 0.0f);
    }
  };
  c.bf16_to_f32 = [](auto, int64_t count, auto) {
    Count("bf16_to_f32", OpFamily::kConvert, 0, count * kBf16, count * kF32);
  };
  c.f32_to_bf16 = [](auto, int64_t count, auto) {
    Count("f32_to_bf16", OpFamily::kConvert, 0, count * kF32, count * kBf16);
  };
  c.round_bf16 = [](auto, int64_t count, auto) {
    Count("round_bf16", OpFamily::kConvert, 0, count * kF32, count * (kF32 + kBf16));
  };
  c.rope_kv_write_bf16 = [](auto, auto, int64_t n, auto, auto, const PagedKV<uint16_t>& kv) {
    CountRopeKvWrite("rope_kv_write_bf16", n, kv, kF32, kBf16);
  };
  c.rmsnorm_forward_bf16 = [](auto, auto, int64_t n, int64_t d, auto, auto, auto, uint16_t* half) {
    Count("rmsnorm_forward_bf16", OpFamily::kNorm, 0, (n * d + d) * kF32,
          (n * d + n) * kF32 + (half ? n * d * kBf16 : 0));
  };
  c.swiglu_forward_bf16 = [](auto, auto, int64_t count, auto, uint16_t* gate_half, uint16_t* up_half,
                             uint16_t* out_half) {
    const int64_t halves = (gate_half ? 1 : 0) + (up_half ? 1 : 0) + (out_half ? 1 : 0);
    Count("swiglu_forward_bf16", OpFamily::kPointwise, 0, 2 * count * kF32, count * (kF32 + halves * kBf16));
  };
  c.swiglu_backward_bf16 = [](auto, auto, auto, int64_t count, auto, auto) {
    Count("swiglu_backward_bf16", OpFamily::kPointwise, 0, count * (kF32 + 2 * kBf16), 2 * count * kF32);
  };
  c.cross_entropy_bf16 = [](auto, auto, int64_t n, int64_t vocab, const double* row_scale, auto, auto) {
    Count("cross_entropy_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4 + (row_scale ? n * 8 : 0),
          n * vocab * kBf16);
  };
  c.token_logprobs_bf16 = [](auto, auto, int64_t n, int64_t vocab, auto) {
    Count("token_logprobs_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4, n * 8);
  };
  c.token_argmax_bf16 = [](auto, auto, int64_t n, int64_t vocab, auto) {
    Count("token_argmax_bf16", OpFamily::kLoss, 0, n * vocab * kBf16 + n * 4, n * 4);
  };
  c.attention_forward_bf16 = [](const AttentionShape& s, auto, const PagedKV<uint16_t>& kv, auto, auto, auto) {
    CountAttentionForward<float, uint16_t>("attention_forward_bf16", s, kv);
  };
  c.attention_backward_bf16 = [](const AttentionShape& s, auto, const PagedKV<uint16_t>& kv, auto, auto, auto, auto,
                                 const PagedKV<uint16_t>& dkv, auto) {
    CountAttentionBackward<float, uint16_t>("attention_backward_bf16", s, kv, dkv);
  };
  c.adamw_bf16 = [](auto, auto, auto, auto, auto, int64_t count, auto, auto, auto, auto, auto, auto) {
    // master, g, m, v read; master, m, v written, and the weights rounded from the master
    Count("adamw_bf16", OpFamily::kOptimizer, 0, 4 * count * kF32, count * (3 * kF32 + kBf16));
  };
}

template <typename T>
Counters<T> MakeCounters() {
  constexpr int64_t S = sizeof(T);
  Counters<T> c;
  c.gemm = [](auto, auto, int64_t m, int64_t n, int64_t k, auto, auto, auto, auto, auto, T beta, auto, auto) {
    CountGemm("gemm", m, n, k, S, S, S, beta != T(0));
  };
  c.embedding_forward = [](auto, int64_t n, auto, int64_t d, auto) {
    Count("embedding_forward", OpFamily::kEmbedding, 0, n * 4 + n * d * S, n * d * S);
  };
  c.embedding_backward = [](auto, int64_t n, auto, int64_t d, auto) {
    Count("embedding_backward", OpFamily::kEmbedding, 0, n * 4 + 2 * n * d * S, n * d * S);
  };
  c.rmsnorm_forward = [](auto, auto, int64_t n, int64_t d, auto, auto, auto) {
    Count("rmsnorm_forward", OpFamily::kNorm, 0, (n * d + d) * S, (n * d + n) * S);
  };
  c.rmsnorm_backward = [](auto, auto, auto, auto, int64_t n, int64_t d, auto, auto, bool accumulate_dx) {
    // dy, x, w, rstd (and dx when accumulated) read; dx written; dw accumulated
    Count("rmsnorm_backward", OpFamily::kNorm, 0, ((accumulate_dx ? 3 : 2) * n * d + 2 * d + n) * S,
          (n * d + d) * S);
  };
  c.rope = [](auto, int64_t n, int64_t heads, int64_t head_dim, auto, auto, auto) {
    Count("rope", OpFamily::kRope, 0, n * heads * head_dim * S + head_dim / 2 * 8, n * heads * head_dim * S);
  };
  c.add_bias = [](auto, auto, int64_t n, int64_t m) {
    Count("add_bias", OpFamily::kPointwise, 0, (n * m + m) * S, n * m * S);
  };
  c.bias_backward = [](auto, int64_t n, int64_t m, auto) {
    Count("bias_backward", OpFamily::kPointwise, 0, (n * m + m) * S, m * S);
  };
  c.swiglu_forward = [](auto, auto, int64_t count, auto) {
    Count("swiglu_forward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.swiglu_backward = [](auto, auto, auto, int64_t count, auto, auto) {
    Count("swiglu_backward", OpFamily::kPointwise, 0, 3 * count * S, 2 * count * S);
  };
  c.add_inplace = [](auto, auto, int64_t count) {
    Count("add_inplace", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.copy = [](auto, auto, int64_t count) { Count("copy", OpFamily::kPointwise, 0, count * S, count * S); };
  c.fill = [](auto, int64_t count, auto) { Count("fill", OpFamily::kPointwise, 0, 0, count * S); };
  c.scale = [](auto, int64_t count, auto) { Count("scale", OpFamily::kPointwise, 0, count * S, count * S); };
  c.attention_forward = [](const AttentionShape& s, auto, const PagedKV<T>& kv, auto, auto, auto) {
    CountAttentionForward<T, T>("attention_forward", s, kv);
  };
  c.attention_backward = [](const AttentionShape& s, auto, const PagedKV<T>& kv, auto, auto, auto, auto,
                            const PagedKV<T>& dkv, auto) {
    CountAttentionBackward<T, T>("attention_backward", s, kv, dkv);
  };
  // Loss ops read the logits and labels (and row scales); cross-entropy overwrites the logits with the gradient.
  c.cross_entropy_forward_backward = [](auto, auto, int64_t n, int64_t vocab, const double* row_scale, auto, auto) {
    Count("cross_entropy", OpFamily::kLoss, 0, n * vocab * S + n * 4 + (row_scale ? n * 8 : 0), n * vocab * S);
  };
  c.token_logprobs = [](auto, auto, int64_t n, int64_t vocab, auto) {
    Count("token_logprobs", OpFamily::kLoss, 0, n * vocab * S + n * 4, n * 8);
  };
  c.token_argmax = [](auto, auto, int64_t n, int64_t vocab, auto) {
    Count("token_argmax", OpFamily::kLoss, 0, n * vocab * S + n * 4, n * 4);
  };
  c.conv1d_forward = [](auto, const T* tail_in, auto, const T* b, int64_t n, int64_t ch, int64_t k, auto,
                        T* tail_out) {
    const int64_t tail = (k - 1) * ch;
    Count("conv1d_forward", OpFamily::kSsm, 0, (n * ch + (tail_in ? tail : 0) + ch * k + (b ? ch : 0)) * S,
          (n * ch + (tail_out ? tail : 0)) * S);
  };
  c.conv1d_backward = [](auto, const T* dtail_out, auto, const T* tail_in, auto, int64_t n, int64_t ch, int64_t k,
                         auto, T* dtail_in, auto, T* db) {
    const int64_t tail = (k - 1) * ch;
    // dw and db accumulate: read and written
    Count("conv1d_backward", OpFamily::kSsm, 0,
          (2 * n * ch + (dtail_out ? tail : 0) + (tail_in ? tail : 0) + 2 * ch * k + (db ? ch : 0)) * S,
          (n * ch + (dtail_in ? tail : 0) + ch * k + (db ? ch : 0)) * S);
  };
  c.selective_scan_forward = [](auto, auto, auto, auto, auto, const T* D, const T* h0, int64_t n, int64_t dim,
                                int64_t N, auto, T* h_final) {
    Count("selective_scan_forward", OpFamily::kSsm, 0,
          (2 * n * dim + dim * N + 2 * n * N + (D ? dim : 0) + (h0 ? dim * N : 0)) * S,
          (n * dim + (h_final ? dim * N : 0)) * S);
  };
  c.selective_scan_backward = [](auto, const T* dh_final, auto, auto, auto, auto, auto, const T* D, const T* h0,
                                 int64_t n, int64_t dim, int64_t N, auto, auto, auto, auto, auto, T* dD, T* dh0) {
    // dy, u, delta, A, B, C, D, h0, dh_final read; dA, dD accumulated; du, ddelta, dB, dC, dh0 written
    Count("selective_scan_backward", OpFamily::kSsm, 0,
          (3 * n * dim + 2 * dim * N + 2 * n * N + (D ? 2 * dim : 0) + (h0 ? dim * N : 0) +
           (dh_final ? dim * N : 0)) * S,
          (2 * n * dim + dim * N + 2 * n * N + (dD ? dim : 0) + (dh0 ? dim * N : 0)) * S);
  };
  c.selective_scan_backward_pairs = [](auto, auto, auto, auto, auto, auto, const T* D, const T* h0, int64_t n,
                                       int64_t dim, int64_t N, auto, auto, auto, int64_t later, auto, auto, auto,
                                       auto, auto, auto, T* dD) {
    Count("selective_scan_backward_pairs", OpFamily::kSsm, 0,
          (3 * n * dim + 2 * dim * N + 2 * n * N + (D ? 2 * dim : 0) + (h0 ? dim * N : 0) +
           later * (2 * dim + N)) * S,
          (2 * n * dim + dim * N + 2 * n * N + (dD ? dim : 0)) * S);
  };
  c.silu_forward = [](auto, int64_t count, auto) {
    Count("silu_forward", OpFamily::kPointwise, 0, count * S, count * S);
  };
  c.silu_backward = [](auto, auto, int64_t count, auto) {
    Count("silu_backward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.relu2_forward = [](auto, int64_t count, auto) {
    Count("relu2_forward", OpFamily::kPointwise, 0, count * S, count * S);
  };
  c.relu2_backward = [](auto, auto, int64_t count, auto) {
    Count("relu2_backward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.softplus_forward = [](auto, int64_t count, auto) {
    Count("softplus_forward", OpFamily::kPointwise, 0, count * S, count * S);
  };
  c.softplus_backward = [](auto, auto, int64_t count, auto) {
    Count("softplus_backward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.copy_rows = [](auto, auto, auto, auto, int64_t rows, int64_t cols) {
    Count("copy_rows", OpFamily::kPointwise, 0, rows * cols * S, rows * cols * S);
  };
  c.sigmoid_gate_forward = [](auto, auto, int64_t count, auto) {
    Count("sigmoid_gate_forward", OpFamily::kPointwise, 0, 2 * count * S, count * S);
  };
  c.sigmoid_gate_backward = [](auto, auto, auto, int64_t count, auto, auto) {
    Count("sigmoid_gate_backward", OpFamily::kPointwise, 0, 3 * count * S, 2 * count * S);
  };
  c.gdn_gates_forward = [](auto, auto, auto, auto, int64_t n, int64_t heads, auto, auto) {
    Count("gdn_gates_forward", OpFamily::kSsm, 0, (2 * n * heads + 2 * heads) * S, 2 * n * heads * S);
  };
  c.gdn_gates_backward = [](auto, auto, auto, auto, auto, auto, int64_t n, int64_t heads, auto, auto, auto, auto) {
    // dg, dbeta, a, b, a_log, dt_bias read; da, db written; da_log, ddt_bias accumulated
    Count("gdn_gates_backward", OpFamily::kSsm, 0, (4 * n * heads + 4 * heads) * S, (2 * n * heads + 2 * heads) * S);
  };
  // The gated delta rule: its FLOPs are the state products per token and value head (2 dk dv each): forward u, the
  // update and out; backward the two recomputations (u and the update each) and its own seven. Chunked kernels run
  // them as matmuls.
  c.gated_delta_forward = [](auto, auto, auto, auto, auto, const T* s0, int64_t n, int64_t k_heads, int64_t v_heads,
                             int64_t dk, int64_t dv, auto, T* s_final) {
    const int64_t state = v_heads * dk * dv;
    Count("gated_delta_forward", OpFamily::kSsm, 3 * 2 * n * state,
          (2 * n * k_heads * dk + n * v_heads * (dv + 2) + (s0 ? state : 0)) * S,
          (n * v_heads * dv + (s_final ? state : 0)) * S);
  };
  c.gated_delta_backward = [](auto, const T* ds_final, auto, auto, auto, auto, auto, const T* s0, int64_t n,
                              int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, auto, auto, auto, auto, auto,
                              T* ds0, auto) {
    const int64_t state = v_heads * dk * dv;
    // dout, q, k, v, g, beta, s0, ds_final read; dq, dk, dv, dg, dbeta, ds0 written
    Count("gated_delta_backward", OpFamily::kSsm, (2 * 2 + 7) * 2 * n * state,
          (2 * n * k_heads * dk + 2 * n * v_heads * dv + 2 * n * v_heads + (s0 ? state : 0) +
           (ds_final ? state : 0)) * S,
          (2 * n * k_heads * dk + n * v_heads * (dv + 2) + (ds0 ? state : 0)) * S);
  };
  // The router reads the logits and writes probs, top and weights; its backward reads dweights, probs, top and
  // dprobs_extra, and writes dlogits.
  c.moe_route = [](auto, int64_t n, int64_t experts, int64_t k, auto, auto, auto, auto) {
    Count("moe_route", OpFamily::kPointwise, 0, n * experts * S, n * experts * S + n * k * (4 + S));
  };
  c.moe_route_backward = [](auto, auto, auto, int64_t n, int64_t experts, int64_t k, auto, const T* dprobs_extra,
                            auto) {
    Count("moe_route_backward", OpFamily::kPointwise, 0,
          n * experts * S + n * k * (4 + S) + (dprobs_extra ? experts * S : 0), n * experts * S);
  };
  c.gather_rows = [](auto, auto, int64_t rows, int64_t cols, auto) {
    Count("gather_rows", OpFamily::kPointwise, 0, rows * 4 + rows * cols * S, rows * cols * S);
  };
  c.scatter_add_rows = [](auto, auto, const T* scale, int64_t rows, int64_t cols, auto) {
    // src and the destination rows read (and the scales), the destination rows written
    Count("scatter_add_rows", OpFamily::kPointwise, 0, rows * 4 + (scale ? rows * S : 0) + 2 * rows * cols * S,
          rows * cols * S);
  };
  c.row_dots = [](auto, auto, int64_t rows, int64_t cols, auto) {
    Count("row_dots", OpFamily::kPointwise, 0, 2 * rows * cols * S, rows * S);
  };
  // Mamba-2's SSD scan: its FLOPs are the state products per token and head (2 head_dim N each): forward the
  // update and y; backward the two recomputations of the update and its own six (S_t, dC, dS_t, du, d decay, dB).
  c.ssd_forward = [](auto, auto, auto, auto, auto, auto, const T* D, const T* s0, int64_t n, int64_t heads,
                     int64_t head_dim, int64_t groups, int64_t N, auto, auto, auto, T* s_final) {
    const int64_t state = heads * head_dim * N, xs = n * heads * head_dim;
    Count("ssd_forward", OpFamily::kSsm, 2 * 2 * n * state,
          (xs + n * heads + 2 * n * groups * N + (D ? 3 : 2) * heads + (s0 ? state : 0)) * S,
          (xs + (s_final ? state : 0)) * S);
  };
  c.ssd_backward = [](auto, const T* ds_final, auto, auto, auto, auto, auto, auto, const T* D, const T* s0, int64_t n,
                      int64_t heads, int64_t head_dim, int64_t groups, int64_t N, auto, auto, auto, auto, auto, auto,
                      auto, auto, auto, T* ds0, auto) {
    const int64_t state = heads * head_dim * N, xs = n * heads * head_dim, bc = 2 * n * groups * N;
    const int64_t params = D ? 3 : 2, accumulated = params * heads;  // ddt_bias, dA_log, dD read and written
    // dy, x, dt_raw, B, C, the parameters, s0, ds_final read; dx, ddt_raw, dB, dC, ds0 written
    Count("ssd_backward", OpFamily::kSsm, (2 + 6) * 2 * n * state,
          (2 * xs + n * heads + bc + params * heads + accumulated + (s0 ? state : 0) + (ds_final ? state : 0)) * S,
          (xs + n * heads + bc + accumulated + (ds0 ? state : 0)) * S);
  };
  // Adjoint sharding: each pair adds a rank-one product to a state gradient (2 head_dim N), and each token costs a
  // forward step and the backward's own six products.
  c.ssd_backward_pairs = [](auto, auto, auto, auto, auto, auto, auto, const T* D, const T* s0, int64_t n,
                            int64_t heads, int64_t head_dim, int64_t groups, int64_t N, auto, auto, auto, auto, auto,
                            int64_t later, int64_t window, auto, auto, auto, auto, auto, auto, auto, auto) {
    const int64_t state = heads * head_dim * N, xs = n * heads * head_dim, bc = 2 * n * groups * N;
    const int64_t params = D ? 3 : 2, accumulated = params * heads;
    // dy, x, dt_raw, B, C, the parameters, s0 and the later tokens' dy, dt_raw, C read; dx, ddt_raw, dB, dC written
    Count("ssd_backward_pairs", OpFamily::kSsm, 2 * state * (SsdPairs(n, later, window) + 7 * n),
          (2 * xs + n * heads + bc + params * heads + accumulated + (s0 ? state : 0) +
           later * (heads * head_dim + heads + groups * N)) * S,
          (xs + n * heads + bc + accumulated) * S);
  };
  c.gated_group_rmsnorm_forward = [](auto, auto, auto, int64_t rows, int64_t dim, int64_t group_size, auto, auto,
                                     auto) {
    Count("gated_group_rmsnorm_forward", OpFamily::kNorm, 0, (2 * rows * dim + dim) * S,
          (rows * dim + rows * dim / group_size) * S);
  };
  c.gated_group_rmsnorm_backward = [](auto, auto, auto, auto, auto, int64_t rows, int64_t dim, int64_t group_size,
                                      auto, auto, auto, auto) {
    // dout, x, z, w, rstd, dw read; dx, dz, dw written
    Count("gated_group_rmsnorm_backward", OpFamily::kNorm, 0, (3 * rows * dim + 2 * dim + rows * dim / group_size) * S,
          (2 * rows * dim + dim) * S);
  };
  c.adamw = [](auto, auto, auto, auto, int64_t count, auto, auto, auto, auto, auto, auto) {
    Count("adamw", OpFamily::kOptimizer, 0, 4 * count * S, 3 * count * S);
  };
  // Attention over page groups: each group's output and logsumexp merged into the running ones (4 flops a value).
  c.attention_merge = [](const AttentionShape& s, auto, auto, auto, auto) {
    const int64_t values = s.n * s.heads * s.head_dim, rows = s.n * s.heads;
    Count("attention_merge", OpFamily::kPointwise, 4 * values, (2 * values + 2 * rows) * S, (values + rows) * S);
  };
  c.rope_kv_write = [](auto, auto, int64_t n, auto, auto, const PagedKV<T>& kv) {
    CountRopeKvWrite("rope_kv_write", n, kv, S, S);
  };
  if constexpr (std::is_same_v<T, float>) AddBf16Counters(c);
  return c;
}

template <typename T>
const Counters<T>& CountersFor() {
  static const Counters<T> counters = MakeCounters<T>();
  return counters;
}

// Counted<Op, Counter>::Call has the op's signature: it counts the call, then forwards it to the wrapped table.
template <auto Op, auto Counter>
struct Counted;
template <typename T, typename R, typename... A, R (*OpTable<T>::*Op)(A...), void (*Counters<T>::*Counter)(A...)>
struct Counted<Op, Counter> {
  static R Call(A... args) {
    (CountersFor<T>().*Counter)(args...);
    return (Inner<T>().*Op)(args...);
  }
};

// The inner table with its counted entries wrapped; entries the inner table lacks stay null.
template <typename T>
OpTable<T> MakeCounting(const OpTable<T>& inner) {
  const Counters<T>& counters = CountersFor<T>();
  OpTable<T> t = inner;
#define SG_OP(name, Kernel, ret, params) \
  if (inner.name && counters.name) t.name = &Counted<&OpTable<T>::name, &Counters<T>::name>::Call;
#include "kernels/ops.inc"
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
