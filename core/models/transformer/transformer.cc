#include "core/models/transformer/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/expert_offload.h"
#include "core/kv_offload.h"
#include "core/kv_pages.h"
#include "core/objective.h"
#include "core/paged_attention.h"
#include "core/param_store.h"
#include "core/tensor_parallel.h"
#include "kernels/backend.h"

namespace sg {

RopeParameters RopeFor(const TransformerConfig& c, int64_t seq_len) {
  const RopeScaling& s = c.rope_scaling;
  const int64_t half = c.rotary_dim() / 2;
  const double dim = static_cast<double>(c.rotary_dim());
  // NTK-aware dynamic: the base grows with the sequence once it is past max_position_embeddings.
  const double base = s.type == "dynamic" ? DynamicRopeBase(c, seq_len) : c.rope_theta;
  RopeParameters r;
  r.inv_freq.resize(half);
  for (int64_t i = 0; i < half; ++i) r.inv_freq[i] = 1.0 / std::pow(base, 2.0 * i / dim);
  if (s.type == "linear") {
    for (double& f : r.inv_freq) f /= s.factor;
  } else if (s.type == "yarn") {
    auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    r.attention_factor = s.attention_factor > 0 ? s.attention_factor
                         : (s.mscale != 0 && s.mscale_all_dim != 0)
                             ? mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
                             : mscale(s.factor, 1);
    // The dimensions that turn fewer than beta_slow times over the original context are interpolated (divided
    // by factor), those that turn more than beta_fast times kept; a linear ramp between.
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(old_ctx / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
    if (s.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double f = r.inv_freq[i];
      r.inv_freq[i] = f / s.factor * ramp + f * (1 - ramp);
    }
  } else if (s.type == "llama3") {
    // Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_ctx / s.low_freq_factor;
    const double high_wavelen = old_ctx / s.high_freq_factor;
    for (double& f : r.inv_freq) {
      const double wavelen = 2 * M_PI / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f /= s.factor;
      } else {
        const double smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return r;
}

namespace {

// Gated DeltaNet's state at a chunk boundary (or its gradient): the delta rule's state and the conv's tail.
struct LinearBoundary {
  Tensor s;     // [value_heads][key_head_dim][value_head_dim]
  Tensor tail;  // [conv_kernel - 1][conv channels]
  // With offload: s's bytes then tail's, in host memory from the copy engine, while s and tail are released.
  std::shared_ptr<char> host;
};

// Adjoint sharding relays to the chunk before, instead of a Mamba-2 layer's scan state gradient, what the pairs
// (t, i) of earlier chunks read: the scan output cotangents, raw time steps and C of the adjoint_window - 1 tokens
// from `begin` on.
struct LaterTokens {
  int64_t begin = 0, rows = 0;
  Tensor dy, dt, C;  // [rows][intermediate], [rows][heads], [rows][groups x state]
};

// The state of a sequence: KV pages of the attention layers, numbered among themselves (`kv_index`: a model layer's
// number in the pools, -1 for a Gated DeltaNet layer), and the linear layers' boundary states. Every method below
// but the SequenceState overrides takes attention layers by their number in the pools.
class TransformerState final : public SequenceState {
 public:
  // offload_copies: the device's copy engine when the pools hold only KvOffload::kSlots layers (StateOptions::offload).
  TransformerState(PagePool kv_pool, PagePool grad_pool, const StateOptions& opts, std::vector<int> kv_index,
                   int layers, const CopyEngine* offload_copies, std::vector<double> inv_freq)
      : kv(std::move(kv_pool)),
        grad(std::move(grad_pool)),
        seq_len(opts.seq_len),
        opts(opts),
        kv_index(std::move(kv_index)),
        layers(layers),
        inv_freq(std::move(inv_freq)) {
    if (offload_copies)
      offload = std::make_unique<KvOffload>(kv, opts.resident_grad_layers > 0 ? &grad : nullptr, *offload_copies,
                                            layers, opts.seq_len);
    linear_copies = offload_copies;
  }
  void Release(int model_layer, int64_t from) override {
    // Later tokens are read by positions before them (and replaced by each backward); none are left before 0.
    if (from == 0) later.erase(model_layer);
    // Recurrent boundaries (Gated DeltaNet, Mamba-2, Falcon-H1's beside attention): a boundary b belongs to position
    // b - 1, so positions >= from own the boundaries b > from.
    for (auto* m : {&linear_cache, &linear_grad})
      m->erase(m->upper_bound({model_layer, from}), m->lower_bound({model_layer + 1, 0}));
    const int layer = kv_index[model_layer];
    if (layer < 0) return;
    if (offload) offload->Release(layer, from);
    kv.Release(layer, from);
    grad.Release(layer, from);
    if (layer < static_cast<int>(kv_end.size())) kv_end[layer] = std::min(kv_end[layer], from);
  }
  // A linear layer's boundary state at b (of `model_layer`), or null.
  static LinearBoundary* Find(std::map<std::pair<int, int64_t>, LinearBoundary>& m, int model_layer, int64_t b) {
    auto it = m.find({model_layer, b});
    return it == m.end() ? nullptr : &it->second;
  }
  // K/V of positions [0, kv_end[layer]) are in the cache: a chunk inside it is recomputed (seco's stage 2,
  // streambp's partitions) without projecting its K/V again; the values would be bit-identical.
  bool HoldsKV(int layer, Chunk c) const { return c.end <= KvEnd(layer); }
  int64_t KvEnd(int layer) const { return layer < static_cast<int>(kv_end.size()) ? kv_end[layer] : 0; }
  void MarkKV(int layer, Chunk c) {
    if (layer >= static_cast<int>(kv_end.size())) kv_end.resize(layer + 1, 0);
    if (c.begin <= kv_end[layer]) kv_end[layer] = std::max(kv_end[layer], c.end);
  }
  void ScaleGrad(int model_layer, Chunk c, double factor) override {
    if (kv_index[model_layer] >= 0) return grad.Scale(kv_index[model_layer], c.begin, c.end, factor);
    if (LinearBoundary* g = Find(linear_grad, model_layer, c.end)) {  // what later chunks relayed to c
      ScaleTensor(g->s, factor);
      ScaleTensor(g->tail, factor);
    }
  }
  void SkipGrad(Chunk c) override { grad.SkipRows(c.begin, c.end, seq_len); }
  int64_t AdjointPairs() const override { return adjoint_pairs; }
  int64_t OffloadedBytes() const override { return (offload ? offload->host_bytes() : 0) + linear_host_bytes; }

  // With offload, a linear layer's boundary state waits in host memory from the chunk that writes it to the chunks
  // that read it (the forward after it, its recompute), as attention's pages do: the device then holds a few
  // layers' states whatever T. Stash moves b's state home and releases it on the device; Load reads it (home or on
  // the device) into s and tail.
  void StashLinear(LinearBoundary& b) {
    if (!linear_copies) return;
    const size_t s_bytes = b.s.nbytes(), tail_bytes = b.tail.nbytes();
    if (!b.host) {
      const CopyEngine* copies = linear_copies;
      b.host = std::shared_ptr<char>(static_cast<char*>(copies->alloc_host(s_bytes + tail_bytes)),
                                     [copies](char* p) { copies->free_host(p); });
      linear_host_bytes += static_cast<int64_t>(s_bytes + tail_bytes);
    }
    linear_copies->copy_async(b.host.get(), b.s.raw(), s_bytes, KvOffload::kWriteBackLane);
    linear_copies->copy_async(b.host.get() + s_bytes, b.tail.raw(), tail_bytes, KvOffload::kWriteBackLane);
    linear_copies->wait(KvOffload::kWriteBackLane);
    b.s.Reset();
    b.tail.Reset();
  }
  void LoadLinear(const LinearBoundary& b, Tensor& s, Tensor& tail) {
    if (b.s.defined()) {
      CopyTensor(s, b.s);
      CopyTensor(tail, b.tail);
      return;
    }
    linear_copies->copy_async(s.raw(), b.host.get(), s.nbytes(), KvOffload::kFetchLane);
    linear_copies->copy_async(tail.raw(), b.host.get() + s.nbytes(), tail.nbytes(), KvOffload::kFetchLane);
    linear_copies->wait(KvOffload::kFetchLane);
  }

  // How a layer is visited: forward without a graph (seco's stage 1), forward keeping what its backward needs
  // (the recompute of stage 2), backward.
  enum class Pass { kForward, kForwardForBackward, kBackward };
  // The visit the chunked schedule makes after `pass` over layer l of `count` (KV offload's and expert offload's
  // prefetch): forward l -> l + 1, the last layer -> layer 0 of the next chunk or, keeping the graph, its own
  // backward; backward l -> l - 1 (layer -1: none).
  struct Visit {
    int layer = -1;
    Pass pass = Pass::kForward;
    bool next_chunk = false;
  };
  static Visit NextVisit(int l, int count, Pass pass) {
    if (pass == Pass::kBackward) return {l - 1, pass};
    if (l + 1 < count) return {l + 1, pass};
    return pass == Pass::kForward ? Visit{0, pass, true} : Visit{l, Pass::kBackward};
  }
  // With offload, before layer l runs `pass` on chunk c: makes its pages resident and prefetches the next visit.
  void PrepareLayer(int l, Chunk c, Pass pass) {
    if (!offload) return;
    const Visit v = NextVisit(l, layers, pass);
    LayerAccess next;
    if (v.layer >= 0) next = Access(v.layer, v.next_chunk ? Chunk{c.end, c.end} : c, v.pass);
    offload->Visit(Access(l, c, pass), next);
  }
  // With offload, after sparse attention selected chunk c's pages in layer l: brings them to the device.
  void RequireSelected(int l, Chunk c, Pass pass) {
    if (offload) offload->Require(Access(l, c, pass));
  }
  // Sparse attention's page mask of chunk c in layer l, as far as it is known before the chunk's queries are: the
  // stored selection, else the pages always kept (the first page, the chunk's pages and the one before); empty: dense.
  std::vector<uint8_t> KnownPages(int l, Chunk c) const {
    if (auto it = selection.find({l, c.begin}); it != selection.end()) return it->second;
    return KeptPages(c);
  }
  // Sparse attention's pages always kept for chunk c (empty: dense, when there are no more than sparse_pages
  // candidates, the earlier pages first + 1 .. first_local - 2; with a first page past 0, every page from it).
  std::vector<uint8_t> KeptPages(Chunk c) const {
    const int64_t ps = kv.page_size(), first_local = c.begin / ps, pages = (c.end + ps - 1) / ps;
    const int64_t first = FirstPage(c);
    if (opts.sparse_pages <= 0) return {};
    const bool all = first_local - 2 - first <= opts.sparse_pages;
    if (all && first == 0) return {};
    std::vector<uint8_t> mask(pages, 0);
    mask[first] = 1;
    for (int64_t p = all ? first : first_local - 1; p < pages; ++p) mask[p] = 1;
    return mask;
  }
  // The page sparse attention keeps as chunk c's first: page 0, or with packed documents the page where the
  // chunk's first document starts (pages before it belong to other documents and are never selected).
  int64_t FirstPage(Chunk c) const { return DocumentStart(opts.doc_starts, c.begin) / kv.page_size(); }

  PagePool kv;
  PagePool grad;
  int64_t seq_len;
  StateOptions opts;
  std::vector<int> kv_index;
  int layers;  // attention layers
  // Gated DeltaNet layers: by (model layer, boundary b > 0) the state of positions < b (boundary 0 is the zero
  // state, never stored), and the gradients later chunks relayed to those states.
  std::map<std::pair<int, int64_t>, LinearBoundary> linear_cache, linear_grad;
  // Mamba-2 layers under adjoint sharding (opts.adjoint_window > 0): by model layer, the tokens relayed instead of
  // the scan state gradient (linear_grad then holds only the conv tail's), and the pairs (t, i) per head so far.
  std::map<int, LaterTokens> later;
  int64_t adjoint_pairs = 0;
  const CopyEngine* linear_copies = nullptr;  // with offload
  int64_t linear_host_bytes = 0;
  std::vector<double> inv_freq;  // RoPE of this sequence (the dynamic type depends on its length)
  std::vector<int64_t> kv_end;
  // Sparse attention: the page mask of each (layer, chunk begin), chosen by the first pass over the chunk (the
  // pass without gradients) and reused unchanged by its recompute and backward.
  std::map<std::pair<int, int64_t>, std::vector<uint8_t>> selection;
  // Sparse attention: per layer, [page][kv_heads * head_dim] f64 sums of each complete page's cached keys, on the
  // model's device (in the KV cache's category), so that pages are scored without being on the device.
  std::vector<Tensor> key_sums;
  std::unique_ptr<KvOffload> offload;  // declared after the pools: destroyed (waiting for its copies) first

  // What attention over layer l's pages reads and writes (core/paged_attention.h).
  PagedAttention AttentionPages(int l, const uint8_t* selected, MemoryTracker* memory) {
    return {&kv,   &grad, l, selected, AttentionGroupPages(opts), KvOffload::Streams(opts) ? offload.get() : nullptr,
            memory};
  }

 private:
  LayerAccess Access(int l, Chunk c, Pass pass) const {
    LayerAccess a;
    a.layer = l;
    a.kv_rows = std::min(c.end, KvEnd(l));
    if (pass != Pass::kBackward && !HoldsKV(l, c)) a.kv_appended = c;
    if (pass == Pass::kBackward) a.grad_rows = c.end;
    // Streamed (dense offload), a layer keeps on the device only its chunk's pages; attention streams the others.
    a.pages = KvOffload::Streams(opts) ? KvOffload::ChunkPageMask(c, kv.page_size()) : KnownPages(l, c);
    return a;
  }
};

// Gated DeltaNet's parameters: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, or Qwen3-Next's fused
// in_proj_qkvz and in_proj_ba (the others -1).
struct DeltaNetParams {
  int qkv = -1, z = -1, b = -1, a = -1, qkvz = -1, ba = -1, conv = -1, dt_bias = -1, a_log = -1, norm = -1, out = -1;
};

// Mamba-2's parameters (Mamba2Mixer's; -1 for the biases a config leaves out).
struct Mamba2Params {
  int in_proj = -1, in_bias = -1, conv = -1, conv_bias = -1, dt_bias = -1, a_log = -1, d = -1, norm = -1, out = -1,
      out_bias = -1;
};

// A sparse MoE block's parameters: the router (mlp.gate), the experts' fused gate/up [E][2I][d] and down [E][d][I]
// projections, and the shared expert (its gate/up/down and its sigmoid gate [1][d]; -1 without one).
struct MoeParams {
  int router = -1, gate_up = -1, down = -1, shared_gate = -1, shared_up = -1, shared_down = -1, shared_router = -1;
  int index = -1;  // the layer's number among the MoE layers (expert offload's)
};

// Indices into params() for one decoder layer; -1 where a bias or q/k norm is absent, and the attention's in a
// layer whose mixer has none.
struct LayerParams {
  int norm1 = -1, q = -1, q_bias = -1, k = -1, k_bias = -1, v = -1, v_bias = -1, o = -1, o_bias = -1, norm2 = -1;
  int gate = -1, gate_bias = -1, up = -1, up_bias = -1, down = -1, down_bias = -1, q_norm = -1, k_norm = -1;
  Mixer mixer = Mixer::kAttention;
  Mlp mlp = Mlp::kSwiGlu;
  DeltaNetParams delta;
  Mamba2Params mamba;
  bool moe = false;  // a sparse MoE block instead of the dense MLP
  MoeParams experts;
};

// The gated delta rule's inputs: q, k (L2-normed, q scaled; with their raw values and rstd for the backward), v,
// g and beta.
struct DeltaInputs {
  Tensor q_raw, k_raw, q, k, q_rstd, k_rstd, v, g, beta;
};

// Mamba-2's scan inputs: x [n][intermediate], B and C [n][groups x state], the columns of silu(xc).
struct SsdInputs {
  Tensor x, B, C;
};

// The tokens each expert of a MoE layer takes in a chunk, grouped by expert (tokens in order): their rows in the
// chunk, their slots in the router's [n][k] outputs and each one's routing weight, on the model's device (for
// gather_rows / scatter_add_rows); iota is 0, 1, .. n - 1 there.
struct ExpertGroups {
  std::vector<int64_t> begin;  // expert e's assignments are [begin[e], begin[e + 1])
  Tensor row_index, slot_index, weight, iota;
  int64_t size(int64_t e) const { return begin[e + 1] - begin[e]; }
  const int32_t* rows(int64_t e) const { return row_index.data<int32_t>() + begin[e]; }
  const int32_t* slots(int64_t e) const { return slot_index.data<int32_t>() + begin[e]; }
  const int32_t* identity() const { return iota.data<int32_t>(); }
  template <typename T>
  const T* scale(int64_t e) const {
    return weight.data<T>() + begin[e];
  }
};

// Order of LayerSaved::tensors; kQRaw / kQRstd (q before its per-head norm, and the norm's rstd) only with q/k norm,
// kQGate (gated attention's output gate) only in hybrids. Gated DeltaNet layers keep x, the norms' and the MLP's
// like attention layers, and kMixed (the conv's input), kXc (its output), kBA (b and a), kS0 and kTail0 (the state
// before the chunk), kCore (the delta rule's output), kCoreRstd, kZ, kNormed and kGated (the gated norm's). MoE
// layers keep the router's kProbs, kTop and kRouteWeights instead of gate, up and the SwiGLU output.
// clang-format off
enum Saved {
  kX, kXn1, kRstd1, kQ, kAttn, kLse, kH, kXn2, kRstd2, kGate, kUp, kAct, kQRaw, kQRstd, kQGate,
  kMixed, kXc, kBA, kS0, kTail0, kCore, kCoreRstd, kZ, kNormed, kGated, kProbs, kTop, kRouteWeights, kNumSaved
};
// clang-format on

template <typename T>
class Transformer final : public TransformerModel, public TensorParallelModel, private ParamStore<T> {
  using Store = ParamStore<T>;
  using Store::Add;
  using Store::G;
  using Store::GradOrScratch;
  using Store::mem_;
  using Store::New;
  using Store::params_;
  using Store::W;

 public:
  // tp: this rank's place in its tensor-parallel group (core/tensor_parallel.h); the config must split over it.
  Transformer(const TransformerConfig& c, Device device, DType weights, const TensorParallel& tp, bool frozen_base,
              bool offload_experts)
      : cfg_(c),
        ops_(OpsFor<T>(device)),
        attention_factor_(RopeFor(c, 0).attention_factor),
        tp_(tp),
        heads_(c.num_heads / tp.size),
        kv_heads_(c.num_kv_heads / tp.size),
        inter_(c.intermediate_size / tp.size),
        vocab_rows_(c.vocab_size / tp.size) {
    mem_.set_device(device);
    if (absl::Status s = Store::SetWeightDType(weights); !s.ok()) throw std::invalid_argument(std::string(s.message()));
    Store::SetFrozenBase(frozen_base);
    const int64_t d = c.hidden_size;
    // Column-parallel (rows of [out][in] split), row-parallel (columns split), replicated; see tensor_parallel.h.
    const TpShard rows{TpSplit::kRows}, whole{};
    auto add = [&](const std::string& name, std::vector<int64_t> shape, TpShard shard) {
      shards_.push_back(shard);
      return Add(name, std::move(shape));
    };
    const ParamNames names = NamesOf(c);
    embed_ = add(names.embed, {vocab_rows_, d}, rows);
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat(names.layers, i, ".");
      LayerParams L;
      L.mixer = c.mixer(i);
      L.mlp = c.mlp(i);
      kv_index_.push_back(c.has_attention(i) ? kv_layers_++ : -1);
      if (L.mixer != Mixer::kNone) L.norm1 = add(p + names.norm1, {d}, whole);
      if (L.mixer == Mixer::kDeltaNet) L.delta = AddDeltaNet(p + "linear_attn.", add);
      if (c.has_mamba(i)) L.mamba = AddMamba2(p + names.mamba, add);
      if (c.has_attention(i)) AddAttention(p + names.attention, L, add);
      if (L.mlp != Mlp::kNone) {
        L.norm2 = add(p + names.norm2, {d}, whole);
        AddMlp(p + names.mlp, L, add);
      }
      if (offload_experts && L.moe) MoveExpertsHome(L);  // before the next layer's: one layer's on the device at most
      layers_.push_back(L);
    }
    final_norm_ = add(names.final_norm, {d}, whole);
    head_ = c.tie_word_embeddings ? embed_ : add("lm_head.weight", {vocab_rows_, d}, rows);
    InitUnitWeights();
  }

  // Where a model's parameters live: transformers' names of each architecture.
  struct ParamNames {
    std::string embed, layers, norm1, attention, mamba, norm2, mlp, final_norm;
  };
  static ParamNames NamesOf(const TransformerConfig& c) {
    const std::string& a = c.architecture;
    if (a == "mamba2")
      return {"backbone.embeddings.weight", "backbone.layers.", "norm.weight", "", "mixer.", "", "",
              "backbone.norm_f.weight"};
    // transformers 5.23 saves Nemotron-H as published, under backbone. (model. in memory)
    if (a == "nemotron_h")
      return {
          "backbone.embeddings.weight", "backbone.layers.", "norm.weight", "mixer.", "mixer.", "norm.weight", "mixer.",
          "backbone.norm_f.weight"};
    if (a == "bamba" || a == "falcon_h1")
      return {"model.embed_tokens.weight", "model.layers.", "input_layernorm.weight",      "self_attn.", "mamba.",
              "pre_ff_layernorm.weight",   "feed_forward.", "model.final_layernorm.weight"};
    return {c.prefix() + "embed_tokens.weight",
            c.prefix() + "layers.",
            "input_layernorm.weight",
            "self_attn.",
            "",
            "post_attention_layernorm.weight",
            "mlp.",
            c.prefix() + "norm.weight"};
  }

  // Attention's parameters under p ("...self_attn."). Gated attention's q_proj gives each head's query and then
  // its output gate.
  template <typename AddFn>
  void AddAttention(const std::string& p, LayerParams& L, AddFn& add) {
    const TransformerConfig& c = cfg_;
    const int64_t d = c.hidden_size, qd = heads_ * c.head_dim, kvd = kv_heads_ * c.head_dim;
    const int64_t q_rows = (c.hybrid() ? 2 : 1) * qd;
    const TpShard rows{TpSplit::kRows}, cols{TpSplit::kCols}, whole{}, partial{TpSplit::kReplicated, true};
    {
      L.q = add(p + "q_proj.weight", {q_rows, d}, rows);
      L.q_bias = c.attention_bias ? add(p + "q_proj.bias", {q_rows}, rows) : -1;
      L.k = add(p + "k_proj.weight", {kvd, d}, rows);
      L.k_bias = c.attention_bias ? add(p + "k_proj.bias", {kvd}, rows) : -1;
      L.v = add(p + "v_proj.weight", {kvd, d}, rows);
      L.v_bias = c.attention_bias ? add(p + "v_proj.bias", {kvd}, rows) : -1;
      L.o = add(p + "o_proj.weight", {d, qd}, cols);
      L.o_bias = c.o_bias() ? add(p + "o_proj.bias", {d}, whole) : -1;
      L.q_norm = c.qk_norm() ? add(p + "q_norm.weight", {c.head_dim}, partial) : -1;
      L.k_norm = c.qk_norm() ? add(p + "k_norm.weight", {c.head_dim}, partial) : -1;
    }
  }

  // Unit norms: weights of 1, or of 0 where the norm multiplies by 1 + w (the hybrids'); Gated DeltaNet's and
  // Mamba-2's dt_bias 1 and A_log 0 (A = -1), Mamba-2's D 1.
  void InitUnitWeights() {
    const T unit = cfg_.hybrid() ? T(0) : T(1);
    auto fill = [&](int idx, T value) {
      if (idx >= 0) ops_.fill(W(idx), params_[idx].value.numel(), value);
    };
    for (const LayerParams& L : layers_) {
      for (int idx : {L.norm1, L.norm2, L.q_norm, L.k_norm}) fill(idx, unit);
      for (int idx : {L.delta.norm, L.delta.dt_bias, L.mamba.norm, L.mamba.dt_bias, L.mamba.d}) fill(idx, T(1));
    }
    fill(final_norm_, unit);
  }

  std::string family() const override { return "transformer"; }
  ScanLayers scan_layers() const override {
    if (cfg_.mamba_layer_count() == 0) return ScanLayers::kNone;
    const int64_t L = cfg_.num_layers;
    return cfg_.mixer_count(Mixer::kMamba2) == L && cfg_.mlp_count(Mlp::kNone) == L ? ScanLayers::kAll
                                                                                    : ScanLayers::kSome;
  }
  std::string architecture() const override { return cfg_.architecture; }
  // KV-cache and KV-gradient pages: bf16 under --dtype=bf16, else the compute dtype.
  DType KVDType() const { return Store::weight_dtype_ == DType::kBF16 ? DType::kBF16 : dtype(); }
  DType dtype() const override { return Store::kDType; }
  int num_layers() const override { return static_cast<int>(cfg_.num_layers); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t hidden_size() const override { return cfg_.hidden_size; }
  std::vector<Param>& params() override { return params_; }
  MemoryTracker& memory() override { return mem_; }
  const TransformerConfig& config() const override { return cfg_; }
  void set_lm_chunk(int64_t rows) override { Store::SetLmChunk(rows); }
  int64_t StateBytesPerToken() const override {
    return 2 * kv_layers_ * kv_heads_ * cfg_.head_dim * static_cast<int64_t>(DTypeSize(KVDType()));
  }
  absl::Status EnableLora(const LoraOptions& o) override {
    if (absl::Status s = CheckPeftMoeTargets(o); !s.ok()) return s;
    std::vector<int> linears, experts;
    for (const LayerParams& L : layers_) {
      const DeltaNetParams& P = L.delta;
      const MoeParams& M = L.experts;
      for (int w : {L.q, L.k, L.v, L.o, P.qkv, P.z, P.b, P.a, P.qkvz, P.ba, P.out, L.mamba.in_proj, L.mamba.out, L.gate,
                    L.up, L.down, M.shared_gate, M.shared_up, M.shared_down})
        if (w >= 0) linears.push_back(w);
      for (int w : {M.gate_up, M.down})  // in the module's parameter order, as PEFT nests their wrappers
        if (w >= 0) experts.push_back(w);
    }
    if (absl::Status s = Store::EnableLoraOn(o, LoraKind::Of(*this), linears, experts); !s.ok()) return s;
    Store::lora_col0_ = LoraFirstColumns(shards_, *Store::LoraState(), tp_.rank);  // dropout masks
    return absl::OkStatus();
  }
  // PEFT 0.21 reads target_modules gate_proj, up_proj and down_proj of a qwen3_moe or qwen3_next model (any such
  // path, on every load) as transformers 4's per-expert modules and turns them into target_parameters of the fused
  // experts (gate_up_proj with a doubled rank), leaving the shared expert's and dense layers' modules unadapted.
  absl::Status CheckPeftMoeTargets(const LoraOptions& o) const {
    if (cfg_.architecture != "qwen3_moe" && cfg_.architecture != "qwen3_next") return absl::OkStatus();
    for (const std::string& t : o.targets)
      if (t == "gate_proj" || t == "up_proj" || t == "down_proj")
        return absl::InvalidArgumentError(absl::StrCat(
            "--lora_targets: '", t, "' on a ", cfg_.architecture, " model: PEFT 0.21 retargets a ", t,
            " module target to the fused experts (target_parameters), so its adapter could not be loaded there; ",
            "adapt the experts with experts.gate_up_proj, experts.down_proj"));
    return absl::OkStatus();
  }
  const TensorParallel& tensor_parallel() const override { return tp_; }

  // Expert offload (core/expert_offload.h) needs MoE layers whose expert weights have no gradient.
  absl::Status CheckExpertOffload() const override {
    std::vector<int> experts;
    for (const LayerParams& L : layers_)
      if (L.moe) experts.insert(experts.end(), {L.experts.gate_up, L.experts.down});
    if (experts.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("--offload_experts: this ", cfg_.architecture, " model has no mixture-of-experts layers"));
    for (int w : experts)
      if (params_[w].grad.defined())
        return absl::InvalidArgumentError(absl::StrCat(
            "--offload_experts keeps the expert weights in host memory and needs them frozen (a LoRA run's base), "
            "but ",
            params_[w].name, " is trained: add --lora_rank"));
    return absl::OkStatus();
  }
  absl::Status OffloadExperts() override {
    if (expert_offload_) return absl::OkStatus();
    if (absl::Status s = CheckExpertOffload(); !s.ok()) return s;
    const DeviceBackend* backend = FindBackend(mem_.device());
    if (!backend) return absl::FailedPreconditionError("--offload_experts: no backend for the model's device");
    for (const LayerParams& L : layers_)
      if (L.moe) MoveExpertsHome(L);
    return absl::OkStatus();
  }
  // The layer's expert weights to host memory (ExpertOffload::AddLayer): the parameters' values become their homes,
  // and the device copies go.
  void MoveExpertsHome(const LayerParams& L) {
    if (!expert_offload_) {
      const DeviceBackend* backend = FindBackend(mem_.device());
      if (!backend) throw std::invalid_argument("--offload_experts: no backend for the model's device");
      expert_offload_ = std::make_unique<ExpertOffload>(mem_, backend->copies);
    }
    const std::vector<Tensor>& homes =
        expert_offload_->AddLayer({params_[L.experts.gate_up].value, params_[L.experts.down].value});
    params_[L.experts.gate_up].value = homes[0];
    params_[L.experts.down].value = homes[1];
  }
  int64_t OffloadedWeightBytes() const override { return expert_offload_ ? expert_offload_->host_bytes() : 0; }

  // The load-balancing loss (transformers' load_balancing_loss_func with output_router_logits), over the R rows of
  // every MoE layer and input token of the batch: E sum_e f_e P_e with f_e the share of top-k picks of expert e
  // and P_e its mean probability, both over R. Only P carries a gradient: coef E f_e / R on every row's probability
  // of e, which MoeBackward adds once the statistics pass has counted the picks.
  bool HasBatchLoss() const override { return cfg_.moe.aux_loss && !cfg_.moe_layers.empty(); }
  void StartBatchStatistics() override {
    routing_ = RoutingStatistics{};
    routing_.collecting = true;
    routing_.picks.assign(cfg_.moe.experts, 0.0);
    routing_.probs.assign(cfg_.moe.experts, 0.0);
  }
  double FinishBatchStatistics() override {
    routing_.collecting = false;
    const int64_t E = cfg_.moe.experts;
    const double R = static_cast<double>(std::max<int64_t>(1, routing_.rows)), coef = cfg_.moe.aux_loss_coef;
    double aux = 0;
    std::vector<T> grad(E);
    for (int64_t e = 0; e < E; ++e) {
      aux += (routing_.picks[e] / R) * (routing_.probs[e] / R);
      grad[e] = static_cast<T>(coef * static_cast<double>(E) * routing_.picks[e] / (R * R));
    }
    routing_.grad = New(MemCategory::kWorkspace, {E});
    CopyFromHost(routing_.grad, grad.data());
    return coef * static_cast<double>(E) * aux;
  }
  void EndBatchLoss() override { routing_ = RoutingStatistics{}; }

  // An adapter meets its weight's split (ShardOfParam).
  TpShard ShardOf(int param) const override { return ShardOfParam(shards_, Store::LoraState(), param); }
  const LoraInfo* lora() const override { return Store::LoraState(); }

  std::unique_ptr<SequenceState> NewState(const StateOptions& o) override {
    if (expert_offload_) expert_offload_->Forget();  // a sequence's pass reads the experts as they are now
    const int64_t pages_per_layer = (o.seq_len + o.page_size - 1) / o.page_size;
    // Offloaded sparse attention keeps on the device only the pages a chunk reads (KvOffload drops the others);
    // offloaded dense attention only the chunk's own pages, plus a ring of page groups it streams the others through.
    const bool streams = KvOffload::Streams(o);
    const int64_t pages_per_slot =
        o.offload && o.sparse_pages > 0 && o.chunk > 0
            ? std::min(pages_per_layer, KvOffload::SparsePagesPerLayer(o.sparse_pages, o.chunk, o.page_size))
        : streams ? std::min(pages_per_layer, KvOffload::ChunkPages(o))
                  : pages_per_layer;
    // The ring holds pages of one layer at a time: never more than a layer's.
    auto ring = [&](int groups) { return streams ? std::min(pages_per_layer, groups * AttentionGroupPages(o)) : 0; };
    // Offload: the pools hold a few layers; every layer's pages live in host memory (core/kv_offload.h).
    // Only attention layers hold pages (a hybrid's linear layers carry a fixed-size state instead).
    const int slots = std::min(kv_layers_, KvOffload::kSlots);
    const int resident = std::min(o.resident_layers, kv_layers_),
              resident_grad = std::min(o.resident_grad_layers, kv_layers_);
    const int kv_layers = o.offload ? std::min(resident, slots) : resident;
    const int grad_layers = o.offload ? std::min(resident_grad, slots) : resident_grad;
    const CopyEngine* copies = nullptr;
    if (o.offload) {
      const DeviceBackend* backend = FindBackend(mem_.device());
      if (!backend) throw std::invalid_argument("--offload: no backend for the model's device");
      copies = &backend->copies;
    }
    return std::make_unique<TransformerState>(
        PagePool(&mem_, MemCategory::kKVCache, KVDType(), pages_per_slot * kv_layers + ring(KvOffload::kKvRingGroups),
                 o.page_size, kv_heads_, cfg_.head_dim),
        PagePool(&mem_, MemCategory::kKVGrad, KVDType(),
                 pages_per_slot * grad_layers + (grad_layers > 0 ? ring(KvOffload::kGradRingGroups) : 0), o.page_size,
                 kv_heads_, cfg_.head_dim),
        o, kv_index_, kv_layers_, copies, RopeFor(cfg_, LongestDocument(o.doc_starts, o.seq_len)).inv_freq);
  }

  // Falcon-H1 scales the embedding's output (embedding_multiplier).
  Tensor Embed(const int32_t* ids, Chunk c) override {
    Tensor x = Store::EmbedRows(ops_, embed_, ids, c, tp_.on() ? &tp_ : nullptr);
    Scale(x.data<T>(), x.numel(), cfg_.mup.embedding);
    return x;
  }
  // nn.Embedding's padding_idx (Bamba's pad_token_id): the lookup adds nothing to that row's gradient, kept as it was.
  void EmbedBackward(const int32_t* ids, Chunk c, const Tensor& dx) override {
    T* g = G(embed_);
    const int64_t d = cfg_.hidden_size, pad = cfg_.pad_token_id;
    Tensor pad_row;
    if (g && pad >= 0 && !tp_.on()) {
      pad_row = New(MemCategory::kWorkspace, {d});
      ops_.copy(pad_row.data<T>(), g + pad * d, d);
    }
    Tensor scaled;
    if (cfg_.mup.embedding != 1.0) {
      scaled = New(MemCategory::kWorkspace, dx.shape());
      ops_.copy(scaled.data<T>(), dx.data<T>(), dx.numel());
      ops_.scale(scaled.data<T>(), dx.numel(), cfg_.mup.embedding);
    }
    Store::EmbedRowsBackward(ops_, embed_, ids, c, scaled.defined() ? scaled : dx, tp_.on() ? &tp_ : nullptr);
    if (pad_row.defined()) ops_.copy(g + pad * d, pad_row.data<T>(), d);
  }

  Tensor LayerForward(int l, Chunk c, const Tensor& x_in, SequenceState& state_base, LayerSaved* saved) override {
    auto& state = static_cast<TransformerState&>(state_base);
    const MemCategory act = saved ? MemCategory::kActivations : MemCategory::kWorkspace;
    // What backward reads. Under --dtype=bf16 the large tensors are made in workspace (Store::ActCategory), rounded
    // where they are made and kept in bf16 (Keep); the per-row statistics (rstd, lse) and the recurrent states stay
    // in T: they are small, and the norms' and softmax's backward divide by them.
    std::vector<Tensor> kept_tensors(kNumSaved);
    std::vector<Tensor>* kept = saved ? &kept_tensors : nullptr;
    Tensor h = MixerForward(l, c, x_in, state, act, kept);
    Tensor y = layers_[l].mlp == Mlp::kNone ? std::move(h) : MlpForward(layers_[l], c, h, state.opts, act, kept);
    if (saved) {
      kept_tensors[kX] = Store::Narrow(ops_, x_in, act);
      saved->tensors = std::move(kept_tensors);
    }
    return Store::Boundary(ops_, std::move(y));
  }

  // The layer's K/V of the chunk are all that later positions need of an attention layer: norm, K/V projections,
  // rope. A linear layer's state needs its whole token mixing.
  void LayerAppendState(int l, Chunk c, const Tensor& x, SequenceState& state_base) override {
    auto& state = static_cast<TransformerState&>(state_base);
    const Mixer mixer = layers_[l].mixer;
    if (mixer == Mixer::kNone) return;
    if (mixer != Mixer::kAttention) {
      MixerForward(l, c, x, state, MemCategory::kWorkspace, nullptr);
      return;
    }
    state.PrepareLayer(kv_index_[l], c, TransformerState::Pass::kForward);
    const int64_t n = c.size(), d = cfg_.hidden_size;
    Tensor xn1 = New(MemCategory::kWorkspace, {n, d}), rstd1 = New(MemCategory::kWorkspace, {n});
    Norm(x.data<T>(), layers_[l].norm1, xn1, rstd1, MemCategory::kWorkspace, false);  // rounded as LayerForward's
    AppendKV(l, c, xn1.data<T>(), state);
  }

  Tensor LayerBackward(int l, Chunk c, const Tensor& dy_in, LayerSaved& saved, SequenceState& state_base) override {
    auto& state = static_cast<TransformerState&>(state_base);
    const LayerParams& L = layers_[l];
    if (kv_index_[l] >= 0) state.PrepareLayer(kv_index_[l], c, TransformerState::Pass::kBackward);
    const std::vector<Tensor>& s = saved.tensors;
    const int64_t n = c.size(), d = cfg_.hidden_size;
    Tensor dx = New(MemCategory::kActivations, {n, d});
    if (L.mlp == Mlp::kNone) {
      ops_.copy(dx.data<T>(), dy_in.data<T>(), n * d);
    } else {
      const Tensor dh = MlpBackward(L, c, dy_in.data<T>(), s, state.opts);
      ops_.copy(dx.data<T>(), dh.data<T>(), n * d);
    }
    if (L.mixer == Mixer::kNone) return dx;
    const Tensor dxn1 = MixerBackward(l, c, dx.data<T>(), s, state);
    NormBackward(dxn1.data<T>(), Store::Widen(ops_, s[kX]).template data<T>(), L.norm1, s[kRstd1].data<T>(), n,
                 dx.data<T>());
    return dx;
  }

  HeadResult HeadLoss(Chunk c, const Tensor& h, const int32_t* labels, const TokenObjective* objective,
                      double grad_scale, bool need_grad) override {
    Tensor norm;
    return Store::Head(ops_, final_norm_, head_, cfg_.rms_norm_eps, cfg_.hidden_size, vocab_rows_, c, h, labels,
                       objective, grad_scale, need_grad, tp_.on() ? &tp_ : nullptr, NormWeight(final_norm_, norm),
                       cfg_.mup.lm_head);
  }

 private:
  // Rounds t to bf16 values under bf16 storage (ParamStore::RoundAndKeep) and keeps the bf16 copy in slot k when
  // the forward keeps what backward reads (kept non-null).
  void Keep(std::vector<Tensor>* kept, Saved k, Tensor& t, MemCategory act) {
    Tensor half = Store::RoundAndKeep(ops_, t, act);
    if (kept) (*kept)[k] = std::move(half);
  }
  // Where a fused op puts what is kept (null: nothing kept).
  static Tensor* Slot(std::vector<Tensor>* kept, Saved k) { return kept ? &(*kept)[k] : nullptr; }
  // A working copy in T that the forward no longer reads: freed early under bf16 (f32 and f64 keep their schedule).
  void Done(Tensor& t) {
    if (Store::HalfActivations()) t.Reset();
  }

  // h = x + the layer's token mixing of x (x itself in a layer without).
  Tensor MixerForward(int l, Chunk c, const Tensor& x_in, TransformerState& state, MemCategory act,
                      std::vector<Tensor>* kept) {
    switch (layers_[l].mixer) {
      case Mixer::kAttention:
        return AttentionForward(l, c, x_in, state, act, kept);
      case Mixer::kDeltaNet:
        return DeltaNetForward(l, c, x_in, state, act, kept);
      case Mixer::kMamba2:
        return Mamba2Forward(l, c, x_in, state, act, kept);
      case Mixer::kAttentionMamba2:
        return ParallelForward(l, c, x_in, state, act, kept);
      default:
        break;
    }
    const int64_t n = c.size(), d = cfg_.hidden_size;
    Tensor h = New(Store::ActCategory(act), {n, d});
    ops_.copy(h.data<T>(), x_in.data<T>(), n * d);
    return h;
  }
  // The mixer's backward: dxn1 (the gradient of its normed input) from dh.
  Tensor MixerBackward(int l, Chunk c, const T* dh, const std::vector<Tensor>& s, TransformerState& state) {
    switch (layers_[l].mixer) {
      case Mixer::kDeltaNet:
        return DeltaNetBackward(l, c, dh, s, state);
      case Mixer::kMamba2:
        return Mamba2Backward(l, c, dh, s, state);
      case Mixer::kAttentionMamba2:
        return ParallelBackward(l, c, dh, s, state);
      default:
        return AttentionBackward(l, c, dh, s, state);
    }
  }

  // Falcon-H1: h = x + attention_out_multiplier a + ssm_out_multiplier m, with x + a and x + m what attention and
  // Mamba-2 give alone (both on norm1(x); their saved normed input is the same).
  Tensor ParallelForward(int l, Chunk c, const Tensor& x_in, TransformerState& state, MemCategory act,
                         std::vector<Tensor>* kept) {
    const int64_t count = c.size() * cfg_.hidden_size;
    const T* x = x_in.data<T>();
    Tensor h = AttentionForward(l, c, x_in, state, act, kept);
    Tensor mamba = Mamba2Forward(l, c, x_in, state, act, kept);
    for (Tensor* t : {&h, &mamba}) {
      Tensor minus_x = New(MemCategory::kWorkspace, {c.size(), cfg_.hidden_size});
      ops_.copy(minus_x.data<T>(), x, count);
      ops_.scale(minus_x.data<T>(), count, -1.0);
      ops_.add_inplace(t->data<T>(), minus_x.data<T>(), count);
    }
    Scale(h.data<T>(), count, cfg_.mup.attention_out);
    Scale(mamba.data<T>(), count, cfg_.mup.ssm_out);
    ops_.add_inplace(h.data<T>(), mamba.data<T>(), count);
    ops_.add_inplace(h.data<T>(), x, count);
    return h;
  }
  // Its backward: dxn1 = attention's (of attention_out_multiplier dh) + Mamba-2's (of ssm_out_multiplier dh).
  Tensor ParallelBackward(int l, Chunk c, const T* dh, const std::vector<Tensor>& s, TransformerState& state) {
    const int64_t count = c.size() * cfg_.hidden_size;
    auto scaled = [&](double factor) {
      Tensor t = New(MemCategory::kWorkspace, {c.size(), cfg_.hidden_size});
      ops_.copy(t.data<T>(), dh, count);
      Scale(t.data<T>(), count, factor);
      return t;
    };
    Tensor dxn1 = AttentionBackward(l, c, scaled(cfg_.mup.attention_out).template data<T>(), s, state);
    const Tensor dmamba = Mamba2Backward(l, c, scaled(cfg_.mup.ssm_out).template data<T>(), s, state);
    ops_.add_inplace(dxn1.data<T>(), dmamba.data<T>(), count);
    return dxn1;
  }
  // x *= factor, skipped at 1 (every multiplier outside Falcon-H1).
  void Scale(T* x, int64_t count, double factor) {
    if (factor != 1.0) ops_.scale(x, count, factor);
  }

  // h = x + o(attn(rope(q(xn1)), cache)) (gated attention: o(attn sigmoid(gate))), xn1 = norm1(x); appends the
  // chunk's K/V.
  Tensor AttentionForward(int l, Chunk c, const Tensor& x_in, TransformerState& state, MemCategory act,
                          std::vector<Tensor>* kept) {
    const auto pass = kept ? TransformerState::Pass::kForwardForBackward : TransformerState::Pass::kForward;
    const int kl = kv_index_[l];
    state.PrepareLayer(kl, c, pass);
    const LayerParams& L = layers_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, hd = cfg_.head_dim;
    const int64_t qd = heads_ * hd;
    const T* x = x_in.data<T>();
    const MemCategory big = Store::ActCategory(act);

    Tensor xn1 = New(big, {n, d}), rstd1 = New(act, {n});
    Tensor xn1_kept = Norm(x, L.norm1, xn1, rstd1, act, kept != nullptr);
    Tensor q = New(big, {n, qd}), q_raw, q_rstd, gate;
    if (cfg_.qk_norm()) {
      q_raw = New(big, {n, qd});
      q_rstd = New(act, {n * heads_});
      if (cfg_.hybrid()) {  // q_proj's rows: per head its query, then its output gate
        Tensor q_and_gate = New(MemCategory::kWorkspace, {n, 2 * qd});
        Linear(xn1.data<T>(), n, d, L.q, L.q_bias, q_and_gate.data<T>(), 2 * qd, c, state.opts);
        gate = New(big, {n, qd});
        ops_.copy_rows(q_raw.data<T>(), hd, q_and_gate.data<T>(), 2 * hd, n * heads_, hd);
        ops_.copy_rows(gate.data<T>(), hd, q_and_gate.data<T>() + hd, 2 * hd, n * heads_, hd);
        Keep(kept, kQGate, gate, act);
      } else {
        Linear(xn1.data<T>(), n, d, L.q, L.q_bias, q_raw.data<T>(), qd, c, state.opts);
      }
      Keep(kept, kQRaw, q_raw, act);
      Tensor w;
      ops_.rmsnorm_forward(q_raw.data<T>(), NormWeight(L.q_norm, w), n * heads_, hd, cfg_.rms_norm_eps, q.data<T>(),
                           q_rstd.data<T>());
    } else {
      Linear(xn1.data<T>(), n, d, L.q, L.q_bias, q.data<T>(), qd, c, state.opts);
    }
    Scale(q.data<T>(), n * qd, cfg_.mup.attention_in);
    Rope(q.data<T>(), c, heads_, /*inverse=*/false, state);
    Keep(kept, kQ, q, act);
    if (!state.HoldsKV(kl, c)) AppendKV(l, c, xn1.data<T>(), state);
    Done(xn1);
    Tensor attn = New(big, {n, qd}), lse = New(act, {heads_, n});
    {
      const uint8_t* selected = SelectPages(kl, c, q.data<T>(), state);
      if (selected) state.RequireSelected(kl, c, pass);
      const PagedAttention pages = state.AttentionPages(kl, selected, &mem_);
      ByDocument(c, state, lse, [&](Chunk p, const AttentionShape& s, int64_t row, T* piece_lse) {
        PagedAttentionForward<T>(ops_, s, pages, q.data<T>() + row * qd, attn.data<T>() + row * qd, piece_lse);
      });
    }
    Done(q);
    Keep(kept, kAttn, attn, act);
    Tensor h = New(big, {n, d});
    ops_.copy(h.data<T>(), x, n * d);
    if (gate.defined()) {
      Tensor gated = New(MemCategory::kWorkspace, {n, qd});
      ops_.sigmoid_gate_forward(gate.data<T>(), attn.data<T>(), n * qd, gated.data<T>());
      RowParallelAdd(gated.data<T>(), qd, L.o, L.o_bias, c, state.opts, h.data<T>());
    } else {
      RowParallelAdd(attn.data<T>(), qd, L.o, L.o_bias, c, state.opts, h.data<T>());
    }
    Done(attn);
    if (kept) {
      (*kept)[kXn1] = std::move(xn1_kept);
      (*kept)[kRstd1] = rstd1, (*kept)[kLse] = lse, (*kept)[kQRstd] = q_rstd;
    }
    return h;
  }

  // y = h + down(swiglu(gate(xn2), up(xn2))), xn2 = norm2(h).
  Tensor MlpForward(const LayerParams& L, Chunk c, Tensor& h, const StateOptions& st, MemCategory act,
                    std::vector<Tensor>* kept) {
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    const MemCategory big = Store::ActCategory(act);
    Keep(kept, kH, h, act);
    Tensor xn2 = New(big, {n, d}), rstd2 = New(act, {n});
    Tensor xn2_kept = Norm(h.data<T>(), L.norm2, xn2, rstd2, act, kept != nullptr);
    if (kept) (*kept)[kXn2] = xn2_kept, (*kept)[kRstd2] = rstd2;
    if (L.moe) {
      Tensor y = New(MemCategory::kActivations, {n, d});
      ops_.copy(y.data<T>(), h.data<T>(), n * d);
      MoeForward(L.experts, c, xn2.data<T>(), st, act, kept, y.data<T>());
      return y;
    }
    if (L.mlp == Mlp::kRelu2) return Relu2MlpForward(L, c, h, xn2, st, act, kept);
    Tensor gate = New(big, {n, f}), up = New(big, {n, f}), a = New(big, {n, f});
    Linear(xn2.data<T>(), n, d, L.gate, L.gate_bias, gate.data<T>(), f, c, st);
    Scale(gate.data<T>(), n * f, cfg_.mup.mlp_gate);
    Linear(xn2.data<T>(), n, d, L.up, L.up_bias, up.data<T>(), f, c, st);
    Done(xn2);
    Store::SwigluAndKeep(ops_, gate, up, a, act, Slot(kept, kGate), Slot(kept, kUp), Slot(kept, kAct));
    Done(gate), Done(up);
    Tensor y = New(MemCategory::kActivations, {n, d});
    if (cfg_.mup.mlp_down == 1.0) {
      ops_.copy(y.data<T>(), h.data<T>(), n * d);
      RowParallelAdd(a.data<T>(), f, L.down, L.down_bias, c, st, y.data<T>());
    } else {  // y = h + mlp_down down(a)
      ops_.fill(y.data<T>(), n * d, T(0));
      RowParallelAdd(a.data<T>(), f, L.down, L.down_bias, c, st, y.data<T>());
      ops_.scale(y.data<T>(), n * d, cfg_.mup.mlp_down);
      ops_.add_inplace(y.data<T>(), h.data<T>(), n * d);
    }
    return y;
  }

  // Nemotron-H's MLP: y = h + down(relu(up(xn2))^2).
  Tensor Relu2MlpForward(const LayerParams& L, Chunk c, const Tensor& h, Tensor& xn2, const StateOptions& st,
                         MemCategory act, std::vector<Tensor>* kept) {
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    const MemCategory big = Store::ActCategory(act);
    Tensor up = New(big, {n, f}), a = New(big, {n, f});
    Linear(xn2.data<T>(), n, d, L.up, L.up_bias, up.data<T>(), f, c, st);
    Done(xn2);
    ops_.relu2_forward(up.data<T>(), n * f, a.data<T>());
    Keep(kept, kUp, up, act);
    Keep(kept, kAct, a, act);
    Tensor y = New(MemCategory::kActivations, {n, d});
    ops_.copy(y.data<T>(), h.data<T>(), n * d);
    RowParallelAdd(a.data<T>(), f, L.down, L.down_bias, c, st, y.data<T>());
    return y;
  }
  // Its backward: dxn2 from dy.
  Tensor Relu2MlpBackward(const LayerParams& L, Chunk c, const T* dy, const std::vector<Tensor>& s,
                          const StateOptions& st) {
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor da = New(ws, {n, f}), dup = New(ws, {n, f}), dxn2 = New(ws, {n, d});
    Store::GemmW(ops_, false, n, f, d, T(1), dy, d, L.down, f, T(0), da.data<T>(), f);
    {
      const Tensor a = Store::Widen(ops_, s[kAct]);
      if (T* g = G(L.down)) ops_.gemm(true, false, d, f, n, T(1), dy, d, a.data<T>(), f, T(1), g, f);
      BiasBackward(L.down_bias, dy, n, d);
      Store::LoraBackward(ops_, L.down, a.data<T>(), dy, d, da.data<T>(), c, st);
    }
    ops_.relu2_backward(da.data<T>(), Store::Widen(ops_, s[kUp]).template data<T>(), n * f, dup.data<T>());
    const Tensor xn2 = Store::Widen(ops_, s[kXn2]);
    LinearBackward(dup.data<T>(), f, xn2.data<T>(), n, L.up, L.up_bias, dxn2.data<T>(), T(0), c, st);
    tp_.AllReduce(dxn2.raw(), n * d, dtype());  // each rank's columns of up gave part of it
    return dxn2;
  }

  // The MLP's backward: dh = dy + d(norm2) from dy, y = h + down(swiglu(gate(xn2), up(xn2))), xn2 = norm2(h).
  Tensor MlpBackward(const LayerParams& L, Chunk c, const T* dy, const std::vector<Tensor>& s, const StateOptions& st) {
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };
    Tensor dh = New(ws, {n, d});
    if (L.moe) {
      const Tensor dxn2 = MoeBackward(L.experts, c, dy, wide(kXn2).template data<T>(), s, st);
      ops_.copy(dh.data<T>(), dy, n * d);
      NormBackward(dxn2.data<T>(), wide(kH).template data<T>(), L.norm2, s[kRstd2].data<T>(), n, dh.data<T>());
      return dh;
    }
    if (L.mlp == Mlp::kRelu2) {
      const Tensor dxn2 = Relu2MlpBackward(L, c, dy, s, st);
      ops_.copy(dh.data<T>(), dy, n * d);
      NormBackward(dxn2.data<T>(), wide(kH).template data<T>(), L.norm2, s[kRstd2].data<T>(), n, dh.data<T>());
      return dh;
    }
    Tensor da = New(ws, {n, f}), dy_scaled;
    const T* ddown = dy;  // the gradient of down's output: dy, or mlp_down dy
    if (cfg_.mup.mlp_down != 1.0) {
      dy_scaled = New(ws, {n, d});
      ops_.copy(dy_scaled.data<T>(), dy, n * d);
      ops_.scale(dy_scaled.data<T>(), n * d, cfg_.mup.mlp_down);
      ddown = dy_scaled.data<T>();
    }
    Store::GemmW(ops_, false, n, f, d, T(1), ddown, d, L.down, f, T(0), da.data<T>(), f);
    {
      const Tensor a = wide(kAct);  // widened before dgate and dup exist
      if (T* g = G(L.down)) ops_.gemm(true, false, d, f, n, T(1), ddown, d, a.data<T>(), f, T(1), g, f);
      BiasBackward(L.down_bias, ddown, n, d);
      Store::LoraBackward(ops_, L.down, a.data<T>(), ddown, d, da.data<T>(), c, st);
    }
    Tensor dgate = New(ws, {n, f}), dup = New(ws, {n, f}), dxn2 = New(ws, {n, d});
    Store::SwigluBackwardKept(ops_, da.data<T>(), s[kGate], s[kUp], dgate.data<T>(), dup.data<T>());
    Scale(dgate.data<T>(), n * f, cfg_.mup.mlp_gate);
    Store::GemmW(ops_, false, n, d, f, T(1), dgate.data<T>(), f, L.gate, d, T(0), dxn2.data<T>(), d);
    Store::GemmW(ops_, false, n, d, f, T(1), dup.data<T>(), f, L.up, d, T(1), dxn2.data<T>(), d);
    const Tensor xn2_kept = wide(kXn2);
    const T* xn2 = xn2_kept.data<T>();
    if (T* g = G(L.gate)) ops_.gemm(true, false, f, d, n, T(1), dgate.data<T>(), f, xn2, d, T(1), g, d);
    if (T* g = G(L.up)) ops_.gemm(true, false, f, d, n, T(1), dup.data<T>(), f, xn2, d, T(1), g, d);
    BiasBackward(L.gate_bias, dgate.data<T>(), n, f);
    BiasBackward(L.up_bias, dup.data<T>(), n, f);
    Store::LoraBackward(ops_, L.gate, xn2, dgate.data<T>(), f, dxn2.data<T>(), c, st);
    Store::LoraBackward(ops_, L.up, xn2, dup.data<T>(), f, dxn2.data<T>(), c, st);
    tp_.AllReduce(dxn2.raw(), n * d, dtype());  // each rank's columns of gate/up gave part of it
    ops_.copy(dh.data<T>(), dy, n * d);
    NormBackward(dxn2.data<T>(), wide(kH).template data<T>(), L.norm2, s[kRstd2].data<T>(), n, dh.data<T>());
    return dh;
  }

  // Attention's backward: dxn1 from dh, h = x + o(attn(rope(q(xn1)), cache)) (gated: o(attn sigmoid(gate))).
  Tensor AttentionBackward(int l, Chunk c, const T* dh, const std::vector<Tensor>& s, TransformerState& state) {
    const LayerParams& L = layers_[l];
    const int kl = kv_index_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, hd = cfg_.head_dim;
    const int64_t qd = heads_ * hd, kvd = kv_heads_ * hd;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };
    const bool gated = cfg_.hybrid();
    Tensor dq = New(ws, {n, qd}), dgate;
    {
      Tensor dattn = New(ws, {n, qd});
      const Tensor attn = wide(kAttn), q = wide(kQ);
      Tensor o_in = attn;  // o_proj's input: attn, or attn sigmoid(gate)
      Tensor gate;
      if (gated) {
        gate = wide(kQGate);
        o_in = New(ws, {n, qd});
        ops_.sigmoid_gate_forward(gate.data<T>(), attn.data<T>(), n * qd, o_in.data<T>());
      }
      Store::GemmW(ops_, false, n, qd, d, T(1), dh, d, L.o, qd, T(0), dattn.data<T>(), qd);
      if (T* g = G(L.o)) ops_.gemm(true, false, d, qd, n, T(1), dh, d, o_in.data<T>(), qd, T(1), g, qd);
      BiasBackward(L.o_bias, dh, n, d);
      Store::LoraBackward(ops_, L.o, o_in.data<T>(), dh, d, dattn.data<T>(), c, state.opts);
      if (gated) {
        dgate = New(ws, {n, qd});
        Tensor d_ungated = New(ws, {n, qd});
        ops_.sigmoid_gate_backward(dattn.data<T>(), gate.data<T>(), attn.data<T>(), n * qd, dgate.data<T>(),
                                   d_ungated.data<T>());
        dattn = std::move(d_ungated);
      }
      const uint8_t* selected = SelectPages(kl, c, q.data<T>(), state);
      const PagedAttention pages = state.AttentionPages(kl, selected, &mem_);
      ByDocument(c, state, s[kLse], [&](Chunk p, const AttentionShape& sh, int64_t row, T* piece_lse) {
        PagedAttentionBackward<T>(ops_, sh, pages, q.data<T>() + row * qd, attn.data<T>() + row * qd, piece_lse,
                                  dattn.data<T>() + row * qd, dq.data<T>() + row * qd);
      });
    }
    // This chunk's dK/dV are complete: later chunks (processed before, in reverse) already added theirs.
    Tensor dk = New(ws, {n, kvd}), dv = New(ws, {n, kvd});
    state.grad.Gather<T>(kl, c.begin, c.end, dk.data<T>(), dv.data<T>());
    Rope(dq.data<T>(), c, heads_, /*inverse=*/true, state);
    Rope(dk.data<T>(), c, kv_heads_, /*inverse=*/true, state);
    Scale(dq.data<T>(), n * qd, cfg_.mup.attention_in);
    Scale(dk.data<T>(), n * kvd, cfg_.mup.attention_in * cfg_.mup.key);
    Scale(dv.data<T>(), n * kvd, cfg_.mup.attention_in);
    const Tensor xn1_kept = wide(kXn1);
    const T* xn1 = xn1_kept.data<T>();
    if (cfg_.qk_norm()) {
      // Through the per-head norms: q's input was saved; k's is projected again from xn1.
      const int64_t H = heads_, G = kv_heads_;
      Tensor dq_raw = New(ws, {n, qd}), wq, wk;
      ops_.rmsnorm_backward(dq.data<T>(), wide(kQRaw).template data<T>(), NormWeight(L.q_norm, wq), s[kQRstd].data<T>(),
                            n * H, hd, dq_raw.data<T>(), GradOrScratch(L.q_norm), false);
      dq = std::move(dq_raw);
      Tensor k_raw = New(ws, {n, kvd}), k_normed = New(ws, {n, kvd}), k_rstd = New(ws, {n * G});
      Linear(xn1, n, d, L.k, L.k_bias, k_raw.data<T>(), kvd, c, state.opts);
      const T* k_norm = NormWeight(L.k_norm, wk);
      ops_.rmsnorm_forward(k_raw.data<T>(), k_norm, n * G, hd, cfg_.rms_norm_eps, k_normed.data<T>(), k_rstd.data<T>());
      ops_.rmsnorm_backward(dk.data<T>(), k_raw.data<T>(), k_norm, k_rstd.data<T>(), n * G, hd, k_normed.data<T>(),
                            GradOrScratch(L.k_norm), false);
      dk = std::move(k_normed);
    }
    if (gated) {  // q_proj's output gradient: per head its query's, then its gate's
      Tensor dq_and_gate = New(ws, {n, 2 * qd});
      ops_.copy_rows(dq_and_gate.data<T>(), 2 * hd, dq.data<T>(), hd, n * heads_, hd);
      ops_.copy_rows(dq_and_gate.data<T>() + hd, 2 * hd, dgate.data<T>(), hd, n * heads_, hd);
      dq = std::move(dq_and_gate);
    }
    Tensor dxn1 = New(ws, {n, d});
    LinearBackward(dq.data<T>(), (gated ? 2 : 1) * qd, xn1, n, L.q, L.q_bias, dxn1.data<T>(), T(0), c, state.opts);
    LinearBackward(dk.data<T>(), kvd, xn1, n, L.k, L.k_bias, dxn1.data<T>(), T(1), c, state.opts);
    LinearBackward(dv.data<T>(), kvd, xn1, n, L.v, L.v_bias, dxn1.data<T>(), T(1), c, state.opts);
    tp_.AllReduce(dxn1.raw(), n * d, dtype());  // each rank's heads gave part of it
    return dxn1;
  }

  // ---- Mixture of experts (transformers' Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, Qwen3NextSparseMoeBlock) ----
  // y += sum over each token's top-k experts of weight * expert(xn2), expert(x) = down(silu(gate x) * (up x)), the
  // weights from the router's softmax (moe_route); with a shared expert, y += sigmoid(shared_gate xn2) shared(xn2).
  // Tokens are grouped by expert for the GEMMs; the backward recomputes each expert's activations from xn2.
  void MoeForward(const MoeParams& M, Chunk c, const T* xn2, const StateOptions& st, MemCategory act,
                  std::vector<Tensor>* kept, T* y) {
    const MoeConfig& m = cfg_.moe;
    const int64_t n = c.size(), d = cfg_.hidden_size, E = m.experts, k = m.top_k, I = m.intermediate;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor logits = New(ws, {n, E}), probs = New(act, {n, E}), weights = New(act, {n, k});
    Tensor top = Tensor::Empty(&mem_, act, DType::kI32, {n, k});
    Linear(xn2, n, d, M.router, -1, logits.data<T>(), E, c, st);
    ops_.moe_route(logits.data<T>(), n, E, k, m.normalize, probs.data<T>(), top.data<int32_t>(), weights.data<T>());
    const ExpertGroups groups = Group(top, weights, n);
    const ExpertAdapters lora = ExpertAdaptersOf(M, false);
    const ExpertWeights w =
        ExpertWeightsOf(M, kept ? TransformerState::Pass::kForwardForBackward : TransformerState::Pass::kForward);
    if (routing_.collecting && mem_.device() != Device::kMeta) {  // meta has no values to count
      Tensor sums = Tensor::Empty(&mem_, ws, DType::kF64, {E});
      ops_.column_sums_f64(probs.data<T>(), n, E, sums.data<double>());
      const std::vector<double> host = HostCopy<double>(sums);
      for (int64_t e = 0; e < E; ++e)
        routing_.picks[e] += static_cast<double>(groups.size(e)), routing_.probs[e] += host[e];
      routing_.rows += n;
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = groups.size(e);
      if (rows == 0) continue;
      Tensor xe = New(ws, {rows, d}), gate = New(ws, {rows, I}), up = New(ws, {rows, I}), a = New(ws, {rows, I});
      Tensor out = New(ws, {rows, d});
      ops_.gather_rows(xn2, groups.rows(e), rows, d, xe.data<T>());
      ExpertForward(M, w, lora, e, xe.data<T>(), rows, gate.data<T>(), up.data<T>(), a.data<T>(), out.data<T>());
      ops_.scatter_add_rows(out.data<T>(), groups.rows(e), groups.template scale<T>(e), rows, d, y);
    }
    if (M.shared_gate >= 0) SharedExpertForward(M, c, xn2, st, y);
    if (kept) (*kept)[kProbs] = probs, (*kept)[kTop] = top, (*kept)[kRouteWeights] = weights;
  }

  // The MoE block's backward: dxn2 from dy (the block's output gradient); accumulates the experts', router's and
  // shared expert's gradients.
  Tensor MoeBackward(const MoeParams& M, Chunk c, const T* dy, const T* xn2, const std::vector<Tensor>& s,
                     const StateOptions& st) {
    const MoeConfig& m = cfg_.moe;
    const int64_t n = c.size(), d = cfg_.hidden_size, E = m.experts, k = m.top_k, I = m.intermediate;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor dxn2 = Tensor::Zeros(&mem_, ws, Store::kDType, {n, d});
    Tensor dweights = Tensor::Zeros(&mem_, ws, Store::kDType, {n * k});
    const ExpertGroups groups = Group(s[kTop], s[kRouteWeights], n);
    const ExpertAdapters lora = ExpertAdaptersOf(M, true);
    const ExpertWeights w = ExpertWeightsOf(M, TransformerState::Pass::kBackward);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = groups.size(e);
      if (rows == 0) continue;
      Tensor xe = New(ws, {rows, d}), gate = New(ws, {rows, I}), up = New(ws, {rows, I}), a = New(ws, {rows, I});
      Tensor out = New(ws, {rows, d}), dye = New(ws, {rows, d}), dw = New(ws, {rows});
      ops_.gather_rows(xn2, groups.rows(e), rows, d, xe.data<T>());
      typename Store::LoraAct acts[2];  // the adapters' inputs of gate_up and down
      ExpertForward(M, w, lora, e, xe.data<T>(), rows, gate.data<T>(), up.data<T>(), a.data<T>(), out.data<T>(), acts);
      // out is the expert's output before its weight: the weight's gradient is <dy, out>.
      ops_.gather_rows(dy, groups.rows(e), rows, d, dye.data<T>());
      ops_.row_dots(dye.data<T>(), out.data<T>(), rows, d, dw.data<T>());
      ops_.scatter_add_rows(dw.data<T>(), groups.slots(e), nullptr, rows, 1, dweights.data<T>());
      Tensor dout = Tensor::Zeros(&mem_, ws, Store::kDType, {rows, d});  // weight * dy
      ops_.scatter_add_rows(dye.data<T>(), groups.identity(), groups.template scale<T>(e), rows, d, dout.data<T>());
      Tensor da = New(ws, {rows, I}), dgate = New(ws, {rows, I}), dup = New(ws, {rows, I}), dxe = New(ws, {rows, d});
      GemmWeight(ops_, false, false, rows, I, d, T(1), dout.data<T>(), d, ExpertRows(w.down, M.down, e, 0), I, T(0),
                 da.data<T>(), I);
      if (T* g = ExpertGrad(M.down, e, 0))
        ops_.gemm(true, false, d, I, rows, T(1), dout.data<T>(), d, a.data<T>(), I, T(1), g, I);
      Store::LoraOutBackward(ops_, acts[1], 0, d, dout.data<T>(), d);
      Store::LoraInBackward(ops_, acts[1], da.data<T>(), c, st);
      ops_.swiglu_backward(da.data<T>(), gate.data<T>(), up.data<T>(), rows * I, dgate.data<T>(), dup.data<T>());
      GemmWeight(ops_, false, false, rows, d, I, T(1), dgate.data<T>(), I, ExpertRows(w.gate_up, M.gate_up, e, 0), d,
                 T(0), dxe.data<T>(), d);
      GemmWeight(ops_, false, false, rows, d, I, T(1), dup.data<T>(), I, ExpertRows(w.gate_up, M.gate_up, e, I), d,
                 T(1), dxe.data<T>(), d);
      if (T* g = ExpertGrad(M.gate_up, e, 0))
        ops_.gemm(true, false, I, d, rows, T(1), dgate.data<T>(), I, xe.data<T>(), d, T(1), g, d);
      if (T* g = ExpertGrad(M.gate_up, e, I))
        ops_.gemm(true, false, I, d, rows, T(1), dup.data<T>(), I, xe.data<T>(), d, T(1), g, d);
      Store::LoraOutBackward(ops_, acts[0], 0, I, dgate.data<T>(), I);
      Store::LoraOutBackward(ops_, acts[0], I, I, dup.data<T>(), I);
      Store::LoraInBackward(ops_, acts[0], dxe.data<T>(), c, st);
      ops_.scatter_add_rows(dxe.data<T>(), groups.rows(e), nullptr, rows, d, dxn2.data<T>());
    }
    Store::ExpertLoraEnd(ops_, lora.gate_up);
    Store::ExpertLoraEnd(ops_, lora.down);
    Tensor dlogits = New(ws, {n, E});
    ops_.moe_route_backward(dweights.data<T>(), s[kProbs].data<T>(), s[kTop].data<int32_t>(), n, E, k, m.normalize,
                            routing_.grad.defined() ? routing_.grad.template data<T>() : nullptr, dlogits.data<T>());
    LinearBackward(dlogits.data<T>(), E, xn2, n, M.router, -1, dxn2.data<T>(), T(1), c, st);
    if (M.shared_gate >= 0) SharedExpertBackward(M, c, dy, xn2, st, dxn2.data<T>());
    return dxn2;
  }

  // The grouping is host work on the router's choices (n x k indices). On the meta device (plans) they are unknown:
  // the first k experts take every token, the largest groups.
  ExpertGroups Group(const Tensor& top, const Tensor& weights, int64_t n) {
    const int64_t E = cfg_.moe.experts, k = cfg_.moe.top_k;
    std::vector<int32_t> choice(n * k);
    if (mem_.device() == Device::kMeta) {
      for (int64_t i = 0; i < n * k; ++i) choice[i] = static_cast<int32_t>(i % k);
    } else {
      choice = HostCopy<int32_t>(top);
    }
    ExpertGroups g;
    g.begin.assign(E + 1, 0);
    for (int32_t e : choice) {
      if (e < 0 || e >= E) throw std::logic_error(absl::StrCat("moe_route chose expert ", e, " of ", E));
      ++g.begin[e + 1];
    }
    for (int64_t e = 0; e < E; ++e) g.begin[e + 1] += g.begin[e];
    std::vector<int32_t> rows(n * k), slots(n * k), iota(n);
    std::vector<int64_t> next(g.begin.begin(), g.begin.end() - 1);
    for (int64_t i = 0; i < n * k; ++i) {
      const int64_t at = next[choice[i]]++;
      rows[at] = static_cast<int32_t>(i / k);
      slots[at] = static_cast<int32_t>(i);
    }
    std::iota(iota.begin(), iota.end(), 0);
    auto upload = [&](const std::vector<int32_t>& v) {
      Tensor t = Tensor::Empty(&mem_, MemCategory::kWorkspace, DType::kI32, {static_cast<int64_t>(v.size())});
      CopyFromHost(t, v.data());
      return t;
    };
    g.row_index = upload(rows), g.slot_index = upload(slots), g.iota = upload(iota);
    g.weight = New(MemCategory::kWorkspace, {n * k});
    ops_.gather_rows(weights.data<T>(), g.slot_index.data<int32_t>(), n * k, 1, g.weight.data<T>());
    return g;
  }
  // The LoRA adapters of a MoE block's expert weights (ad null where none) for one pass.
  struct ExpertAdapters {
    typename Store::ExpertLora gate_up, down;
  };
  ExpertAdapters ExpertAdaptersOf(const MoeParams& M, bool backward) {
    return {Store::ExpertLoraOf(ops_, M.gate_up, backward), Store::ExpertLoraOf(ops_, M.down, backward)};
  }
  // The device copies of a MoE block's expert weights for one pass: the parameters themselves, or with expert
  // offload the slot their layer is in (the layer the schedule visits after this pass prefetched behind it).
  struct ExpertWeights {
    WeightView gate_up, down;
  };
  ExpertWeights ExpertWeightsOf(const MoeParams& M, TransformerState::Pass pass) {
    if (!expert_offload_) return {Store::Wv(M.gate_up), Store::Wv(M.down)};
    const int next = TransformerState::NextVisit(M.index, expert_offload_->layers(), pass).layer;
    const std::vector<WeightView> v = expert_offload_->Visit(M.index, next);
    return {v[0], v[1]};
  }
  // Expert e: gate and up of its tokens' xe [rows][d], a = silu(gate) up, out = down(a), each weight with its
  // adapter's B_e A_e added; acts (non-null) keeps the adapters' inputs of gate_up and down for the backward.
  void ExpertForward(const MoeParams& M, const ExpertWeights& w, const ExpertAdapters& lora, int64_t e, const T* xe,
                     int64_t rows, T* gate, T* up, T* a, T* out, typename Store::LoraAct* acts = nullptr) {
    const int64_t d = cfg_.hidden_size, I = cfg_.moe.intermediate;
    GemmWeight(ops_, false, true, rows, I, d, T(1), xe, d, ExpertRows(w.gate_up, M.gate_up, e, 0), d, T(0), gate, I);
    GemmWeight(ops_, false, true, rows, I, d, T(1), xe, d, ExpertRows(w.gate_up, M.gate_up, e, I), d, T(0), up, I);
    typename Store::LoraAct gate_up = Store::ExpertLoraIn(ops_, lora.gate_up, e, xe, rows);
    Store::LoraOut(ops_, gate_up, 0, I, gate, I);
    Store::LoraOut(ops_, gate_up, I, I, up, I);
    ops_.swiglu_forward(gate, up, rows * I, a);
    GemmWeight(ops_, false, true, rows, d, I, T(1), a, I, ExpertRows(w.down, M.down, e, 0), I, T(0), out, d);
    typename Store::LoraAct down = Store::ExpertLoraIn(ops_, lora.down, e, a, rows);
    Store::LoraOut(ops_, down, 0, d, out, d);
    if (acts) acts[0] = std::move(gate_up), acts[1] = std::move(down);
  }
  // Rows [row0, ..) of expert e's matrix in a [experts][rows][cols] parameter w whose values are at `values`, and
  // their gradient (null: frozen).
  WeightView ExpertRows(WeightView values, int w, int64_t e, int64_t row0) const {
    const Tensor& t = params_[w].value;
    const int64_t offset = (e * t.dim(1) + row0) * t.dim(2);
    return {static_cast<const char*>(values.data) + offset * static_cast<int64_t>(DTypeSize(values.dtype)),
            values.dtype};
  }
  T* ExpertGrad(int w, int64_t e, int64_t row0) const {
    T* g = G(w);
    const Tensor& t = params_[w].value;
    return g ? g + (e * t.dim(1) + row0) * t.dim(2) : nullptr;
  }
  // The shared expert: y += sigmoid(shared_gate xn2) down(silu(gate xn2) (up xn2)), the gate a scalar per token.
  void SharedExpertForward(const MoeParams& M, Chunk c, const T* xn2, const StateOptions& st, T* y) {
    const int64_t n = c.size(), d = cfg_.hidden_size, S = cfg_.moe.shared_intermediate;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor gate = New(ws, {n, S}), up = New(ws, {n, S}), a = New(ws, {n, S}), out = New(ws, {n, d});
    SharedExpertOutput(M, c, xn2, st, gate, up, a, out);
    Tensor logit = New(ws, {n}), sig = New(ws, {n}), ones = Ones(n), iota = Iota(n);
    Linear(xn2, n, d, M.shared_router, -1, logit.data<T>(), 1, c, st);
    ops_.sigmoid_gate_forward(logit.data<T>(), ones.data<T>(), n, sig.data<T>());
    ops_.scatter_add_rows(out.data<T>(), iota.data<int32_t>(), sig.data<T>(), n, d, y);
  }
  void SharedExpertOutput(const MoeParams& M, Chunk c, const T* xn2, const StateOptions& st, Tensor& gate, Tensor& up,
                          Tensor& a, Tensor& out) {
    const int64_t n = c.size(), d = cfg_.hidden_size, S = cfg_.moe.shared_intermediate;
    Linear(xn2, n, d, M.shared_gate, -1, gate.data<T>(), S, c, st);
    Linear(xn2, n, d, M.shared_up, -1, up.data<T>(), S, c, st);
    ops_.swiglu_forward(gate.data<T>(), up.data<T>(), n * S, a.data<T>());
    Linear(a.data<T>(), n, S, M.shared_down, -1, out.data<T>(), d, c, st);
  }
  void SharedExpertBackward(const MoeParams& M, Chunk c, const T* dy, const T* xn2, const StateOptions& st, T* dxn2) {
    const int64_t n = c.size(), d = cfg_.hidden_size, S = cfg_.moe.shared_intermediate;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor gate = New(ws, {n, S}), up = New(ws, {n, S}), a = New(ws, {n, S}), out = New(ws, {n, d});
    SharedExpertOutput(M, c, xn2, st, gate, up, a, out);
    Tensor logit = New(ws, {n}), sig = New(ws, {n}), ones = Ones(n), iota = Iota(n);
    Linear(xn2, n, d, M.shared_router, -1, logit.data<T>(), 1, c, st);
    ops_.sigmoid_gate_forward(logit.data<T>(), ones.data<T>(), n, sig.data<T>());
    // The gate: d sig = <dy, out>; through the sigmoid to its logit, then the [1][d] router.
    Tensor dsig = New(ws, {n}), dlogit = New(ws, {n}), unused = New(ws, {n});
    ops_.row_dots(dy, out.data<T>(), n, d, dsig.data<T>());
    ops_.sigmoid_gate_backward(dsig.data<T>(), logit.data<T>(), ones.data<T>(), n, dlogit.data<T>(), unused.data<T>());
    LinearBackward(dlogit.data<T>(), 1, xn2, n, M.shared_router, -1, dxn2, T(1), c, st);
    // The expert: dout = sig dy.
    Tensor dout = Tensor::Zeros(&mem_, ws, Store::kDType, {n, d}), da = New(ws, {n, S});
    ops_.scatter_add_rows(dy, iota.data<int32_t>(), sig.data<T>(), n, d, dout.data<T>());
    Store::GemmW(ops_, false, n, S, d, T(1), dout.data<T>(), d, M.shared_down, S, T(0), da.data<T>(), S);
    if (T* g = G(M.shared_down)) ops_.gemm(true, false, d, S, n, T(1), dout.data<T>(), d, a.data<T>(), S, T(1), g, S);
    Store::LoraBackward(ops_, M.shared_down, a.data<T>(), dout.data<T>(), d, da.data<T>(), c, st);
    Tensor dgate = New(ws, {n, S}), dup = New(ws, {n, S});
    ops_.swiglu_backward(da.data<T>(), gate.data<T>(), up.data<T>(), n * S, dgate.data<T>(), dup.data<T>());
    LinearBackward(dgate.data<T>(), S, xn2, n, M.shared_gate, -1, dxn2, T(1), c, st);
    LinearBackward(dup.data<T>(), S, xn2, n, M.shared_up, -1, dxn2, T(1), c, st);
  }
  Tensor Ones(int64_t n) {
    Tensor t = New(MemCategory::kWorkspace, {n});
    ops_.fill(t.data<T>(), n, T(1));
    return t;
  }
  Tensor Iota(int64_t n) {
    std::vector<int32_t> v(n);
    std::iota(v.begin(), v.end(), 0);
    Tensor t = Tensor::Empty(&mem_, MemCategory::kWorkspace, DType::kI32, {n});
    CopyFromHost(t, v.data());
    return t;
  }

  // ---- Gated DeltaNet (transformers' Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet) ----
  // h = x + out_proj(norm(o) silu(z)), o = the gated delta rule over q, k, v, with (q, k, v) = silu(conv(mixed))
  // (mixed, z, b, a) = the input projections of xn1 = norm1(x), beta = sigmoid(b), g = -exp(A_log) softplus(a +
  // dt_bias), q and k L2-normalised per head (q also scaled by key_head_dim^-1/2). The conv's tail and the rule's
  // state carry from chunk to chunk, and restart from zero where a document does.
  Tensor DeltaNetForward(int l, Chunk c, const Tensor& x_in, TransformerState& state, MemCategory act,
                         std::vector<Tensor>* kept) {
    const LayerParams& L = layers_[l];
    const DeltaNetParams& P = L.delta;
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t n = c.size(), d = cfg_.hidden_size, C = a.conv_dim(), K = a.conv_kernel;
    const int64_t V = a.value_dim(), Hv = a.value_heads, dk = a.key_head_dim, dv = a.value_head_dim;
    const MemCategory big = Store::ActCategory(act);
    // The conv's input and output are kept in bf16 but not rounded in the forward (as Mamba's conv path).
    auto keep_copy = [&](Saved k, const Tensor& t) {
      if (kept) (*kept)[k] = Store::Narrow(ops_, t, act);
    };

    Tensor xn1 = New(big, {n, d}), rstd1 = New(act, {n});
    Tensor xn1_kept = Norm(x_in.data<T>(), L.norm1, xn1, rstd1, act, kept != nullptr);
    Tensor mixed = New(big, {n, C}), z = New(big, {n, V}), ba = New(act, {2 * n * Hv});
    Tensor b = ba.Rows(0, n * Hv), gate_a = ba.Rows(n * Hv, 2 * n * Hv);
    Project(P, xn1.data<T>(), c, state.opts, mixed.data<T>(), z.data<T>(), b.data<T>(), gate_a.data<T>());
    Done(xn1);
    keep_copy(kMixed, mixed);

    Tensor s0 = New(act, {Hv, dk, dv}), tail0 = New(act, {K - 1, C});
    LinearBoundary* out = RecurrentBoundaries(l, c, state, s0, tail0);
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    Tensor xc = New(big, {n, C});
    for (const ChunkPiece& p : pieces)
      ops_.conv1d_forward(mixed.data<T>() + p.row * C, p.first ? tail0.data<T>() : nullptr, W(P.conv), nullptr, p.rows,
                          C, K, xc.data<T>() + p.row * C, p.last && out ? out->tail.data<T>() : nullptr);
    Done(mixed);
    keep_copy(kXc, xc);
    DeltaInputs in_t = DeltaRuleInputs(P, xc, b.data<T>(), gate_a.data<T>(), n);
    Done(xc);
    Tensor core = New(big, {n, V});
    for (const ChunkPiece& p : pieces)
      ops_.gated_delta_forward(in_t.q.data<T>() + p.row * a.key_dim(), in_t.k.data<T>() + p.row * a.key_dim(),
                               in_t.v.data<T>() + p.row * V, in_t.g.data<T>() + p.row * Hv,
                               in_t.beta.data<T>() + p.row * Hv, p.first ? s0.data<T>() : nullptr, p.rows, a.key_heads,
                               Hv, dk, dv, core.data<T>() + p.row * V, p.last && out ? out->s.data<T>() : nullptr);
    if (out) state.StashLinear(*out);
    Keep(kept, kCore, core, act);
    // The gated norm: w rmsnorm(o) silu(z), per value head (a plain RMSNorm weight, not a zero-centred one).
    Tensor normed = New(big, {n, V}), core_rstd = New(act, {n * Hv}), gated = New(big, {n, V});
    ops_.rmsnorm_forward(core.data<T>(), W(P.norm), n * Hv, dv, cfg_.rms_norm_eps, normed.data<T>(),
                         core_rstd.data<T>());
    Done(core);
    Store::SwigluAndKeep(ops_, z, normed, gated, act, Slot(kept, kZ), Slot(kept, kNormed), Slot(kept, kGated));
    Done(z), Done(normed);
    Tensor h = New(big, {n, d});
    ops_.copy(h.data<T>(), x_in.data<T>(), n * d);
    RowParallelAdd(gated.data<T>(), V, P.out, -1, c, state.opts, h.data<T>());
    if (kept) {
      (*kept)[kXn1] = std::move(xn1_kept);
      (*kept)[kRstd1] = rstd1, (*kept)[kBA] = ba, (*kept)[kS0] = s0, (*kept)[kTail0] = tail0;
      (*kept)[kCoreRstd] = core_rstd;
    }
    return h;
  }

  // Gated DeltaNet's backward: dxn1 from dh; accumulates the parameters' gradients, consumes the gradient later
  // chunks relayed to c's output state and leaves that of its input state.
  Tensor DeltaNetBackward(int l, Chunk c, const T* dh, const std::vector<Tensor>& s, TransformerState& state) {
    const LayerParams& L = layers_[l];
    const DeltaNetParams& P = L.delta;
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t n = c.size(), d = cfg_.hidden_size, C = a.conv_dim(), K = a.conv_kernel, Kd = a.key_dim();
    const int64_t V = a.value_dim(), Hv = a.value_heads, Hk = a.key_heads, dk = a.key_head_dim, dv = a.value_head_dim;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };

    // out_proj, the gated norm
    Tensor dgated = New(ws, {n, V}), dz = New(ws, {n, V}), dnormed = New(ws, {n, V}), dcore = New(ws, {n, V});
    Store::GemmW(ops_, false, n, V, d, T(1), dh, d, P.out, V, T(0), dgated.data<T>(), V);
    {
      const Tensor gated = wide(kGated);
      if (T* g = G(P.out)) ops_.gemm(true, false, d, V, n, T(1), dh, d, gated.data<T>(), V, T(1), g, V);
      Store::LoraBackward(ops_, P.out, gated.data<T>(), dh, d, dgated.data<T>(), c, state.opts);
    }
    Store::SwigluBackwardKept(ops_, dgated.data<T>(), s[kZ], s[kNormed], dz.data<T>(), dnormed.data<T>());
    ops_.rmsnorm_backward(dnormed.data<T>(), wide(kCore).template data<T>(), W(P.norm), s[kCoreRstd].data<T>(), n * Hv,
                          dv, dcore.data<T>(), GradOrScratch(P.norm), false);

    // The delta rule. The gradient of c's output state is complete (later chunks ran their backward first); c
    // leaves the gradient of its input state for the previous chunk (none where a document starts).
    const Tensor xc = wide(kXc);
    const T* b = s[kBA].data<T>();
    const T* gate_a = b + n * Hv;
    DeltaInputs in_t = DeltaRuleInputs(P, xc, b, gate_a, n);
    const LinearBoundary* gout = TransformerState::Find(state.linear_grad, l, c.end);
    LinearBoundary* gin = BoundaryGradient(l, c, state, {Hv, dk, dv}, {K - 1, C});
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    Tensor dq = New(ws, {n, Kd}), dkey = New(ws, {n, Kd}), dvalue = New(ws, {n, V});
    Tensor dg = New(ws, {n, Hv}), dbeta = New(ws, {n, Hv});
    {
      int64_t longest = 0;
      for (const ChunkPiece& p : pieces) longest = std::max(longest, p.rows);
      Tensor work = New(ws, {std::max<int64_t>(1, ops_.gated_delta_workspace_elems(longest, Hv, dk, dv))});
      for (const ChunkPiece& p : pieces)
        ops_.gated_delta_backward(dcore.data<T>() + p.row * V, p.last && gout ? gout->s.data<T>() : nullptr,
                                  in_t.q.data<T>() + p.row * Kd, in_t.k.data<T>() + p.row * Kd,
                                  in_t.v.data<T>() + p.row * V, in_t.g.data<T>() + p.row * Hv,
                                  in_t.beta.data<T>() + p.row * Hv, p.first ? s[kS0].data<T>() : nullptr, p.rows, Hk,
                                  Hv, dk, dv, dq.data<T>() + p.row * Kd, dkey.data<T>() + p.row * Kd,
                                  dvalue.data<T>() + p.row * V, dg.data<T>() + p.row * Hv, dbeta.data<T>() + p.row * Hv,
                                  p.first && gin ? gin->s.data<T>() : nullptr, work.data<T>());
    }
    Tensor dba = New(ws, {2 * n * Hv});
    T* db = dba.data<T>();
    T* da = db + n * Hv;
    ops_.gdn_gates_backward(dg.data<T>(), dbeta.data<T>(), gate_a, b, W(P.a_log), W(P.dt_bias), n, Hv, da, db,
                            GradOrScratch(P.a_log), GradOrScratch(P.dt_bias));

    // q and k through their L2 norms, then (q, k, v) = silu(xc)
    Tensor du = New(ws, {n, C});
    {
      Tensor draw = New(ws, {n, Kd});
      L2NormBackward(dq.data<T>(), in_t.q_raw.data<T>(), in_t.q_rstd.data<T>(), n * Hk, dk, QScale(), draw.data<T>());
      ops_.copy_rows(du.data<T>(), C, draw.data<T>(), Kd, n, Kd);
      L2NormBackward(dkey.data<T>(), in_t.k_raw.data<T>(), in_t.k_rstd.data<T>(), n * Hk, dk, 1, draw.data<T>());
      ops_.copy_rows(du.data<T>() + Kd, C, draw.data<T>(), Kd, n, Kd);
      ops_.copy_rows(du.data<T>() + 2 * Kd, C, dvalue.data<T>(), V, n, V);
    }
    Tensor dxc = New(ws, {n, C}), dmixed = New(ws, {n, C});
    ops_.silu_backward(du.data<T>(), xc.data<T>(), n * C, dxc.data<T>());
    {
      const Tensor mixed = wide(kMixed);
      for (const ChunkPiece& p : pieces)
        ops_.conv1d_backward(dxc.data<T>() + p.row * C, p.last && gout ? gout->tail.data<T>() : nullptr,
                             mixed.data<T>() + p.row * C, p.first ? s[kTail0].data<T>() : nullptr, W(P.conv), p.rows, C,
                             K, dmixed.data<T>() + p.row * C, p.first && gin ? gin->tail.data<T>() : nullptr,
                             GradOrScratch(P.conv), nullptr);
    }
    Tensor dxn1 = New(ws, {n, d});
    const Tensor xn1 = wide(kXn1);
    ProjectBackward(P, xn1.data<T>(), c, state.opts, dmixed.data<T>(), dz.data<T>(), db, da, dxn1.data<T>());
    return dxn1;
  }

  // ---- Mamba-2 (transformers' Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer, FalconH1Mixer) ----
  // h = x + out_proj(w rmsnorm_g(y silu(z))), y = the SSD scan of (x, dt, B, C) plus D x, with (x, B, C) =
  // silu(conv(xBC)) and (z, xBC, dt) = in_proj(xn1), xn1 = norm1(x); rmsnorm_g normalises groups of intermediate /
  // n_groups columns. The conv's tail and the scan's state carry from chunk to chunk, restarting where a document
  // does (as Gated DeltaNet's).
  Tensor Mamba2Forward(int l, Chunk c, const Tensor& x_in, TransformerState& state, MemCategory act,
                       std::vector<Tensor>* kept) {
    const LayerParams& L = layers_[l];
    const Mamba2Params& P = L.mamba;
    const Mamba2Config& m = cfg_.mamba;
    const int64_t n = c.size(), d = cfg_.hidden_size, I = m.intermediate(), C = m.conv_dim(), H = m.heads;
    const MemCategory big = Store::ActCategory(act);
    auto keep_copy = [&](Saved k, const Tensor& t) {
      if (kept) (*kept)[k] = Store::Narrow(ops_, t, act);
    };
    Tensor xn1 = New(big, {n, d}), rstd1 = New(act, {n});
    Tensor xn1_kept = Norm(x_in.data<T>(), L.norm1, xn1, rstd1, act, kept != nullptr);
    Tensor z = New(big, {n, I}), xbc = New(big, {n, C}), dt = New(act, {n, H});
    {
      const int64_t R = m.in_proj_rows();
      Tensor proj = New(MemCategory::kWorkspace, {n, R});
      Linear(xn1.data<T>(), n, d, P.in_proj, P.in_bias, proj.data<T>(), R, c, state.opts);
      ScaleInProj(proj.data<T>(), n);
      ops_.copy_rows(z.data<T>(), I, proj.data<T>(), R, n, I);
      ops_.copy_rows(xbc.data<T>(), C, proj.data<T>() + I, R, n, C);
      ops_.copy_rows(dt.data<T>(), H, proj.data<T>() + I + C, R, n, H);
    }
    Done(xn1);
    keep_copy(kMixed, xbc);
    keep_copy(kZ, z);
    Tensor s0 = New(act, {H, m.head_dim, m.state}), tail0 = New(act, {m.conv_kernel - 1, C});
    LinearBoundary* out = RecurrentBoundaries(l, c, state, s0, tail0);
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    Tensor xc = New(big, {n, C});
    const T* conv_bias = P.conv_bias >= 0 ? W(P.conv_bias) : nullptr;
    for (const ChunkPiece& p : pieces)
      ops_.conv1d_forward(xbc.data<T>() + p.row * C, p.first ? tail0.data<T>() : nullptr, W(P.conv), conv_bias, p.rows,
                          C, m.conv_kernel, xc.data<T>() + p.row * C, p.last && out ? out->tail.data<T>() : nullptr);
    Done(xbc);
    keep_copy(kXc, xc);
    const SsdInputs in = SsdInputsOf(xc, n);
    Done(xc);
    Tensor y = New(big, {n, I});
    const int64_t GN = m.groups * m.state;
    for (const ChunkPiece& p : pieces)
      ops_.ssd_forward(in.x.data<T>() + p.row * I, dt.data<T>() + p.row * H, W(P.dt_bias), W(P.a_log),
                       in.B.data<T>() + p.row * GN, in.C.data<T>() + p.row * GN, W(P.d),
                       p.first ? s0.data<T>() : nullptr, p.rows, H, m.head_dim, m.groups, m.state, m.dt_min, m.dt_max,
                       y.data<T>() + p.row * I, p.last && out ? out->s.data<T>() : nullptr);
    if (out) state.StashLinear(*out);
    keep_copy(kCore, y);
    Tensor gated = New(big, {n, I}), group_rstd = New(act, {n * m.groups});
    if (m.gated_norm)
      ops_.gated_group_rmsnorm_forward(y.data<T>(), z.data<T>(), W(P.norm), n, I, I / m.groups, m.norm_eps,
                                       gated.data<T>(), group_rstd.data<T>());
    else  // y silu(z)
      ops_.swiglu_forward(z.data<T>(), y.data<T>(), n * I, gated.data<T>());
    Done(y), Done(z);
    Keep(kept, kGated, gated, act);
    Tensor h = New(big, {n, d});
    ops_.copy(h.data<T>(), x_in.data<T>(), n * d);
    RowParallelAdd(gated.data<T>(), I, P.out, P.out_bias, c, state.opts, h.data<T>());
    if (kept) {
      (*kept)[kXn1] = std::move(xn1_kept);
      (*kept)[kRstd1] = rstd1, (*kept)[kBA] = dt, (*kept)[kS0] = s0, (*kept)[kTail0] = tail0;
      (*kept)[kCoreRstd] = group_rstd;
    }
    return h;
  }

  // Mamba-2's backward: dxn1 from dh; accumulates the parameters' gradients, consumes the gradient later chunks
  // relayed to c's output state and leaves that of its input state.
  Tensor Mamba2Backward(int l, Chunk c, const T* dh, const std::vector<Tensor>& s, TransformerState& state) {
    const Mamba2Params& P = layers_[l].mamba;
    const Mamba2Config& m = cfg_.mamba;
    const int64_t n = c.size(), d = cfg_.hidden_size, I = m.intermediate(), C = m.conv_dim(), H = m.heads;
    const int64_t GN = m.groups * m.state, R = m.in_proj_rows();
    constexpr MemCategory ws = MemCategory::kWorkspace;
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };

    // out_proj, the gated norm
    Tensor dgated = New(ws, {n, I}), dy = New(ws, {n, I}), dproj = New(ws, {n, R});
    Store::GemmW(ops_, false, n, I, d, T(1), dh, d, P.out, I, T(0), dgated.data<T>(), I);
    {
      const Tensor gated = wide(kGated);
      if (T* g = G(P.out)) ops_.gemm(true, false, d, I, n, T(1), dh, d, gated.data<T>(), I, T(1), g, I);
      BiasBackward(P.out_bias, dh, n, d);
      Store::LoraBackward(ops_, P.out, gated.data<T>(), dh, d, dgated.data<T>(), c, state.opts);
      Tensor dz = New(ws, {n, I});
      if (m.gated_norm)
        ops_.gated_group_rmsnorm_backward(dgated.data<T>(), wide(kCore).template data<T>(), wide(kZ).template data<T>(),
                                          W(P.norm), s[kCoreRstd].data<T>(), n, I, I / m.groups, m.norm_eps,
                                          dy.data<T>(), dz.data<T>(), GradOrScratch(P.norm));
      else
        ops_.swiglu_backward(dgated.data<T>(), wide(kZ).template data<T>(), wide(kCore).template data<T>(), n * I,
                             dz.data<T>(), dy.data<T>());
      ops_.copy_rows(dproj.data<T>(), R, dz.data<T>(), I, n, I);
    }

    // The scan. The gradient of c's output state is complete (later chunks ran their backward first); c leaves the
    // gradient of its input state for the previous chunk (none where a document starts). Under adjoint sharding
    // the scan's part of it is the tokens their pairs (t, i) read instead (LaterTokens).
    const Tensor xc = wide(kXc);
    const SsdInputs in = SsdInputsOf(xc, n);
    const T* dt = s[kBA].data<T>();
    const bool adjoint = state.opts.adjoint_window > 0;
    const LinearBoundary* gout = TransformerState::Find(state.linear_grad, l, c.end);
    LinearBoundary* gin =
        BoundaryGradient(l, c, state, adjoint ? std::vector<int64_t>{} : std::vector<int64_t>{H, m.head_dim, m.state},
                         {m.conv_kernel - 1, C});
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    Tensor dx = New(ws, {n, I}), dB = New(ws, {n, GN}), dC = New(ws, {n, GN}), ddt = New(ws, {n, H});
    {
      int64_t longest = 0;
      for (const ChunkPiece& p : pieces) longest = std::max(longest, p.rows);
      Tensor work =
          New(ws, {std::max<int64_t>(1, ops_.ssd_workspace_elems(longest, H, m.head_dim, m.groups, m.state))});
      if (adjoint) {
        // Pairs (t, i) stay inside a document: only the last piece reads the tokens after c (of its document, as
        // relayed), and earlier chunks read c's first piece (and what follows it when c is one piece), or nothing.
        LaterTokens& later = state.later[l];
        if (later.rows > 0 && later.begin != c.end)
          throw std::logic_error(absl::StrCat("Mamba-2 layer ", l, ": adjoint cotangents start at ", later.begin,
                                              ", not after the chunk ending at ", c.end));
        for (const ChunkPiece& p : pieces) {
          const int64_t reads = p.last ? later.rows : 0;
          state.adjoint_pairs += ops_.ssd_backward_pairs(
              dy.data<T>() + p.row * I, in.x.data<T>() + p.row * I, dt + p.row * H, W(P.dt_bias), W(P.a_log),
              in.B.data<T>() + p.row * GN, in.C.data<T>() + p.row * GN, W(P.d), p.first ? s[kS0].data<T>() : nullptr,
              p.rows, H, m.head_dim, m.groups, m.state, m.dt_min, m.dt_max, reads ? later.dy.data<T>() : nullptr,
              reads ? later.dt.data<T>() : nullptr, reads ? later.C.data<T>() : nullptr, reads,
              state.opts.adjoint_window, dx.data<T>() + p.row * I, ddt.data<T>() + p.row * H, GradOrScratch(P.dt_bias),
              GradOrScratch(P.a_log), dB.data<T>() + p.row * GN, dC.data<T>() + p.row * GN, GradOrScratch(P.d),
              work.data<T>());
        }
        later = gin ? PrependTokens(c.begin, pieces[0].rows, dy, s[kBA], in.C,
                                    pieces.size() == 1 ? later : LaterTokens{}, state.opts.adjoint_window - 1)
                    : LaterTokens{};
      } else {
        for (const ChunkPiece& p : pieces)
          ops_.ssd_backward(dy.data<T>() + p.row * I, p.last && gout ? gout->s.data<T>() : nullptr,
                            in.x.data<T>() + p.row * I, dt + p.row * H, W(P.dt_bias), W(P.a_log),
                            in.B.data<T>() + p.row * GN, in.C.data<T>() + p.row * GN, W(P.d),
                            p.first ? s[kS0].data<T>() : nullptr, p.rows, H, m.head_dim, m.groups, m.state, m.dt_min,
                            m.dt_max, dx.data<T>() + p.row * I, ddt.data<T>() + p.row * H, GradOrScratch(P.dt_bias),
                            GradOrScratch(P.a_log), dB.data<T>() + p.row * GN, dC.data<T>() + p.row * GN,
                            GradOrScratch(P.d), p.first && gin ? gin->s.data<T>() : nullptr, work.data<T>());
      }
    }
    ops_.copy_rows(dproj.data<T>() + I + C, R, ddt.data<T>(), H, n, H);

    // (x, B, C) = silu(xc), xc = conv(xBC)
    Tensor du = New(ws, {n, C}), dxc = New(ws, {n, C}), dxbc = New(ws, {n, C});
    ops_.copy_rows(du.data<T>(), C, dx.data<T>(), I, n, I);
    ops_.copy_rows(du.data<T>() + I, C, dB.data<T>(), GN, n, GN);
    ops_.copy_rows(du.data<T>() + I + GN, C, dC.data<T>(), GN, n, GN);
    ops_.silu_backward(du.data<T>(), xc.data<T>(), n * C, dxc.data<T>());
    {
      const Tensor xbc = wide(kMixed);
      T* dconv_bias = P.conv_bias >= 0 ? GradOrScratch(P.conv_bias) : nullptr;
      for (const ChunkPiece& p : pieces)
        ops_.conv1d_backward(dxc.data<T>() + p.row * C, p.last && gout ? gout->tail.data<T>() : nullptr,
                             xbc.data<T>() + p.row * C, p.first ? s[kTail0].data<T>() : nullptr, W(P.conv), p.rows, C,
                             m.conv_kernel, dxbc.data<T>() + p.row * C, p.first && gin ? gin->tail.data<T>() : nullptr,
                             GradOrScratch(P.conv), dconv_bias);
    }
    ops_.copy_rows(dproj.data<T>() + I, R, dxbc.data<T>(), C, n, C);
    Tensor dxn1 = New(ws, {n, d});
    const Tensor xn1 = wide(kXn1);
    ScaleInProj(dproj.data<T>(), n);
    LinearBackward(dproj.data<T>(), R, xn1.data<T>(), n, P.in_proj, P.in_bias, dxn1.data<T>(), T(0), c, state.opts);
    return dxn1;
  }

