#include "core/models/transformer/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <type_traits>

#include "absl/strings/str_cat.h"
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
  const int64_t half = c.head_dim / 2;
  const double dim = static_cast<double>(c.head_dim);
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

class TransformerState final : public SequenceState {
 public:
  // offload_copies: the device's copy engine when the pools hold only KvOffload::kSlots layers (StateOptions::offload).
  TransformerState(PagePool kv_pool, PagePool grad_pool, const StateOptions& opts, int layers,
                   const CopyEngine* offload_copies, std::vector<double> inv_freq)
      : kv(std::move(kv_pool)),
        grad(std::move(grad_pool)),
        seq_len(opts.seq_len),
        opts(opts),
        layers(layers),
        inv_freq(std::move(inv_freq)) {
    if (offload_copies)
      offload = std::make_unique<KvOffload>(kv, opts.resident_grad_layers > 0 ? &grad : nullptr, *offload_copies,
                                            layers, opts.seq_len);
  }
  void Release(int layer, int64_t from) override {
    if (offload) offload->Release(layer, from);
    kv.Release(layer, from);
    grad.Release(layer, from);
    if (layer < static_cast<int>(kv_end.size())) kv_end[layer] = std::min(kv_end[layer], from);
  }
  // K/V of positions [0, kv_end[layer]) are in the cache: a chunk inside it is recomputed (seco's stage 2,
  // streambp's partitions) without projecting its K/V again; the values would be bit-identical.
  bool HoldsKV(int layer, Chunk c) const { return c.end <= KvEnd(layer); }
  int64_t KvEnd(int layer) const { return layer < static_cast<int>(kv_end.size()) ? kv_end[layer] : 0; }
  void MarkKV(int layer, Chunk c) {
    if (layer >= static_cast<int>(kv_end.size())) kv_end.resize(layer + 1, 0);
    if (c.begin <= kv_end[layer]) kv_end[layer] = std::max(kv_end[layer], c.end);
  }
  void ScaleGrad(int layer, Chunk c, double factor) override { grad.Scale(layer, c.begin, c.end, factor); }
  void SkipGrad(Chunk c) override { grad.SkipRows(c.begin, c.end, seq_len); }
  int64_t OffloadedBytes() const override { return offload ? offload->host_bytes() : 0; }

  // How a layer is visited: forward without a graph (seco's stage 1), forward keeping what its backward needs
  // (the recompute of stage 2), backward.
  enum class Pass { kForward, kForwardForBackward, kBackward };
  // With offload, before layer l runs `pass` on chunk c: makes its pages resident and prefetches the visit the
  // chunked schedule makes next (forward l -> l + 1, the last layer -> layer 0 of the next chunk or, keeping the
  // graph, its own backward; backward l -> l - 1).
  void PrepareLayer(int l, Chunk c, Pass pass) {
    if (!offload) return;
    LayerAccess next;
    if (pass == Pass::kBackward) {
      if (l > 0) next = Access(l - 1, c, pass);
    } else if (l + 1 < layers) {
      next = Access(l + 1, c, pass);
    } else {
      next = pass == Pass::kForward ? Access(0, Chunk{c.end, c.end}, pass) : Access(l, c, Pass::kBackward);
    }
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
  int layers;
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

// Indices into params() for one decoder layer; -1 where a bias or q/k norm is absent.
struct LayerParams {
  int norm1, q, q_bias, k, k_bias, v, v_bias, o, o_bias, norm2, gate, gate_bias, up, up_bias, down, down_bias;
  int q_norm, k_norm;
};

// Order of LayerSaved::tensors; kQRaw / kQRstd (q before its per-head norm, and the norm's rstd) only with q/k norm.
enum Saved { kX, kXn1, kRstd1, kQ, kAttn, kLse, kH, kXn2, kRstd2, kGate, kUp, kAct, kQRaw, kQRstd, kNumSaved };

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
  Transformer(const TransformerConfig& c, Device device, DType weights, const TensorParallel& tp)
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
    const int64_t d = c.hidden_size, qd = heads_ * c.head_dim, kvd = kv_heads_ * c.head_dim, f = inter_;
    // Column-parallel (rows of [out][in] split), row-parallel (columns split), replicated; see tensor_parallel.h.
    const TpShard rows{TpSplit::kRows}, cols{TpSplit::kCols}, whole{}, partial{TpSplit::kReplicated, true};
    auto add = [&](const std::string& name, std::vector<int64_t> shape, TpShard shard) {
      shards_.push_back(shard);
      return Add(name, std::move(shape));
    };
    embed_ = add("model.embed_tokens.weight", {vocab_rows_, d}, rows);
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      LayerParams L;
      L.norm1 = add(p + "input_layernorm.weight", {d}, whole);
      L.q = add(p + "self_attn.q_proj.weight", {qd, d}, rows);
      L.q_bias = c.attention_bias ? add(p + "self_attn.q_proj.bias", {qd}, rows) : -1;
      L.k = add(p + "self_attn.k_proj.weight", {kvd, d}, rows);
      L.k_bias = c.attention_bias ? add(p + "self_attn.k_proj.bias", {kvd}, rows) : -1;
      L.v = add(p + "self_attn.v_proj.weight", {kvd, d}, rows);
      L.v_bias = c.attention_bias ? add(p + "self_attn.v_proj.bias", {kvd}, rows) : -1;
      L.o = add(p + "self_attn.o_proj.weight", {d, qd}, cols);
      L.o_bias = c.o_bias() ? add(p + "self_attn.o_proj.bias", {d}, whole) : -1;
      L.q_norm = c.qk_norm() ? add(p + "self_attn.q_norm.weight", {c.head_dim}, partial) : -1;
      L.k_norm = c.qk_norm() ? add(p + "self_attn.k_norm.weight", {c.head_dim}, partial) : -1;
      L.norm2 = add(p + "post_attention_layernorm.weight", {d}, whole);
      L.gate = add(p + "mlp.gate_proj.weight", {f, d}, rows);
      L.gate_bias = c.mlp_bias ? add(p + "mlp.gate_proj.bias", {f}, rows) : -1;
      L.up = add(p + "mlp.up_proj.weight", {f, d}, rows);
      L.up_bias = c.mlp_bias ? add(p + "mlp.up_proj.bias", {f}, rows) : -1;
      L.down = add(p + "mlp.down_proj.weight", {d, f}, cols);
      L.down_bias = c.mlp_bias ? add(p + "mlp.down_proj.bias", {d}, whole) : -1;
      layers_.push_back(L);
    }
    final_norm_ = add("model.norm.weight", {d}, whole);
    head_ = c.tie_word_embeddings ? embed_ : add("lm_head.weight", {vocab_rows_, d}, rows);
    for (const LayerParams& L : layers_)
      for (int idx : {L.norm1, L.norm2, L.q_norm, L.k_norm})
        if (idx >= 0) ops_.fill(W(idx), params_[idx].value.numel(), T(1));
    ops_.fill(W(final_norm_), params_[final_norm_].value.numel(), T(1));
  }

  std::string family() const override { return "transformer"; }
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
    return 2 * kv_heads_ * cfg_.head_dim * static_cast<int64_t>(DTypeSize(KVDType()));
  }
  absl::Status EnableLora(const LoraOptions& o) override {
    std::vector<int> linears;
    for (const LayerParams& L : layers_)
      for (int w : {L.q, L.k, L.v, L.o, L.gate, L.up, L.down}) linears.push_back(w);
    if (absl::Status s = Store::EnableLoraOn(o, family(), linears); !s.ok()) return s;
    Store::lora_col0_ = LoraFirstColumns(shards_, *Store::LoraState(), tp_.rank);  // dropout masks
    return absl::OkStatus();
  }
  const TensorParallel& tensor_parallel() const override { return tp_; }
  // An adapter meets its weight's split (ShardOfParam).
  TpShard ShardOf(int param) const override { return ShardOfParam(shards_, Store::LoraState(), param); }
  const LoraInfo* lora() const override { return Store::LoraState(); }

  std::unique_ptr<SequenceState> NewState(const StateOptions& o) override {
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
    const int slots = std::min(num_layers(), KvOffload::kSlots);
    const int kv_layers = o.offload ? std::min(o.resident_layers, slots) : o.resident_layers;
    const int grad_layers = o.offload ? std::min(o.resident_grad_layers, slots) : o.resident_grad_layers;
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
        o, num_layers(), copies, RopeFor(cfg_, LongestDocument(o.doc_starts, o.seq_len)).inv_freq);
  }

  Tensor Embed(const int32_t* ids, Chunk c) override {
    return Store::EmbedRows(ops_, embed_, ids, c, tp_.on() ? &tp_ : nullptr);
  }
  void EmbedBackward(const int32_t* ids, Chunk c, const Tensor& dx) override {
    Store::EmbedRowsBackward(ops_, embed_, ids, c, dx, tp_.on() ? &tp_ : nullptr);
  }

  Tensor LayerForward(int l, Chunk c, const Tensor& x_in, SequenceState& state_base, LayerSaved* saved) override {
    auto& state = static_cast<TransformerState&>(state_base);
    const auto pass = saved ? TransformerState::Pass::kForwardForBackward : TransformerState::Pass::kForward;
    state.PrepareLayer(l, c, pass);
    const LayerParams& L = layers_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    const int64_t qd = heads_ * cfg_.head_dim;
    const MemCategory act = saved ? MemCategory::kActivations : MemCategory::kWorkspace;
    const T* x = x_in.data<T>();
    // What backward reads. Under --dtype=bf16 the large tensors are made in workspace (`big`), rounded where they
    // are made and kept in bf16 (ParamStore::RoundAndKeep); the per-row statistics (rstd, lse) stay in T: they
    // are small, and the norms' and softmax's backward divide by them.
    std::vector<Tensor> kept(kNumSaved);
    const MemCategory big = Store::ActCategory(act);
    auto keep = [&](Saved k, Tensor& t) {
      Tensor half = Store::RoundAndKeep(ops_, t, act);
      if (saved) kept[k] = std::move(half);
    };
    auto slot = [&](Saved k) { return saved ? &kept[k] : nullptr; };  // where a fused op puts what is kept
    // A working copy in T that the forward no longer reads: freed early under bf16 (f32 and f64 keep their schedule).
    auto done = [&](Tensor& t) {
      if (Store::HalfActivations()) t.Reset();
    };

    Tensor xn1 = New(big, {n, d}), rstd1 = New(act, {n});
    kept[kXn1] = Norm(x, L.norm1, xn1, rstd1, act, saved);
    Tensor q = New(big, {n, qd}), q_raw, q_rstd;
    if (cfg_.qk_norm()) {
      q_raw = New(big, {n, qd});
      q_rstd = New(act, {n * heads_});
      Linear(xn1.data<T>(), n, d, L.q, L.q_bias, q_raw.data<T>(), qd, c, state.opts);
      keep(kQRaw, q_raw);
      ops_.rmsnorm_forward(q_raw.data<T>(), W(L.q_norm), n * heads_, cfg_.head_dim, cfg_.rms_norm_eps, q.data<T>(),
                           q_rstd.data<T>());
    } else {
      Linear(xn1.data<T>(), n, d, L.q, L.q_bias, q.data<T>(), qd, c, state.opts);
    }
    Rope(q.data<T>(), c, heads_, /*inverse=*/false, state);
    keep(kQ, q);
    if (!state.HoldsKV(l, c)) AppendKV(l, c, xn1.data<T>(), state);
    done(xn1);
    Tensor attn = New(big, {n, qd}), lse = New(act, {heads_, n});
    {
      const uint8_t* selected = SelectPages(l, c, q.data<T>(), state);
      if (selected) state.RequireSelected(l, c, pass);
      const PagedAttention pages = state.AttentionPages(l, selected, &mem_);
      ByDocument(c, state, lse, [&](Chunk p, const AttentionShape& s, int64_t row, T* piece_lse) {
        PagedAttentionForward<T>(ops_, s, pages, q.data<T>() + row * qd, attn.data<T>() + row * qd, piece_lse);
      });
    }
    done(q);
    keep(kAttn, attn);
    Tensor h = New(big, {n, d});
    ops_.copy(h.data<T>(), x, n * d);
    RowParallelAdd(attn.data<T>(), qd, L.o, L.o_bias, c, state.opts, h.data<T>());
    done(attn);
    keep(kH, h);

    Tensor xn2 = New(big, {n, d}), rstd2 = New(act, {n});
    kept[kXn2] = Norm(h.data<T>(), L.norm2, xn2, rstd2, act, saved);
    Tensor gate = New(big, {n, f}), up = New(big, {n, f}), a = New(big, {n, f});
    Linear(xn2.data<T>(), n, d, L.gate, L.gate_bias, gate.data<T>(), f, c, state.opts);
    Linear(xn2.data<T>(), n, d, L.up, L.up_bias, up.data<T>(), f, c, state.opts);
    done(xn2);
    Store::SwigluAndKeep(ops_, gate, up, a, act, slot(kGate), slot(kUp), slot(kAct));
    done(gate), done(up);
    Tensor y = New(MemCategory::kActivations, {n, d});
    ops_.copy(y.data<T>(), h.data<T>(), n * d);
    RowParallelAdd(a.data<T>(), f, L.down, L.down_bias, c, state.opts, y.data<T>());

    if (saved) {
      kept[kX] = Store::Narrow(ops_, x_in, act);
      kept[kRstd1] = rstd1, kept[kLse] = lse, kept[kRstd2] = rstd2, kept[kQRstd] = q_rstd;
      saved->tensors = std::move(kept);
    }
    return Store::Boundary(ops_, std::move(y));
  }

  // The layer's K/V of the chunk are all that later positions need of it: norm, K/V projections, rope.
  void LayerAppendState(int l, Chunk c, const Tensor& x, SequenceState& state_base) override {
    auto& state = static_cast<TransformerState&>(state_base);
    state.PrepareLayer(l, c, TransformerState::Pass::kForward);
    const int64_t n = c.size(), d = cfg_.hidden_size;
    Tensor xn1 = New(MemCategory::kWorkspace, {n, d}), rstd1 = New(MemCategory::kWorkspace, {n});
    Norm(x.data<T>(), layers_[l].norm1, xn1, rstd1, MemCategory::kWorkspace, false);  // rounded as LayerForward's
    AppendKV(l, c, xn1.data<T>(), state);
  }

  Tensor LayerBackward(int l, Chunk c, const Tensor& dy_in, LayerSaved& saved, SequenceState& state_base) override {
    auto& state = static_cast<TransformerState&>(state_base);
    state.PrepareLayer(l, c, TransformerState::Pass::kBackward);
    const LayerParams& L = layers_[l];
    const std::vector<Tensor>& s = saved.tensors;
    const int64_t n = c.size(), d = cfg_.hidden_size, f = inter_;
    const int64_t qd = heads_ * cfg_.head_dim, kvd = kv_heads_ * cfg_.head_dim;
    const T* dy = dy_in.data<T>();
    constexpr MemCategory ws = MemCategory::kWorkspace;
    // A saved tensor in T (under bf16 a copy widened into workspace, freed when the block using it ends).
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };

    // MLP: y = h + down(swiglu(gate(xn2), up(xn2))), xn2 = norm2(h)
    Tensor dh = New(ws, {n, d});
    {
      Tensor da = New(ws, {n, f});
      Store::GemmW(ops_, false, n, f, d, T(1), dy, d, L.down, f, T(0), da.data<T>(), f);
      {
        const Tensor a = wide(kAct);  // widened before dgate and dup exist
        if (T* g = G(L.down)) ops_.gemm(true, false, d, f, n, T(1), dy, d, a.data<T>(), f, T(1), g, f);
        BiasBackward(L.down_bias, dy, n, d);
        Store::LoraBackward(ops_, L.down, a.data<T>(), dy, d, da.data<T>(), c, state.opts);
      }
      Tensor dgate = New(ws, {n, f}), dup = New(ws, {n, f}), dxn2 = New(ws, {n, d});
      Store::SwigluBackwardKept(ops_, da.data<T>(), s[kGate], s[kUp], dgate.data<T>(), dup.data<T>());
      Store::GemmW(ops_, false, n, d, f, T(1), dgate.data<T>(), f, L.gate, d, T(0), dxn2.data<T>(), d);
      Store::GemmW(ops_, false, n, d, f, T(1), dup.data<T>(), f, L.up, d, T(1), dxn2.data<T>(), d);
      const Tensor xn2_kept = wide(kXn2);
      const T* xn2 = xn2_kept.data<T>();
      if (T* g = G(L.gate)) ops_.gemm(true, false, f, d, n, T(1), dgate.data<T>(), f, xn2, d, T(1), g, d);
      if (T* g = G(L.up)) ops_.gemm(true, false, f, d, n, T(1), dup.data<T>(), f, xn2, d, T(1), g, d);
      BiasBackward(L.gate_bias, dgate.data<T>(), n, f);
      BiasBackward(L.up_bias, dup.data<T>(), n, f);
      Store::LoraBackward(ops_, L.gate, xn2, dgate.data<T>(), f, dxn2.data<T>(), c, state.opts);
      Store::LoraBackward(ops_, L.up, xn2, dup.data<T>(), f, dxn2.data<T>(), c, state.opts);
      tp_.AllReduce(dxn2.raw(), n * d, dtype());  // each rank's columns of gate/up gave part of it
      ops_.copy(dh.data<T>(), dy, n * d);
      NormBackward(dxn2.data<T>(), wide(kH).template data<T>(), L.norm2, s[kRstd2].data<T>(), n, dh.data<T>());
    }
    // Attention: h = x + o(attn(rope(q(xn1)), cache)), xn1 = norm1(x)
    Tensor dq = New(ws, {n, qd});
    {
      Tensor dattn = New(ws, {n, qd});
      const Tensor attn = wide(kAttn), q = wide(kQ);
      Store::GemmW(ops_, false, n, qd, d, T(1), dh.data<T>(), d, L.o, qd, T(0), dattn.data<T>(), qd);
      if (T* g = G(L.o)) ops_.gemm(true, false, d, qd, n, T(1), dh.data<T>(), d, attn.data<T>(), qd, T(1), g, qd);
      BiasBackward(L.o_bias, dh.data<T>(), n, d);
      Store::LoraBackward(ops_, L.o, attn.data<T>(), dh.data<T>(), d, dattn.data<T>(), c, state.opts);
      const uint8_t* selected = SelectPages(l, c, q.data<T>(), state);
      const PagedAttention pages = state.AttentionPages(l, selected, &mem_);
      ByDocument(c, state, s[kLse], [&](Chunk p, const AttentionShape& sh, int64_t row, T* piece_lse) {
        PagedAttentionBackward<T>(ops_, sh, pages, q.data<T>() + row * qd, attn.data<T>() + row * qd, piece_lse,
                                  dattn.data<T>() + row * qd, dq.data<T>() + row * qd);
      });
    }
    // This chunk's dK/dV are complete: later chunks (processed before, in reverse) already added theirs.
    Tensor dk = New(ws, {n, kvd}), dv = New(ws, {n, kvd});
    state.grad.Gather<T>(l, c.begin, c.end, dk.data<T>(), dv.data<T>());
    Rope(dq.data<T>(), c, heads_, /*inverse=*/true, state);
    Rope(dk.data<T>(), c, kv_heads_, /*inverse=*/true, state);
    const Tensor xn1_kept = wide(kXn1);
    const T* xn1 = xn1_kept.data<T>();
    if (cfg_.qk_norm()) {
      // Through the per-head norms: q's input was saved; k's is projected again from xn1.
      const int64_t H = heads_, G = kv_heads_, hd = cfg_.head_dim;
      Tensor dq_raw = New(ws, {n, qd});
      ops_.rmsnorm_backward(dq.data<T>(), wide(kQRaw).template data<T>(), W(L.q_norm), s[kQRstd].data<T>(), n * H, hd,
                            dq_raw.data<T>(), GradOrScratch(L.q_norm), false);
      dq = std::move(dq_raw);
      Tensor k_raw = New(ws, {n, kvd}), k_normed = New(ws, {n, kvd}), k_rstd = New(ws, {n * G});
      Linear(xn1, n, d, L.k, L.k_bias, k_raw.data<T>(), kvd, c, state.opts);
      ops_.rmsnorm_forward(k_raw.data<T>(), W(L.k_norm), n * G, hd, cfg_.rms_norm_eps, k_normed.data<T>(),
                           k_rstd.data<T>());
      ops_.rmsnorm_backward(dk.data<T>(), k_raw.data<T>(), W(L.k_norm), k_rstd.data<T>(), n * G, hd, k_normed.data<T>(),
                            GradOrScratch(L.k_norm), false);
      dk = std::move(k_normed);
    }
    Tensor dxn1 = New(ws, {n, d});
    LinearBackward(dq.data<T>(), qd, xn1, n, L.q, L.q_bias, dxn1.data<T>(), T(0), c, state.opts);
    LinearBackward(dk.data<T>(), kvd, xn1, n, L.k, L.k_bias, dxn1.data<T>(), T(1), c, state.opts);
    LinearBackward(dv.data<T>(), kvd, xn1, n, L.v, L.v_bias, dxn1.data<T>(), T(1), c, state.opts);
    tp_.AllReduce(dxn1.raw(), n * d, dtype());  // each rank's heads gave part of it

    Tensor dx = New(MemCategory::kActivations, {n, d});
    ops_.copy(dx.data<T>(), dh.data<T>(), n * d);
    NormBackward(dxn1.data<T>(), wide(kX).template data<T>(), L.norm1, s[kRstd1].data<T>(), n, dx.data<T>());
    return dx;
  }

  HeadResult HeadLoss(Chunk c, const Tensor& h, const int32_t* labels, const TokenObjective* objective,
                      double grad_scale, bool need_grad) override {
    return Store::Head(ops_, final_norm_, head_, cfg_.rms_norm_eps, cfg_.hidden_size, vocab_rows_, c, h, labels,
                       objective, grad_scale, need_grad, tp_.on() ? &tp_ : nullptr);
  }

 private:
  // K/V of chunk c from the normed input, roped and written into the layer's cache pages.
  void AppendKV(int l, Chunk c, const T* xn1, TransformerState& state) {
    const LayerParams& L = layers_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, kvd = kv_heads_ * cfg_.head_dim;
    Tensor k = New(MemCategory::kWorkspace, {n, kvd}), v = New(MemCategory::kWorkspace, {n, kvd});
    Linear(xn1, n, d, L.k, L.k_bias, k.data<T>(), kvd, c, state.opts);
    Linear(xn1, n, d, L.v, L.v_bias, v.data<T>(), kvd, c, state.opts);
    if (cfg_.qk_norm()) {
      const int64_t rows = n * kv_heads_;
      Tensor k_raw = New(MemCategory::kWorkspace, {n, kvd}), rstd = New(MemCategory::kWorkspace, {rows});
      ops_.copy(k_raw.data<T>(), k.data<T>(), n * kvd);
      ops_.rmsnorm_forward(k_raw.data<T>(), W(L.k_norm), rows, cfg_.head_dim, cfg_.rms_norm_eps, k.data<T>(),
                           rstd.data<T>());
    }
    state.kv.Ensure(l, c.begin, c.end, /*zero_new=*/false);
    if (state.opts.doc_starts.empty()) {
      state.kv.ScatterRoped<T>(l, c.begin, c.end, k.data<T>(), v.data<T>(), state.inv_freq.data());
    } else {  // positions within each document: rope, then write (what rope_kv_write does in one pass)
      Rope(k.data<T>(), c, kv_heads_, /*inverse=*/false, state);
      state.kv.Scatter<T>(l, c.begin, c.end, k.data<T>(), v.data<T>());
    }
    state.MarkKV(l, c);
    if (state.opts.sparse_pages > 0) SumPageKeys(l, c, state);
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
  void Rope(T* x, Chunk c, int64_t heads, bool inverse, const TransformerState& state) {
    const std::vector<int64_t>& docs = state.opts.doc_starts;
    for (const Chunk& p : SplitAtDocuments(c, docs))
      ops_.rope(x + (p.begin - c.begin) * heads * cfg_.head_dim, p.size(), heads, cfg_.head_dim,
                p.begin - DocumentStart(docs, p.begin), state.inv_freq.data(), inverse);
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
    return Store::NormAndKeep(ops_, x, W(w), cfg_.rms_norm_eps, y, rstd, cat, keep);
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
    ops_.rmsnorm_backward(dy, x, W(w), rstd, n, cfg_.hidden_size, dx_accumulate, GradOrScratch(w), true);
  }

  TransformerConfig cfg_;
  const OpTable<T>& ops_;
  double attention_factor_;  // yarn's; 1 for the other RoPE types
  TensorParallel tp_;
  // This rank's query heads, KV heads, SwiGLU width and vocabulary rows (the config's, divided by tp_.size).
  int64_t heads_, kv_heads_, inter_, vocab_rows_;
  std::vector<TpShard> shards_;  // per base parameter (LoRA adapters: ShardOf)
  std::vector<LayerParams> layers_;
  int embed_ = -1, final_norm_ = -1, head_ = -1;
};