  // Falcon-H1: in_proj's input scaled by ssm_in_multiplier and its output groups (z, x, B, C, dt) by ssm_multipliers;
  // in_proj has no bias there, so both are scales of its output rows [n][in_proj_rows] (and of their gradient).
  void ScaleInProj(T* proj, int64_t n) {
    const MupMultipliers& mup = cfg_.mup;
    const Mamba2Config& m = cfg_.mamba;
    if (mup.ssm_in == 1.0 && mup.ssm == MupMultipliers().ssm) return;
    const int64_t I = m.intermediate(), GN = m.groups * m.state;
    const int64_t widths[5] = {I, I, GN, GN, m.heads};
    for (int64_t r = 0; r < n; ++r) {
      T* row = proj + r * m.in_proj_rows();
      for (int g = 0; g < 5; row += widths[g], ++g) ops_.scale(row, widths[g], mup.ssm_in * mup.ssm[g]);
    }
  }

  SsdInputs SsdInputsOf(const Tensor& xc, int64_t n) {
    const Mamba2Config& m = cfg_.mamba;
    const int64_t I = m.intermediate(), C = m.conv_dim(), GN = m.groups * m.state;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor u = New(ws, {n, C});
    ops_.silu_forward(xc.data<T>(), n * C, u.data<T>());
    SsdInputs r{New(ws, {n, I}), New(ws, {n, GN}), New(ws, {n, GN})};
    ops_.copy_rows(r.x.data<T>(), I, u.data<T>(), C, n, I);
    ops_.copy_rows(r.B.data<T>(), GN, u.data<T>() + I, C, n, GN);
    ops_.copy_rows(r.C.data<T>(), GN, u.data<T>() + I + GN, C, n, GN);
    return r;
  }

  // A recurrent layer's state before chunk c into s0 and tail0 (zeros where a document, or the sequence, starts),
  // and the boundary its state after c goes to (null: none kept), allocated like s0 and tail0.
  LinearBoundary* RecurrentBoundaries(int l, Chunk c, TransformerState& state, Tensor& s0, Tensor& tail0) {
    const bool carries_in = !StartsDocument(state.opts.doc_starts, c.begin);
    const LinearBoundary* in = carries_in ? TransformerState::Find(state.linear_cache, l, c.begin) : nullptr;
    if (carries_in && !in)
      throw std::logic_error(absl::StrCat("recurrent layer ", l, ": no state at position ", c.begin));
    if (in) {
      state.LoadLinear(*in, s0, tail0);
    } else {
      s0.SetZero();
      tail0.SetZero();
    }
    LinearBoundary* out = KeepsStateAfter(state.opts, c) ? &state.linear_cache[{l, c.end}] : nullptr;
    if (out && !out->s.defined()) {
      out->s = New(MemCategory::kKVCache, s0.shape());
      out->tail = New(MemCategory::kKVCache, tail0.shape());
    }
    return out;
  }
  // Where chunk c's backward leaves the gradient of its input state (null where a document starts at c); s_shape
  // empty: the conv tail's only (adjoint sharding relays LaterTokens instead of the scan state's).
  LinearBoundary* BoundaryGradient(int l, Chunk c, TransformerState& state, std::vector<int64_t> s_shape,
                                   std::vector<int64_t> tail_shape) {
    if (StartsDocument(state.opts.doc_starts, c.begin)) return nullptr;
    LinearBoundary* gin = &state.linear_grad[{l, c.begin}];
    if (!gin->tail.defined()) {
      if (!s_shape.empty()) gin->s = New(MemCategory::kKVGrad, std::move(s_shape));
      gin->tail = New(MemCategory::kKVGrad, std::move(tail_shape));
    }
    return gin;
  }
  // The scan output cotangents dy, raw time steps dt and C of the `rows` tokens from `begin` (c's first, at c's
  // rows 0, ...), followed by the tokens after them (`after`), cut to the first `keep` rows: what the pairs of the
  // chunks before read.
  LaterTokens PrependTokens(int64_t begin, int64_t rows, const Tensor& dy, const Tensor& dt, const Tensor& C,
                            const LaterTokens& after, int64_t keep) {
    const Mamba2Config& m = cfg_.mamba;
    LaterTokens out;
    out.begin = begin;
    out.rows = std::min(keep, rows + after.rows);
    if (out.rows == 0) return out;
    const int64_t here = std::min(out.rows, rows), there = out.rows - here;
    auto join = [&](const Tensor& first, const Tensor& then, int64_t width) {
      Tensor t = New(MemCategory::kKVGrad, {out.rows, width});
      ops_.copy(t.data<T>(), first.data<T>(), here * width);
      if (there) ops_.copy(t.data<T>() + here * width, then.data<T>(), there * width);
      return t;
    };
    out.dy = join(dy, after.dy, m.intermediate());
    out.dt = join(dt, after.dt, m.heads);
    out.C = join(C, after.C, m.groups * m.state);
    return out;
  }