absl::Status ValidateConfig(const TransformerConfig& c) {
  auto positive = [](const char* field, int64_t v) -> absl::Status {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config field '", field, "' must be positive, got ", v));
    return absl::OkStatus();
  };
  for (auto [field, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                          {"hidden_size", c.hidden_size},
                          {"num_hidden_layers", c.num_layers},
                          {"num_attention_heads", c.num_heads},
                          {"num_key_value_heads", c.num_kv_heads},
                          {"head_dim", c.head_dim},
                          {"intermediate_size", c.intermediate_size}}) {
    if (absl::Status s = positive(field, v); !s.ok()) return s;
  }
  if (c.num_heads % c.num_kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("config: num_attention_heads (", c.num_heads,
                                                   ") must be a multiple of num_key_value_heads (", c.num_kv_heads,
                                                   ")"));
  if (c.head_dim % 2 != 0)
    return absl::InvalidArgumentError(absl::StrCat("config: head_dim must be even for RoPE, got ", c.head_dim));
  if (c.architecture != "llama" && c.architecture != "qwen2" && c.architecture != "qwen3")
    return absl::InvalidArgumentError(
        absl::StrCat("config: model_type '", c.architecture, "' is not supported (supported: llama, qwen2, qwen3)"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransformerModel>> CreateTransformer(const TransformerConfig& config, DType dtype,
                                                                    Device device, const TensorParallel& tp) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (absl::Status s = ValidateTensorParallel(config, tp.size); !s.ok()) return s;
  if (absl::Status s = CheckTensorParallelPlacement(tp, device); !s.ok()) return s;
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (dtype == DType::kF32) return std::unique_ptr<TransformerModel>(new Transformer<float>(config, device, dtype, tp));
  if (dtype == DType::kF64)
    return std::unique_ptr<TransformerModel>(new Transformer<double>(config, device, dtype, tp));
  // bf16 weights over f32 compute (param_store.h): the CPU and CUDA tables' bf16 entries; meta plans them.
  if (dtype == DType::kBF16)
    return std::unique_ptr<TransformerModel>(new Transformer<float>(config, device, dtype, tp));
  return absl::InvalidArgumentError(
      absl::StrCat("compute dtype ", DTypeName(dtype), " is not supported on the CPU backend (use f32 or f64)"));
}

}  // namespace sg