  // The delta rule's inputs from the conv's output xc [n][conv channels] and b, a [n][value heads].
  DeltaInputs DeltaRuleInputs(const DeltaNetParams& P, const Tensor& xc, const T* b, const T* gate_a, int64_t n) {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t C = a.conv_dim(), Kd = a.key_dim(), V = a.value_dim(), Hk = a.key_heads, Hv = a.value_heads;
    constexpr MemCategory ws = MemCategory::kWorkspace;
    Tensor u = New(ws, {n, C});
    ops_.silu_forward(xc.data<T>(), n * C, u.data<T>());
    DeltaInputs r;
    r.q_raw = New(ws, {n, Kd}), r.k_raw = New(ws, {n, Kd}), r.v = New(ws, {n, V});
    ops_.copy_rows(r.q_raw.data<T>(), Kd, u.data<T>(), C, n, Kd);
    ops_.copy_rows(r.k_raw.data<T>(), Kd, u.data<T>() + Kd, C, n, Kd);
    ops_.copy_rows(r.v.data<T>(), V, u.data<T>() + 2 * Kd, C, n, V);
    r.q = New(ws, {n, Kd}), r.k = New(ws, {n, Kd}), r.q_rstd = New(ws, {n * Hk}), r.k_rstd = New(ws, {n * Hk});
    L2Norm(r.q_raw.data<T>(), n * Hk, a.key_head_dim, QScale(), r.q.data<T>(), r.q_rstd.data<T>());
    L2Norm(r.k_raw.data<T>(), n * Hk, a.key_head_dim, 1, r.k.data<T>(), r.k_rstd.data<T>());
    r.g = New(ws, {n, Hv}), r.beta = New(ws, {n, Hv});
    ops_.gdn_gates_forward(gate_a, b, W(P.a_log), W(P.dt_bias), n, Hv, r.g.data<T>(), r.beta.data<T>());
    return r;
  }
  // transformers scales the L2-normed query by key_head_dim^-1/2.
  double QScale() const { return 1.0 / std::sqrt(static_cast<double>(cfg_.linear.key_head_dim)); }
  // y = x rsqrt(sum x^2 + 1e-6) scale per row of dim (transformers' l2norm), as the RMSNorm of weight
  // scale / sqrt(dim) and epsilon 1e-6 / dim: the same function, so the same backward.
  void L2Norm(const T* x, int64_t rows, int64_t dim, double scale, T* y, T* rstd) {
    Tensor w = L2Weight(dim, scale);
    ops_.rmsnorm_forward(x, w.data<T>(), rows, dim, 1e-6 / static_cast<double>(dim), y, rstd);
  }
  void L2NormBackward(const T* dy, const T* x, const T* rstd, int64_t rows, int64_t dim, double scale, T* dx) {
    Tensor w = L2Weight(dim, scale), dw = Tensor::Zeros(&mem_, MemCategory::kWorkspace, Store::kDType, {dim});
    ops_.rmsnorm_backward(dy, x, w.data<T>(), rstd, rows, dim, dx, dw.data<T>(), false);
  }
  Tensor L2Weight(int64_t dim, double scale) {
    Tensor w = New(MemCategory::kWorkspace, {dim});
    ops_.fill(w.data<T>(), dim, static_cast<T>(scale / std::sqrt(static_cast<double>(dim))));
    return w;
  }

  // Qwen3-Next's fused projections, per key head j: in_proj_qkvz's rows [q_j, k_j, v and z of j's value heads],
  // in_proj_ba's [b, a of j's value heads]. Each piece: its offset in the fused rows, in its own tensor, its width
  // and which of mixed (0), z (1), b (2), a (3) it belongs to.
  struct FusedPiece {
    int64_t fused, own, width;
    int target;
  };
  std::vector<FusedPiece> FusedLayout() const {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t r = a.value_heads / a.key_heads, dk = a.key_head_dim, rv = r * a.value_head_dim;
    const int64_t group = 2 * dk + 2 * rv;
    std::vector<FusedPiece> pieces;
    for (int64_t j = 0; j < a.key_heads; ++j) {
      pieces.push_back({j * group, j * dk, dk, 0});
      pieces.push_back({j * group + dk, a.key_dim() + j * dk, dk, 0});
      pieces.push_back({j * group + 2 * dk, 2 * a.key_dim() + j * rv, rv, 0});
      pieces.push_back({j * group + 2 * dk + rv, j * rv, rv, 1});
      pieces.push_back({j * 2 * r, j * r, r, 2});
      pieces.push_back({j * 2 * r + r, j * r, r, 3});
    }
    return pieces;
  }
  // Between the fused projections' outputs (qkvz [n][conv channels + value dim], ba [n][2 value heads]) and mixed,
  // z, b, a; to_fused: the other way (their gradients).
  void CopyFused(bool to_fused, T* qkvz, T* ba, T* mixed, T* z, T* b, T* gate_a, int64_t n) {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t ld_fused[2] = {a.conv_dim() + a.value_dim(), 2 * a.value_heads};
    T* own[4] = {mixed, z, b, gate_a};
    const int64_t ld_own[4] = {a.conv_dim(), a.value_dim(), a.value_heads, a.value_heads};
    for (const FusedPiece& p : FusedLayout()) {
      const int f = p.target < 2 ? 0 : 1;
      T* fused = (f == 0 ? qkvz : ba) + p.fused;
      T* mine = own[p.target] + p.own;
      if (to_fused)
        ops_.copy_rows(fused, ld_fused[f], mine, ld_own[p.target], n, p.width);
      else
        ops_.copy_rows(mine, ld_own[p.target], fused, ld_fused[f], n, p.width);
    }
  }
  // mixed (q, k, v: the conv's input), z, b and a of xn [n][hidden] (with LoRA adapters).
  void Project(const DeltaNetParams& P, const T* xn, Chunk c, const StateOptions& st, T* mixed, T* z, T* b, T* gate_a) {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t n = c.size(), d = cfg_.hidden_size, C = a.conv_dim(), V = a.value_dim(), H = a.value_heads;
    if (P.qkv >= 0) {
      Linear(xn, n, d, P.qkv, -1, mixed, C, c, st);
      Linear(xn, n, d, P.z, -1, z, V, c, st);
      Linear(xn, n, d, P.b, -1, b, H, c, st);
      Linear(xn, n, d, P.a, -1, gate_a, H, c, st);
      return;
    }
    Tensor qkvz = New(MemCategory::kWorkspace, {n, C + V}), ba = New(MemCategory::kWorkspace, {n, 2 * H});
    Linear(xn, n, d, P.qkvz, -1, qkvz.data<T>(), C + V, c, st);
    Linear(xn, n, d, P.ba, -1, ba.data<T>(), 2 * H, c, st);
    CopyFused(false, qkvz.data<T>(), ba.data<T>(), mixed, z, b, gate_a, n);
  }
  // Project's backward: dxn assigned, weight (and adapter) gradients accumulated.
  void ProjectBackward(const DeltaNetParams& P, const T* xn, Chunk c, const StateOptions& st, T* dmixed, T* dz, T* db,
                       T* da, T* dxn) {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t n = c.size(), C = a.conv_dim(), V = a.value_dim(), H = a.value_heads;
    if (P.qkv >= 0) {
      LinearBackward(dmixed, C, xn, n, P.qkv, -1, dxn, T(0), c, st);
      LinearBackward(dz, V, xn, n, P.z, -1, dxn, T(1), c, st);
      LinearBackward(db, H, xn, n, P.b, -1, dxn, T(1), c, st);
      LinearBackward(da, H, xn, n, P.a, -1, dxn, T(1), c, st);
      return;
    }
    Tensor dqkvz = New(MemCategory::kWorkspace, {n, C + V}), dba = New(MemCategory::kWorkspace, {n, 2 * H});
    CopyFused(true, dqkvz.data<T>(), dba.data<T>(), dmixed, dz, db, da, n);
    LinearBackward(dqkvz.data<T>(), C + V, xn, n, P.qkvz, -1, dxn, T(0), c, st);
    LinearBackward(dba.data<T>(), 2 * H, xn, n, P.ba, -1, dxn, T(1), c, st);
  }
  // The MLP's parameters under p ("...mlp."): SwiGLU's, ReLU²'s or a MoE block's.
  template <typename AddFn>
  void AddMlp(const std::string& p, LayerParams& L, AddFn& add) {
    const int64_t d = cfg_.hidden_size, f = inter_;
    const TpShard rows{TpSplit::kRows}, cols{TpSplit::kCols}, whole{};
    if (cfg_.is_moe(static_cast<int64_t>(layers_.size()))) {
      // The experts are not split (tensor parallelism is refused on MoE layers, CreateTransformer).
      const MoeConfig& m = cfg_.moe;
      const int64_t E = m.experts, I = m.intermediate, S = m.shared_intermediate;
      L.moe = true;
      MoeParams& M = L.experts;
      M.index =
          static_cast<int>(std::count_if(layers_.begin(), layers_.end(), [](const LayerParams& l) { return l.moe; }));
      M.router = add(p + "gate.weight", {E, d}, whole);
      M.gate_up = add(p + "experts.gate_up_proj", {E, 2 * I, d}, whole);
      M.down = add(p + "experts.down_proj", {E, d, I}, whole);
      if (S > 0) {
        M.shared_gate = add(p + "shared_expert.gate_proj.weight", {S, d}, whole);
        M.shared_up = add(p + "shared_expert.up_proj.weight", {S, d}, whole);
        M.shared_down = add(p + "shared_expert.down_proj.weight", {d, S}, whole);
        M.shared_router = add(p + "shared_expert_gate.weight", {1, d}, whole);
      }
      return;
    }
    if (L.mlp == Mlp::kSwiGlu) {  // ReLU²'s has no gate
      L.gate = add(p + "gate_proj.weight", {f, d}, rows);
      L.gate_bias = cfg_.mlp_bias ? add(p + "gate_proj.bias", {f}, rows) : -1;
    }
    L.up = add(p + "up_proj.weight", {f, d}, rows);
    L.up_bias = cfg_.mlp_bias ? add(p + "up_proj.bias", {f}, rows) : -1;
    L.down = add(p + "down_proj.weight", {d, f}, cols);
    L.down_bias = cfg_.mlp_bias ? add(p + "down_proj.bias", {d}, whole) : -1;
  }
  // Gated DeltaNet's parameters under p ("...linear_attn."), in the layout of the config's architecture. The conv
  // filter, A_log and dt_bias stay in T under bf16 storage, as Mamba's conv and scan parameters do.
  template <typename AddFn>
  DeltaNetParams AddDeltaNet(const std::string& p, AddFn& add) {
    const LinearAttentionConfig& a = cfg_.linear;
    const int64_t d = cfg_.hidden_size, C = a.conv_dim(), V = a.value_dim(), H = a.value_heads;
    const TpShard whole{};  // tensor parallelism is refused on hybrids with linear layers (CreateTransformer)
    DeltaNetParams P;
    if (cfg_.architecture == "qwen3_next") {
      P.qkvz = add(p + "in_proj_qkvz.weight", {C + V, d}, whole);
      P.ba = add(p + "in_proj_ba.weight", {2 * H, d}, whole);
    } else {
      P.qkv = add(p + "in_proj_qkv.weight", {C, d}, whole);
      P.z = add(p + "in_proj_z.weight", {V, d}, whole);
      P.b = add(p + "in_proj_b.weight", {H, d}, whole);
      P.a = add(p + "in_proj_a.weight", {H, d}, whole);
    }
    shards_.push_back(whole);
    P.conv = Store::AddFullPrecision(p + "conv1d.weight", {C, 1, a.conv_kernel});
    P.dt_bias = add(p + "dt_bias", {H}, whole);
    P.a_log = add(p + "A_log", {H}, whole);
    P.norm = add(p + "norm.weight", {a.value_head_dim}, whole);
    P.out = add(p + "out_proj.weight", {d, V}, whole);
    return P;
  }

  // Mamba-2's parameters under p ("...mixer." or "...mamba."). The conv filter (and its bias) stay in T under bf16
  // storage, as Gated DeltaNet's.
  template <typename AddFn>
  Mamba2Params AddMamba2(const std::string& p, AddFn& add) {
    const Mamba2Config& m = cfg_.mamba;
    const int64_t d = cfg_.hidden_size, I = m.intermediate(), C = m.conv_dim(), H = m.heads;
    const TpShard whole{};  // tensor parallelism is refused on Mamba-2 layers (CreateTransformer)
    Mamba2Params P;
    P.in_proj = add(p + "in_proj.weight", {m.in_proj_rows(), d}, whole);
    if (m.proj_bias) P.in_bias = add(p + "in_proj.bias", {m.in_proj_rows()}, whole);
    shards_.push_back(whole);
    P.conv = Store::AddFullPrecision(p + "conv1d.weight", {C, 1, m.conv_kernel});
    if (m.conv_bias) {
      shards_.push_back(whole);
      P.conv_bias = Store::AddFullPrecision(p + "conv1d.bias", {C});
    }
    P.dt_bias = add(p + "dt_bias", {H}, whole);
    P.a_log = add(p + "A_log", {H}, whole);
    P.d = add(p + "D", {H}, whole);
    if (m.gated_norm) P.norm = add(p + "norm.weight", {I}, whole);
    P.out = add(p + "out_proj.weight", {d, I}, whole);
    if (m.proj_bias) P.out_bias = add(p + "out_proj.bias", {d}, whole);
    return P;
  }

  // K/V of chunk c from the normed input, roped and written into the layer's cache pages.
  void AppendKV(int l, Chunk c, const T* xn1, TransformerState& state) {
    const LayerParams& L = layers_[l];
    const int kl = kv_index_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, kvd = kv_heads_ * cfg_.head_dim;
    Tensor k = New(MemCategory::kWorkspace, {n, kvd}), v = New(MemCategory::kWorkspace, {n, kvd});
    Linear(xn1, n, d, L.k, L.k_bias, k.data<T>(), kvd, c, state.opts);
    Linear(xn1, n, d, L.v, L.v_bias, v.data<T>(), kvd, c, state.opts);
    Scale(k.data<T>(), n * kvd, cfg_.mup.attention_in * cfg_.mup.key);
    Scale(v.data<T>(), n * kvd, cfg_.mup.attention_in);
    if (cfg_.qk_norm()) {
      const int64_t rows = n * kv_heads_;
      Tensor k_raw = New(MemCategory::kWorkspace, {n, kvd}), rstd = New(MemCategory::kWorkspace, {rows});
      ops_.copy(k_raw.data<T>(), k.data<T>(), n * kvd);
      Tensor w;
      ops_.rmsnorm_forward(k_raw.data<T>(), NormWeight(L.k_norm, w), rows, cfg_.head_dim, cfg_.rms_norm_eps,
                           k.data<T>(), rstd.data<T>());
    }
    state.kv.Ensure(kl, c.begin, c.end, /*zero_new=*/false);
    if (state.opts.doc_starts.empty() && cfg_.rotary_dim() == cfg_.head_dim && cfg_.rope) {
      state.kv.ScatterRoped<T>(kl, c.begin, c.end, k.data<T>(), v.data<T>(), state.inv_freq.data());
    } else {  // positions within each document, or partial RoPE: rope, then write (rope_kv_write's two steps)
      Rope(k.data<T>(), c, kv_heads_, /*inverse=*/false, state);
      state.kv.Scatter<T>(kl, c.begin, c.end, k.data<T>(), v.data<T>());
    }
    state.MarkKV(kl, c);
    if (state.opts.sparse_pages > 0) SumPageKeys(kl, c, state);
  }

  // Sparse attention's page summaries: the key sums of the pages chunk c completed (on the device: the chunk's
  // pages and the one before are resident), summed there in f64.
  void SumPageKeys(int l, Chunk c, TransformerState& state) {
    const int64_t ps = state.kv.page_size(), kvd = kv_heads_ * cfg_.head_dim;
    if (static_cast<int>(state.key_sums.size()) <= l) state.key_sums.resize(l + 1);
    Tensor& sums = state.key_sums[l];
    const int64_t pages = state.seq_len / ps;  // the sequence's complete pages
    if (!sums.defined())
      sums = Tensor::Empty(&mem_, MemCategory::kKVCache, DType::kF64, {std::max<int64_t>(pages, 1), kvd});
    const bool widen = state.kv.dtype() != dtype();  // bf16 pages are read through a widened copy of the page
    Tensor keys, values;
    if (widen) keys = New(MemCategory::kWorkspace, {ps, kvd}), values = New(MemCategory::kWorkspace, {ps, kvd});
    for (int64_t p = c.begin / ps; (p + 1) * ps <= c.end; ++p) {
      if (p >= pages) throw std::logic_error(absl::StrCat("sparse attention: page ", p, " past the sequence"));
      if (widen) state.kv.Gather<T>(l, p * ps, (p + 1) * ps, keys.data<T>(), values.data<T>());
      ops_.column_sums_f64(widen ? keys.data<T>() : state.kv.View<T>(l).k_page(p), ps, kvd,
                           sums.data<double>() + p * kvd);
    }
  }

  // Sparse attention's page mask for chunk c in layer l (null: dense). Made once per (layer, chunk) from the
  // chunk's roped queries and the cached keys, then reused: the recompute and the backward read the stored mask.
  // Always kept: the first page (FirstPage), the pages the chunk overlaps and the page before them; of the other
  // earlier pages of its documents the
  // sparse_pages ones with the highest score sum_h mean_q[h] . mean_k[page][group(h)] (ties: lower page).
  // The scores are computed on the device (OpTable::page_scores); they are the one thing a chunk reads back: one
  // f64 per candidate page, once per layer and chunk, because the host picks the pages (its page masks and the
  // offload's transfers follow from them).
  const uint8_t* SelectPages(int l, Chunk c, const T* q, TransformerState& state) {
    auto key = std::make_pair(l, c.begin);
    if (auto it = state.selection.find(key); it != state.selection.end()) return it->second.data();
    std::vector<uint8_t> mask = state.KeptPages(c);
    if (mask.empty()) return nullptr;  // dense
    const int64_t k = state.opts.sparse_pages, ps = state.kv.page_size(), first = state.FirstPage(c);
    const int64_t candidates = c.begin / ps - 2 - first;  // pages first + 1 .. first_local - 2, all complete
    if (candidates <= k) return state.selection.emplace(key, std::move(mask)).first->second.data();  // all kept
    const int64_t H = heads_, hd = cfg_.head_dim;
    Tensor q_sums = Tensor::Empty(&mem_, MemCategory::kWorkspace, DType::kF64, {H * hd});
    Tensor scores = Tensor::Empty(&mem_, MemCategory::kWorkspace, DType::kF64, {candidates});
    ops_.column_sums_f64(q, c.size(), H * hd, q_sums.data<double>());
    ops_.page_scores(q_sums.data<double>(), c.size(), H, kv_heads_, hd, state.key_sums.at(l).data<double>(), first + 1,
                     candidates, ps, scores.data<double>());
    if (mem_.device() == Device::kMeta) {
      // No scores on meta: pages 1..k. Any choice is the worst case: the page pools are allocated whole when the
      // sequence starts, so the bytes do not depend on which pages are picked.
      std::fill(mask.begin() + first + 1, mask.begin() + first + 1 + k, 1);
      return state.selection.emplace(key, std::move(mask)).first->second.data();
    }
    std::vector<double> score = HostCopy<double>(scores);
    tp_.AllReduceHost(score.data(), candidates, DType::kF64);  // over every rank's heads: one selection for all
    std::vector<int64_t> order(candidates);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    for (int64_t i = 0; i < k; ++i) mask[order[i] + first + 1] = 1;
    return state.selection.emplace(key, std::move(mask)).first->second.data();
  }

  // Rotates x, the rows of chunk c with `heads` heads, at each row's position within its document (RoPE restarts
  // at every document); inverse: the backward's transpose rotation.
  // Partial RoPE (hybrids, Bamba) rotates each head's first rotary_dim dims: gathered, rotated, put back.
  void Rope(T* x, Chunk c, int64_t heads, bool inverse, const TransformerState& state) {
    if (!cfg_.rope) return;  // Nemotron-H's attention has no positions
    const std::vector<int64_t>& docs = state.opts.doc_starts;
    const int64_t hd = cfg_.head_dim, dim = cfg_.rotary_dim(), rows = c.size() * heads;
    Tensor part;
    T* y = x;
    if (dim != hd) {
      part = New(MemCategory::kWorkspace, {rows, dim});
      ops_.copy_rows(part.data<T>(), dim, x, hd, rows, dim);
      y = part.data<T>();
    }
    for (const Chunk& p : SplitAtDocuments(c, docs))
      ops_.rope(y + (p.begin - c.begin) * heads * dim, p.size(), heads, dim, p.begin - DocumentStart(docs, p.begin),
                state.inv_freq.data(), inverse);
    if (part.defined()) ops_.copy_rows(x, hd, part.data<T>(), dim, rows, dim);
  }

  // Runs attention(piece, its shape, its first row in c, its lse) for each piece of chunk c inside one document,
  // whose keys begin at the document's start. lse [heads][c.size()] is the chunk's: a piece of several uses its
  // own [heads][piece] copy (filled from lse first, written back after).
  template <typename Attention>
  void ByDocument(Chunk c, const TransformerState& state, const Tensor& lse, Attention attention) {
    const std::vector<int64_t>& docs = state.opts.doc_starts;
    const std::vector<Chunk> pieces = SplitAtDocuments(c, docs);
    if (pieces.size() == 1) {
      AttentionShape s = Shape(c);
      s.key_begin = DocumentStart(docs, c.begin);
      attention(c, s, 0, lse.data<T>());
      return;
    }
    const int64_t n = c.size();
    for (const Chunk& p : pieces) {
      AttentionShape s = Shape(p);
      s.key_begin = DocumentStart(docs, p.begin);
      const int64_t row = p.begin - c.begin, m = p.size();
      Tensor piece_lse = New(MemCategory::kWorkspace, {heads_, m});
      for (int64_t h = 0; h < heads_; ++h) ops_.copy(piece_lse.data<T>() + h * m, lse.data<T>() + h * n + row, m);
      attention(p, s, row, piece_lse.data<T>());
      for (int64_t h = 0; h < heads_; ++h) ops_.copy(lse.data<T>() + h * n + row, piece_lse.data<T>() + h * m, m);
    }
  }

  AttentionShape Shape(Chunk c) const {
    AttentionShape s;
    s.n = c.size();
    s.pos0 = c.begin;
    s.heads = heads_;
    s.kv_heads = kv_heads_;
    s.head_dim = cfg_.head_dim;
    // transformers multiplies cos and sin, so both q and k, by the attention factor: the logits by its square.
    s.scale = attention_factor_ * attention_factor_ / std::sqrt(static_cast<double>(cfg_.head_dim));
    return s;
  }

  // y = rmsnorm(x) with weight w, rounded as ParamStore::RoundAndKeep rounds (in the same pass); returns the kept
  // copy when keep.
  Tensor Norm(const T* x, int w, Tensor& y, Tensor& rstd, MemCategory cat, bool keep) {
    Tensor weight;
    return Store::NormAndKeep(ops_, x, NormWeight(w, weight), cfg_.rms_norm_eps, y, rstd, cat, keep);
  }
  // What an RMSNorm of weight w multiplies by: w, or 1 + w for the hybrids' zero-centred norms (made in `hold`).
  const T* NormWeight(int w, Tensor& hold) {
    if (!cfg_.hybrid()) return W(w);
    const int64_t n = params_[w].value.numel();
    hold = New(MemCategory::kWorkspace, {n});
    ops_.fill(hold.data<T>(), n, T(1));
    ops_.add_inplace(hold.data<T>(), W(w), n);
    return hold.data<T>();
  }
  // y[n][out] = x[n][in] W[out][in]^T (+ b) (+ the LoRA adapter of W)
  void Linear(const T* x, int64_t n, int64_t in, int w, int b, T* y, int64_t out, Chunk c, const StateOptions& st) {
    Store::GemmW(ops_, true, n, out, in, T(1), x, in, w, in, T(0), y, out);
    if (b >= 0) ops_.add_bias(y, W(b), n, out);
    Store::LoraAdd(ops_, w, x, c, st, y, out);
  }
  // dx (+)= dy W; dW += dy^T x; db += colsum(dy) (+ the adapter's gradients)
  void LinearBackward(const T* dy, int64_t out, const T* x, int64_t n, int w, int b, T* dx, T beta, Chunk c,
                      const StateOptions& st) {
    const int64_t in = cfg_.hidden_size;
    Store::GemmW(ops_, false, n, in, out, T(1), dy, out, w, in, beta, dx, in);
    if (T* g = G(w)) ops_.gemm(true, false, out, in, n, T(1), dy, out, x, in, T(1), g, in);
    BiasBackward(b, dy, n, out);
    Store::LoraBackward(ops_, w, x, dy, out, dx, c, st);
  }
  // o_proj and down_proj (ParamStore::RowParallelAdd).
  void RowParallelAdd(const T* a, int64_t k, int w, int b, Chunk c, const StateOptions& st, T* y) {
    Store::RowParallelAdd(ops_, tp_.on() ? &tp_ : nullptr, a, c.size(), k, cfg_.hidden_size, w, b, c, st, y);
  }
  // db += colsum(dy[n][m]) when the bias b exists and is trained.
  void BiasBackward(int b, const T* dy, int64_t n, int64_t m) {
    if (b >= 0)
      if (T* g = G(b)) ops_.bias_backward(dy, n, m, g);
  }
  void NormBackward(const T* dy, const T* x, int w, const T* rstd, int64_t n, T* dx_accumulate) {
    Tensor weight;  // d(1 + w) / dw = 1: the hybrids' gradient is the plain norm's
    ops_.rmsnorm_backward(dy, x, NormWeight(w, weight), rstd, n, cfg_.hidden_size, dx_accumulate, GradOrScratch(w),
                          true);
  }

  TransformerConfig cfg_;
  const OpTable<T>& ops_;
  double attention_factor_;  // yarn's; 1 for the other RoPE types
  TensorParallel tp_;
  // This rank's query heads, KV heads, SwiGLU width and vocabulary rows (the config's, divided by tp_.size).
  int64_t heads_, kv_heads_, inter_, vocab_rows_;
  std::vector<TpShard> shards_;  // per base parameter (LoRA adapters: ShardOf)
  std::vector<LayerParams> layers_;
  std::vector<int> kv_index_;  // per layer, its number among the attention layers (the KV pools'); -1: linear
  // The batch's routing for the load-balancing loss (HasBatchLoss): picks and probability sums per expert over its
  // rows while the statistics pass collects, then the gradient every row's probabilities get.
  struct RoutingStatistics {
    bool collecting = false;
    std::vector<double> picks, probs;
    int64_t rows = 0;
    Tensor grad;  // [experts], on the device
  } routing_;
  int kv_layers_ = 0;  // attention layers
  int embed_ = -1, final_norm_ = -1, head_ = -1;
  std::unique_ptr<ExpertOffload> expert_offload_;  // --offload_experts
};

absl::Status ValidateConfig(const TransformerConfig& c) {
  auto positive = [](const char* field, int64_t v) -> absl::Status {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config field '", field, "' must be positive, got ", v));
    return absl::OkStatus();
  };
  for (auto [field, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                          {"hidden_size", c.hidden_size},
                          {"num_hidden_layers", c.num_layers}}) {
    if (absl::Status s = positive(field, v); !s.ok()) return s;
  }
  if (!c.mixers.empty() && static_cast<int64_t>(c.mixers.size()) != c.num_layers)
    return absl::InvalidArgumentError(
        absl::StrCat("config: layer_types lists ", c.mixers.size(), " layers; num_hidden_layers is ", c.num_layers));
  if (!c.mlps.empty() && static_cast<int64_t>(c.mlps.size()) != c.num_layers)
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", c.mlps.size(), " MLPs listed; num_hidden_layers is ", c.num_layers));
  if (c.attention_layer_count() > 0) {
    for (auto [field, v] : {std::pair<const char*, int64_t>{"num_attention_heads", c.num_heads},
                            {"num_key_value_heads", c.num_kv_heads},
                            {"head_dim", c.head_dim}}) {
      if (absl::Status s = positive(field, v); !s.ok()) return s;
    }
    if (c.num_heads % c.num_kv_heads != 0)
      return absl::InvalidArgumentError(absl::StrCat("config: num_attention_heads (", c.num_heads,
                                                     ") must be a multiple of num_key_value_heads (", c.num_kv_heads,
                                                     ")"));
    if (c.rope && c.head_dim % 2 != 0)
      return absl::InvalidArgumentError(absl::StrCat("config: head_dim must be even for RoPE, got ", c.head_dim));
    if (c.rope && (c.rotary_dim() < 2 || c.rotary_dim() % 2 != 0 || c.rotary_dim() > c.head_dim))
      return absl::InvalidArgumentError(
          absl::StrCat("config: head_dim x partial_rotary_factor = ", c.rotary_dim(),
                       " rotated dims; they must be even, at least 2 and at most head_dim"));
  }
  if (c.mlp_count(Mlp::kSwiGlu) - c.moe_layer_count() + c.mlp_count(Mlp::kRelu2) > 0)  // dense MLPs
    if (absl::Status s = positive("intermediate_size", c.intermediate_size); !s.ok()) return s;
  if (c.mamba_layer_count() > 0) {
    const Mamba2Config& m = c.mamba;
    for (auto [field, v] : {std::pair<const char*, int64_t>{"mamba heads", m.heads},
                            {"mamba head_dim", m.head_dim},
                            {"mamba n_groups", m.groups},
                            {"mamba state size", m.state},
                            {"mamba conv_kernel", m.conv_kernel}}) {
      if (absl::Status s = positive(field, v); !s.ok()) return s;
    }
    if (m.heads % m.groups != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("config: the Mamba heads (", m.heads, ") must be a multiple of n_groups (", m.groups, ")"));
  }
  const std::set<std::string> supported = {"llama",   "qwen2",      "qwen3",        "qwen3_moe",
                                           "mixtral", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                                           "mamba2",  "bamba",      "nemotron_h",   "falcon_h1"};
  if (!supported.count(c.architecture))
    return absl::InvalidArgumentError(absl::StrCat("config: model_type '", c.architecture,
                                                   "' is not supported (supported: ", absl::StrJoin(supported, ", "),
                                                   ")"));
  if (!c.moe_layers.empty()) {
    if (static_cast<int64_t>(c.moe_layers.size()) != c.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("config: ", c.moe_layers.size(), " layers marked for experts; ",
                                                     "num_hidden_layers is ", c.num_layers));
    const MoeConfig& m = c.moe;
    for (auto [field, v] : {std::pair<const char*, int64_t>{"num_experts", m.experts},
                            {"num_experts_per_tok", m.top_k},
                            {"moe_intermediate_size", m.intermediate}}) {
      if (absl::Status s = positive(field, v); !s.ok()) return s;
    }
    if (m.top_k > m.experts)
      return absl::InvalidArgumentError(
          absl::StrCat("config: num_experts_per_tok (", m.top_k, ") exceeds num_experts (", m.experts, ")"));
    // The loss runs each sequence's last token too, one position more than RoPE's length counts.
    if (m.aux_loss && c.rope_scaling.type == "dynamic")
      return absl::UnimplementedError("config: output_router_logits with dynamic RoPE is not supported");
  }
  if (c.linear_layer_count() > 0) {
    const LinearAttentionConfig& a = c.linear;
    for (auto [field, v] : {std::pair<const char*, int64_t>{"linear_conv_kernel_dim", a.conv_kernel},
                            {"linear_key_head_dim", a.key_head_dim},
                            {"linear_value_head_dim", a.value_head_dim},
                            {"linear_num_key_heads", a.key_heads},
                            {"linear_num_value_heads", a.value_heads}}) {
      if (absl::Status s = positive(field, v); !s.ok()) return s;
    }
    if (a.value_heads % a.key_heads != 0)
      return absl::InvalidArgumentError(absl::StrCat("config: linear_num_value_heads (", a.value_heads,
                                                     ") must be a multiple of linear_num_key_heads (", a.key_heads,
                                                     ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransformerModel>> CreateTransformer(const TransformerConfig& config, DType dtype,
                                                                    Device device, const TensorParallel& tp,
                                                                    bool frozen_base, bool offload_experts) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (offload_experts && config.moe_layer_count() == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--offload_experts: this ", config.architecture, " model has no mixture-of-experts layers"));
  if (offload_experts && !frozen_base)
    return absl::InvalidArgumentError(
        "--offload_experts keeps the expert weights in host memory and needs them frozen (a LoRA run's base): add "
        "--lora_rank");
  if (absl::Status s = ValidateTensorParallel(config, tp.size); !s.ok()) return s;
  if (tp.size > 1 && !config.moe_layers.empty())
    return absl::UnimplementedError(absl::StrCat("tensor parallelism (tp ", tp.size, ") is not supported yet on ",
                                                 config.architecture, "'s mixture-of-experts layers"));
  if (tp.size > 1 && config.pad_token_id >= 0)
    return absl::UnimplementedError(absl::StrCat("tensor parallelism (tp ", tp.size, ") is not supported yet with ",
                                                 config.architecture, "'s pad_token_id"));
  if (tp.size > 1 && config.mamba_layer_count() > 0)
    return absl::UnimplementedError(absl::StrCat("tensor parallelism (tp ", tp.size, ") is not supported yet on ",
                                                 config.architecture, "'s Mamba-2 layers"));
  if (tp.size > 1 && config.linear_layer_count() > 0)
    return absl::UnimplementedError(absl::StrCat("tensor parallelism (tp ", tp.size, ") is not supported yet on ",
                                                 config.architecture, "'s Gated DeltaNet layers"));
  if (absl::Status s = CheckTensorParallelPlacement(tp, device); !s.ok()) return s;
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (dtype == DType::kF32)
    return std::unique_ptr<TransformerModel>(
        new Transformer<float>(config, device, dtype, tp, frozen_base, offload_experts));
  if (dtype == DType::kF64)
    return std::unique_ptr<TransformerModel>(
        new Transformer<double>(config, device, dtype, tp, frozen_base, offload_experts));
  // bf16 weights over f32 compute (param_store.h): the CPU and CUDA tables' bf16 entries; meta plans them.
  if (dtype == DType::kBF16)
    return std::unique_ptr<TransformerModel>(
        new Transformer<float>(config, device, dtype, tp, frozen_base, offload_experts));
  return absl::InvalidArgumentError(
      absl::StrCat("compute dtype ", DTypeName(dtype), " is not supported on the CPU backend (use f32 or f64)"));
}

}  // namespace sg
