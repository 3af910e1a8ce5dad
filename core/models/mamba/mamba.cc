#include "core/models/mamba/mamba.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/param_store.h"
#include "kernels/backend.h"

namespace sg {
namespace {

// The scan state h and conv tail at one chunk boundary (or their gradients).
struct BoundaryState {
  Tensor h;     // [d_inner][state_size]
  Tensor tail;  // [conv_kernel - 1][d_inner]
};

// Adjoint sharding relays, instead of the scan state gradient, what the pairs (t, i) of earlier chunks read: the
// scan output cotangents, deltas and C of the adjoint_window - 1 tokens from `begin` on.
struct LaterTokens {
  int64_t begin = 0, rows = 0;
  Tensor dy, delta, C;  // [rows][d_inner], [rows][d_inner], [rows][state_size]
};

// Per layer, the states at chunk boundaries b > 0 (the state of positions < b; boundary 0 is the zero state and
// is never stored), and the gradients relayed to them by later chunks.
class MambaState final : public SequenceState {
 public:
  explicit MambaState(const StateOptions& o) : opts(o) {}
  // A boundary b belongs to position b - 1: positions >= from own the boundaries b > from.
  void Release(int layer, int64_t from) override {
    for (auto* m : {&cache, &grad})
      if (layer < static_cast<int>(m->size())) {
        auto& layer_map = (*m)[layer];
        layer_map.erase(layer_map.upper_bound(from), layer_map.end());
      }
    // Later tokens are read by positions before them (and trimmed by the backward); none are left before 0.
    if (from == 0 && layer < static_cast<int>(later.size())) later[layer] = {};
  }
  // What later chunks relayed to c is the gradient of c's output state.
  void ScaleGrad(int layer, Chunk c, double factor) override {
    if (BoundaryState* g = Find(grad, layer, c.end)) {
      ScaleTensor(g->h, factor);
      ScaleTensor(g->tail, factor);
    }
  }
  static BoundaryState* Find(std::vector<std::map<int64_t, BoundaryState>>& m, int layer, int64_t b) {
    if (layer >= static_cast<int>(m.size())) return nullptr;
    auto it = m[layer].find(b);
    return it == m[layer].end() ? nullptr : &it->second;
  }
  // Where boundary b of `layer` is stored; enforces how many layers may hold states at once.
  BoundaryState& Slot(std::vector<std::map<int64_t, BoundaryState>>& m, int layer, int64_t b, int resident,
                      const char* what) {
    if (layer >= static_cast<int>(m.size())) m.resize(layer + 1);
    if (m[layer].empty()) {
      int held = 0;
      for (const auto& other : m) held += other.empty() ? 0 : 1;
      if (held >= resident)
        throw std::runtime_error(absl::StrCat("scan ", what, ": layer ", layer, " would be the ", held + 1,
                                              "th layer held at once (resident: ", resident, ")"));
    }
    return m[layer][b];
  }
  int64_t AdjointPairs() const override { return pairs; }
  LaterTokens& Later(int layer) {
    if (layer >= static_cast<int>(later.size())) later.resize(layer + 1);
    return later[layer];
  }
  StateOptions opts;
  std::vector<std::map<int64_t, BoundaryState>> cache, grad;
  std::vector<LaterTokens> later;  // per layer, with opts.adjoint_window > 0
  int64_t pairs = 0;
};

struct LayerParams {
  int norm, in_proj, in_bias, conv_w, conv_b, x_proj, dt_w, dt_b, a_log, d, out_proj, out_bias;
};

// Order of LayerSaved::tensors.
enum Saved { kX, kXn, kRstd, kXin, kZ, kXc, kU, kDtr, kB, kC, kDtPre, kDelta, kY, kGated, kH0, kTail0, kNumSaved };

template <typename T>
class Mamba final : public MambaModel, public TensorParallelModel, private ParamStore<T> {
  using Store = ParamStore<T>;
  using Store::Add;
  using Store::G;
  using Store::GradOrScratch;
  using Store::mem_;
  using Store::New;
  using Store::params_;
  using Store::W;

 public:
  // weights: T, or bf16 over T = float (--dtype=bf16: the linear and embedding matrices in bf16; the conv filter,
  // A_log and the vectors stay in T, as the scan and conv they feed accumulate in it).
  // tp: this rank's place in its tensor-parallel group (core/tensor_parallel.h); the config must split over it.
  Mamba(const MambaConfig& c, Device device, DType weights, const TensorParallel& tp, bool frozen_base)
      : cfg_(c),
        ops_(OpsFor<T>(device)),
        tp_(tp),
        inter_(c.intermediate_size / tp.size),
        vocab_rows_(c.vocab_size / tp.size) {
    mem_.set_device(device);
    if (absl::Status s = Store::SetWeightDType(weights); !s.ok()) throw std::invalid_argument(std::string(s.message()));
    Store::SetFrozenBase(frozen_base);
    const int64_t d = c.hidden_size, E = inter_, N = c.state_size, R = c.time_step_rank;
    // By channel (rows; in_proj's x and z channels each), by columns (x_proj, out_proj: their input is the
    // channels), replicated; see tensor_parallel.h.
    const TpShard channels{TpSplit::kRows}, x_and_z{TpSplit::kRows, false, 2}, cols{TpSplit::kCols}, whole{};
    auto add = [&](const std::string& name, std::vector<int64_t> shape, TpShard shard, bool full_precision = false) {
      shards_.push_back(shard);
      return full_precision ? Store::AddFullPrecision(name, std::move(shape)) : Add(name, std::move(shape));
    };
    embed_ = add("backbone.embeddings.weight", {vocab_rows_, d}, channels);
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat("backbone.layers.", i, ".");
      LayerParams L;
      L.norm = add(p + "norm.weight", {d}, whole);
      L.in_proj = add(p + "mixer.in_proj.weight", {2 * E, d}, x_and_z);
      L.in_bias = c.use_bias ? add(p + "mixer.in_proj.bias", {2 * E}, x_and_z) : -1;
      L.conv_w = add(p + "mixer.conv1d.weight", {E, 1, c.conv_kernel}, channels, true);
      L.conv_b = c.use_conv_bias ? add(p + "mixer.conv1d.bias", {E}, channels) : -1;
      L.x_proj = add(p + "mixer.x_proj.weight", {R + 2 * N, E}, cols);
      L.dt_w = add(p + "mixer.dt_proj.weight", {E, R}, channels);
      L.dt_b = add(p + "mixer.dt_proj.bias", {E}, channels);
      L.a_log = add(p + "mixer.A_log", {E, N}, channels, true);
      L.d = add(p + "mixer.D", {E}, channels);
      L.out_proj = add(p + "mixer.out_proj.weight", {d, E}, cols);
      L.out_bias = c.use_bias ? add(p + "mixer.out_proj.bias", {d}, whole) : -1;
      layers_.push_back(L);
      ops_.fill(W(L.norm), d, T(1));
      ops_.fill(W(L.d), E, T(1));
      if (device != Device::kMeta)  // meta tensors hold no values; S4D-real: A_log[e][s] = log(s + 1)
        SetFromHost(params_[L.a_log].value, [&](int64_t i) { return std::log(i % N + 1.0); });
    }
    final_norm_ = add("backbone.norm_f.weight", {d}, whole);
    ops_.fill(W(final_norm_), d, T(1));
    head_ = c.tie_word_embeddings ? embed_ : add("lm_head.weight", {vocab_rows_, d}, channels);
  }

  std::string family() const override { return "ssm"; }
  ScanLayers scan_layers() const override { return ScanLayers::kAll; }
  std::string architecture() const override { return "mamba"; }
  DType dtype() const override { return Store::kDType; }
  int num_layers() const override { return static_cast<int>(cfg_.num_layers); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t hidden_size() const override { return cfg_.hidden_size; }
  std::vector<Param>& params() override { return params_; }
  MemoryTracker& memory() override { return mem_; }
  const MambaConfig& config() const override { return cfg_; }
  void set_lm_chunk(int64_t rows) override { Store::SetLmChunk(rows); }
  // The carried state does not grow with the sequence.
  int64_t StateBytesPerToken() const override { return 0; }
  absl::Status EnableLora(const LoraOptions& o) override {
    std::vector<int> linears;
    for (const LayerParams& L : layers_)
      for (int w : {L.in_proj, L.x_proj, L.dt_w, L.out_proj}) linears.push_back(w);
    if (absl::Status s = Store::EnableLoraOn(o, LoraKind::Of(*this), linears); !s.ok()) return s;
    Store::lora_col0_ = LoraFirstColumns(shards_, *Store::LoraState(), tp_.rank);  // dropout masks
    return absl::OkStatus();
  }
  const LoraInfo* lora() const override { return Store::LoraState(); }
  const TensorParallel& tensor_parallel() const override { return tp_; }
  TpShard ShardOf(int param) const override { return ShardOfParam(shards_, Store::LoraState(), param); }

  std::unique_ptr<SequenceState> NewState(const StateOptions& o) override { return std::make_unique<MambaState>(o); }

  Tensor Embed(const int32_t* ids, Chunk c) override { return Store::EmbedRows(ops_, embed_, ids, c, Group()); }
  void EmbedBackward(const int32_t* ids, Chunk c, const Tensor& dx) override {
    Store::EmbedRowsBackward(ops_, embed_, ids, c, dx, Group());
  }

  Tensor LayerForward(int l, Chunk c, const Tensor& x_in, SequenceState& state_base, LayerSaved* saved) override {
    auto& state = static_cast<MambaState&>(state_base);
    const LayerParams& L = layers_[l];
    const int64_t n = c.size(), d = cfg_.hidden_size, E = inter_, N = cfg_.state_size;
    const int64_t R = cfg_.time_step_rank, K = cfg_.conv_kernel;
    const MemCategory act = saved ? MemCategory::kActivations : MemCategory::kWorkspace;
    // What backward reads. Under --dtype=bf16 the large tensors are made in workspace (`big`), rounded where they
    // are made and kept in bf16 (ParamStore::RoundAndKeep); the norm's rstd and the scan and conv states of the
    // chunk start (h0, tail0) stay in T: the rstd is small and divided by, and the states carry the scan's
    // recurrence exactly from chunk to chunk, as the relayed states do (MambaState).
    std::vector<Tensor> kept(kNumSaved);
    const MemCategory big = Store::ActCategory(act);
    auto keep = [&](Saved k, Tensor& t) {
      Tensor half = Store::RoundAndKeep(ops_, t, act);
      if (saved) kept[k] = std::move(half);
    };
    auto slot = [&](Saved k) { return saved ? &kept[k] : nullptr; };  // where a fused op puts what is kept
    // The scan input u and the conv path to it (xin, xc) are kept in bf16 but not rounded in the forward: rounding
    // the recurrence's input too moved the gradients past 2x Hugging Face's own bf16 recipe's error on the tiny
    // Mambas of tests/torch_ref/bf16_accuracy_test (their backward reads the bf16 copies).
    auto keep_copy = [&](Saved k, const Tensor& t) {
      if (saved) kept[k] = Store::Narrow(ops_, t, act);
    };
    // A working copy in T that the forward no longer reads: freed early under bf16 (f32 and f64 keep their schedule).
    auto done = [&](Tensor& t) {
      if (Store::HalfActivations()) t.Reset();
    };

    Tensor xn = New(big, {n, d}), rstd = New(act, {n});
    kept[kXn] = Store::NormAndKeep(ops_, x_in.data<T>(), W(L.norm), cfg_.layer_norm_epsilon, xn, rstd, act, saved);
    // in_proj rows [0, E) give the scan input, rows [E, 2E) the gate.
    Tensor xin = New(big, {n, E}), z = New(big, {n, E});
    Linear(xn.data<T>(), n, d, WRows(L.in_proj, 0), L.in_bias, 0, xin.data<T>(), E);
    Linear(xn.data<T>(), n, d, WRows(L.in_proj, E), L.in_bias, E, z.data<T>(), E);
    {
      typename Store::LoraAct a = Store::LoraIn(ops_, L.in_proj, xn.data<T>(), c, state.opts);
      Store::LoraOut(ops_, a, 0, E, xin.data<T>(), E);
      Store::LoraOut(ops_, a, E, E, z.data<T>(), E);
    }
    done(xn);
    keep_copy(kXin, xin);

    // The input state: zeros where a document (or the sequence) starts, else what the previous chunk left.
    const bool carries_in = !StartsDocument(state.opts.doc_starts, c.begin);
    const BoundaryState* in = carries_in ? MambaState::Find(state.cache, l, c.begin) : nullptr;
    if (carries_in && !in)
      throw std::logic_error(absl::StrCat("mamba layer ", l, ": no scan state at position ", c.begin));
    Tensor h0 = New(act, {E, N}), tail0 = New(act, {K - 1, E});
    CopyOrZero(in ? &in->h : nullptr, h0);
    CopyOrZero(in ? &in->tail : nullptr, tail0);
    const bool keep_out = KeepsStateAfter(state.opts, c);
    BoundaryState* out = keep_out ? &state.Slot(state.cache, l, c.end, state.opts.resident_layers, "states") : nullptr;
    if (out && !out->h.defined()) {
      out->h = New(MemCategory::kKVCache, {E, N});
      out->tail = New(MemCategory::kKVCache, {K - 1, E});
    }

    // The conv and the scan run document by document: a piece that starts one reads the zero state, the first
    // piece the chunk's input state, and the last piece leaves the output state.
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    Tensor xc = New(big, {n, E}), u = New(big, {n, E});
    for (const ChunkPiece& p : pieces)
      ops_.conv1d_forward(xin.data<T>() + p.row * E, p.first ? tail0.data<T>() : nullptr, W(L.conv_w),
                          L.conv_b >= 0 ? W(L.conv_b) : nullptr, p.rows, E, K, xc.data<T>() + p.row * E,
                          p.last && out ? out->tail.data<T>() : nullptr);
    done(xin);
    keep_copy(kXc, xc);
    ops_.silu_forward(xc.data<T>(), n * E, u.data<T>());
    done(xc);
    keep_copy(kU, u);
    // x_proj rows: [0, R) time step, [R, R + N) B, [R + N, R + 2N) C.
    // In one buffer: under tensor parallelism each rank's channels gave part of all three, summed in one all-reduce.
    Tensor proj = New(big, {n * (R + 2 * N)});
    Tensor dtr = proj.Rows(0, n * R), B = proj.Rows(n * R, n * (R + N)), C = proj.Rows(n * (R + N), n * (R + 2 * N));
    Linear(u.data<T>(), n, E, WRows(L.x_proj, 0), -1, 0, dtr.data<T>(), R);
    Linear(u.data<T>(), n, E, WRows(L.x_proj, R), -1, 0, B.data<T>(), N);
    Linear(u.data<T>(), n, E, WRows(L.x_proj, R + N), -1, 0, C.data<T>(), N);
    {
      typename Store::LoraAct a = Store::LoraIn(ops_, L.x_proj, u.data<T>(), c, state.opts);
      Store::LoraOut(ops_, a, 0, R, dtr.data<T>(), R);
      Store::LoraOut(ops_, a, R, N, B.data<T>(), N);
      Store::LoraOut(ops_, a, R + N, N, C.data<T>(), N);
    }
    tp_.AllReduce(proj.raw(), proj.numel(), dtype());
    {
      const Tensor half = Store::RoundAndKeep(ops_, proj, act);  // dt, B and C: views of one kept buffer
      if (saved) {
        kept[kDtr] = half.Rows(0, n * R);
        kept[kB] = half.Rows(n * R, n * (R + N));
        kept[kC] = half.Rows(n * (R + N), n * (R + 2 * N));
      }
    }
    Tensor dtpre = New(big, {n, E}), delta = New(big, {n, E});
    Linear(dtr.data<T>(), n, R, WRows(L.dt_w, 0), L.dt_b, 0, dtpre.data<T>(), E);
    Store::LoraAdd(ops_, L.dt_w, dtr.data<T>(), c, state.opts, dtpre.data<T>(), E);
    keep(kDtPre, dtpre);
    ops_.softplus_forward(dtpre.data<T>(), n * E, delta.data<T>());
    done(dtpre);
    keep(kDelta, delta);
    Tensor A = NegExp(L.a_log);
    Tensor y = New(big, {n, E});
    for (const ChunkPiece& p : pieces)
      ops_.selective_scan_forward(u.data<T>() + p.row * E, delta.data<T>() + p.row * E, A.data<T>(),
                                  B.data<T>() + p.row * N, C.data<T>() + p.row * N, W(L.d),
                                  p.first ? h0.data<T>() : nullptr, p.rows, E, N, y.data<T>() + p.row * E,
                                  p.last && out ? out->h.data<T>() : nullptr);
    done(u), done(delta), done(proj), done(dtr), done(B), done(C);
    Tensor gated = New(big, {n, E});
    Store::SwigluAndKeep(ops_, z, y, gated, act, slot(kZ), slot(kY), slot(kGated));  // y * silu(z)
    done(z), done(y);
    Tensor res = New(MemCategory::kActivations, {n, d});
    ops_.copy(res.data<T>(), x_in.data<T>(), n * d);
    Store::RowParallelAdd(ops_, Group(), gated.data<T>(), n, E, d, L.out_proj, L.out_bias, c, state.opts,
                          res.data<T>());

    if (saved) {
      kept[kX] = Store::Narrow(ops_, x_in, act);
      kept[kRstd] = rstd, kept[kH0] = h0, kept[kTail0] = tail0;
      saved->tensors = std::move(kept);
    }
    return Store::Boundary(ops_, std::move(res));
  }

  Tensor LayerBackward(int l, Chunk c, const Tensor& dy_in, LayerSaved& saved, SequenceState& state_base) override {
    auto& state = static_cast<MambaState&>(state_base);
    const LayerParams& L = layers_[l];
    const std::vector<Tensor>& s = saved.tensors;
    const int64_t n = c.size(), d = cfg_.hidden_size, E = inter_, N = cfg_.state_size;
    const int64_t R = cfg_.time_step_rank, K = cfg_.conv_kernel;
    const T* dy = dy_in.data<T>();
    constexpr MemCategory ws = MemCategory::kWorkspace;
    const bool adjoint = state.opts.adjoint_window > 0;
    // A saved tensor in T (under bf16 a copy widened into workspace, freed when the block using it ends).
    auto wide = [&](Saved k) -> Tensor { return Store::Widen(ops_, s[k]); };

    // out = x + out_proj(y * silu(z))
    Tensor dgated = New(ws, {n, E}), dz = New(ws, {n, E}), dyscan = New(ws, {n, E});
    Store::GemmW(ops_, false, n, E, d, T(1), dy, d, L.out_proj, E, T(0), dgated.data<T>(), E);
    {
      const Tensor gated = wide(kGated);
      if (T* g = G(L.out_proj)) ops_.gemm(true, false, d, E, n, T(1), dy, d, gated.data<T>(), E, T(1), g, E);
      Store::LoraBackward(ops_, L.out_proj, gated.data<T>(), dy, d, dgated.data<T>(), c, state.opts);
    }
    if (L.out_bias >= 0)
      if (T* g = G(L.out_bias)) ops_.bias_backward(dy, n, d, g);
    Store::SwigluBackwardKept(ops_, dgated.data<T>(), s[kZ], s[kY], dz.data<T>(), dyscan.data<T>());
    // Elementwise ops read the kept tensors a row tile at a time (ParamStore::WidenRows).
    auto by_rows = [&](auto op) {
      for (int64_t r0 = 0, tile = Store::WidenRows(n); r0 < n; r0 += tile) op(r0, std::min(n, r0 + tile));
    };
    auto rows = [&](Saved k, int64_t r0, int64_t r1) -> Tensor { return Store::Widen(ops_, s[k].Rows(r0, r1)); };

    // The gradient of c's output state is complete (later chunks ran their backward first); c leaves the gradient
    // of its input state for the previous chunk (none where a document starts: the zero state is a constant).
    const BoundaryState* gout = MambaState::Find(state.grad, l, c.end);
    BoundaryState* gin = nullptr;
    const bool carries_in = !StartsDocument(state.opts.doc_starts, c.begin);
    if (carries_in) {
      gin = &state.Slot(state.grad, l, c.begin, state.opts.resident_grad_layers, "state gradients");
      if (!gin->tail.defined()) {
        if (!adjoint) gin->h = New(MemCategory::kKVGrad, {E, N});
        gin->tail = New(MemCategory::kKVGrad, {K - 1, E});
      }
    }

    // The gradient of x_proj's output (d(dt), dB, dC) in one buffer, as its forward's.
    Tensor dproj = New(ws, {n * (R + 2 * N)});
    Tensor ddtr = dproj.Rows(0, n * R), dB = dproj.Rows(n * R, n * (R + N)),
           dC = dproj.Rows(n * (R + N), n * (R + 2 * N));
    Tensor du = New(ws, {n, E}), ddelta = New(ws, {n, E});
    Tensor A = NegExp(L.a_log), dA = Tensor::Zeros(&mem_, ws, Store::kDType, {E, N});
    const Tensor u_kept = wide(kU), delta = wide(kDelta), B = wide(kB), C = wide(kC);
    const T* u = u_kept.data<T>();
    const std::vector<ChunkPiece> pieces = DocumentPieces(c, state.opts.doc_starts);
    if (adjoint) {
      // Pairs (t, i) stay inside a document: only the last piece reads the tokens after c (of its document, as
      // relayed), and earlier chunks read c's first piece (and what follows it when c is one piece), or nothing.
      LaterTokens& later = state.Later(l);
      if (later.rows > 0 && later.begin != c.end)
        throw std::logic_error(absl::StrCat("mamba layer ", l, ": adjoint cotangents start at ", later.begin,
                                            ", not after the chunk ending at ", c.end));
      for (const ChunkPiece& p : pieces) {
        const int64_t reads = p.last ? later.rows : 0;
        state.pairs += ops_.selective_scan_backward_pairs(
            dyscan.data<T>() + p.row * E, u + p.row * E, delta.data<T>() + p.row * E, A.data<T>(),
            B.data<T>() + p.row * N, C.data<T>() + p.row * N, W(L.d), p.first ? s[kH0].data<T>() : nullptr, p.rows, E,
            N, reads ? later.dy.data<T>() : nullptr, reads ? later.delta.data<T>() : nullptr,
            reads ? later.C.data<T>() : nullptr, reads, state.opts.adjoint_window, du.data<T>() + p.row * E,
            ddelta.data<T>() + p.row * E, dA.data<T>(), dB.data<T>() + p.row * N, dC.data<T>() + p.row * N,
            GradOrScratch(L.d));
      }
      if (carries_in)
        later = PrependTokens({c.begin, c.begin + pieces[0].rows}, dyscan, delta, C,
                              pieces.size() == 1 ? later : LaterTokens{}, state.opts.adjoint_window - 1);
      else
        later = {};
    } else {
      for (const ChunkPiece& p : pieces)
        ops_.selective_scan_backward(
            dyscan.data<T>() + p.row * E, p.last && gout && gout->h.defined() ? gout->h.data<T>() : nullptr,
            u + p.row * E, delta.data<T>() + p.row * E, A.data<T>(), B.data<T>() + p.row * N, C.data<T>() + p.row * N,
            W(L.d), p.first ? s[kH0].data<T>() : nullptr, p.rows, E, N, du.data<T>() + p.row * E,
            ddelta.data<T>() + p.row * E, dA.data<T>(), dB.data<T>() + p.row * N, dC.data<T>() + p.row * N,
            GradOrScratch(L.d), p.first && gin ? gin->h.data<T>() : nullptr);
    }
    if (T* g = G(L.a_log)) ops_.ssm_neg_exp_backward(dA.data<T>(), A.data<T>(), E * N, g);  // A = -exp(A_log)

    // delta = softplus(dt_proj(dtr) + bias)
    Tensor ddtpre = New(ws, {n, E});
    by_rows([&](int64_t r0, int64_t r1) {
      ops_.softplus_backward(ddelta.data<T>() + r0 * E, rows(kDtPre, r0, r1).template data<T>(), (r1 - r0) * E,
                             ddtpre.data<T>() + r0 * E);
    });
    {
      const Tensor dtr = wide(kDtr);
      LinearBackward(ddtpre.data<T>(), E, dtr.data<T>(), n, R, WRows(L.dt_w, 0), G(L.dt_w), G(L.dt_b), ddtr.data<T>(),
                     T(0));
      Store::LoraBackward(ops_, L.dt_w, dtr.data<T>(), ddtpre.data<T>(), E, ddtr.data<T>(), c, state.opts);
    }
    tp_.AllReduce(dproj.raw(), dproj.numel(), dtype());  // each rank's channels gave part of it
    // x_proj: u -> (dtr, B, C); u also feeds the scan directly (du so far).
    T* gx = G(L.x_proj);
    LinearBackward(ddtr.data<T>(), R, u, n, E, WRows(L.x_proj, 0), gx, nullptr, du.data<T>(), T(1));
    LinearBackward(dB.data<T>(), N, u, n, E, WRows(L.x_proj, R), gx ? gx + R * E : nullptr, nullptr, du.data<T>(),
                   T(1));
    LinearBackward(dC.data<T>(), N, u, n, E, WRows(L.x_proj, R + N), gx ? gx + (R + N) * E : nullptr, nullptr,
                   du.data<T>(), T(1));
    {
      typename Store::LoraAct a = Store::LoraIn(ops_, L.x_proj, u, c, state.opts);
      Store::LoraOutBackward(ops_, a, 0, R, ddtr.data<T>(), R);
      Store::LoraOutBackward(ops_, a, R, N, dB.data<T>(), N);
      Store::LoraOutBackward(ops_, a, R + N, N, dC.data<T>(), N);
      Store::LoraInBackward(ops_, a, du.data<T>(), c, state.opts);
    }

    // u = silu(conv(xin))
    Tensor dxc = New(ws, {n, E}), dxin = New(ws, {n, E});
    by_rows([&](int64_t r0, int64_t r1) {
      ops_.silu_backward(du.data<T>() + r0 * E, rows(kXc, r0, r1).template data<T>(), (r1 - r0) * E,
                         dxc.data<T>() + r0 * E);
    });
    {
      const Tensor xin = wide(kXin);
      for (const ChunkPiece& p : pieces)
        ops_.conv1d_backward(dxc.data<T>() + p.row * E, p.last && gout ? gout->tail.data<T>() : nullptr,
                             xin.data<T>() + p.row * E, p.first ? s[kTail0].data<T>() : nullptr, W(L.conv_w), p.rows, E,
                             K, dxin.data<T>() + p.row * E, p.first && gin ? gin->tail.data<T>() : nullptr,
                             GradOrScratch(L.conv_w), L.conv_b >= 0 ? GradOrScratch(L.conv_b) : nullptr);
    }

    // (xin, z) = in_proj(xn)
    Tensor dxn = New(ws, {n, d});
    const Tensor xn_kept = wide(kXn);
    const T* xn = xn_kept.data<T>();
    T* gin_w = G(L.in_proj);
    T* gin_b = L.in_bias >= 0 ? G(L.in_bias) : nullptr;
    LinearBackward(dxin.data<T>(), E, xn, n, d, WRows(L.in_proj, 0), gin_w, gin_b, dxn.data<T>(), T(0));
    LinearBackward(dz.data<T>(), E, xn, n, d, WRows(L.in_proj, E), gin_w ? gin_w + E * d : nullptr,
                   gin_b ? gin_b + E : nullptr, dxn.data<T>(), T(1));
    {
      typename Store::LoraAct a = Store::LoraIn(ops_, L.in_proj, xn, c, state.opts);
      Store::LoraOutBackward(ops_, a, 0, E, dxin.data<T>(), E);
      Store::LoraOutBackward(ops_, a, E, E, dz.data<T>(), E);
      Store::LoraInBackward(ops_, a, dxn.data<T>(), c, state.opts);
    }
    tp_.AllReduce(dxn.raw(), n * d, dtype());  // each rank's channels gave part of it

    Tensor dx = New(MemCategory::kActivations, {n, d});
    ops_.copy(dx.data<T>(), dy, n * d);
    ops_.rmsnorm_backward(dxn.data<T>(), wide(kX).template data<T>(), W(L.norm), s[kRstd].data<T>(), n, d, dx.data<T>(),
                          GradOrScratch(L.norm), true);
    return dx;
  }

  HeadResult HeadLoss(Chunk c, const Tensor& h, const int32_t* labels, const TokenObjective* objective,
                      double grad_scale, bool need_grad) override {
    return Store::Head(ops_, final_norm_, head_, cfg_.layer_norm_epsilon, cfg_.hidden_size, vocab_rows_, c, h, labels,
                       objective, grad_scale, need_grad, Group());
  }

 private:
  // Later positions read the output state of c, unless c ends the sequence or a document starts at c.end.
  // c's scan cotangents, deltas and C followed by those of the tokens after c, cut to the first `keep` rows: what
  // the chunks before c read.
  LaterTokens PrependTokens(Chunk c, const Tensor& dy, const Tensor& delta, const Tensor& C, const LaterTokens& after,
                            int64_t keep) {
    LaterTokens out;
    out.begin = c.begin;
    out.rows = std::min(keep, c.size() + after.rows);
    if (out.rows == 0) return out;
    const int64_t from_c = std::min(out.rows, c.size()), from_after = out.rows - from_c;
    auto join = [&](const Tensor& here, const Tensor& there, int64_t width) {
      Tensor t = New(MemCategory::kKVGrad, {out.rows, width});
      ops_.copy(t.data<T>(), here.data<T>(), from_c * width);
      if (from_after) ops_.copy(t.data<T>() + from_c * width, there.data<T>(), from_after * width);
      return t;
    };
    out.dy = join(dy, after.dy, inter_);
    out.delta = join(delta, after.delta, inter_);
    out.C = join(C, after.C, cfg_.state_size);
    return out;
  }
  void CopyOrZero(const Tensor* src, Tensor& dst) const {
    if (src)
      ops_.copy(dst.data<T>(), src->data<T>(), dst.numel());
    else
      dst.SetZero();
  }
  // A = -exp(A_log), on the model's device.
  Tensor NegExp(int a_log) {
    const int64_t count = params_[a_log].value.numel();
    Tensor A = New(MemCategory::kWorkspace, {count});
    ops_.ssm_neg_exp(W(a_log), count, A.data<T>());
    return A;
  }
  // Rows [row0, ..) of weight matrix w (in its storage dtype): one block of a matrix the model splits by rows.
  WeightView WRows(int w, int64_t row0) const {
    const Tensor& t = params_[w].value;
    const int64_t row = t.numel() / t.dim(0);
    return {static_cast<const char*>(t.raw()) + row0 * row * static_cast<int64_t>(DTypeSize(t.dtype())), t.dtype()};
  }
  // y[n][out] = x[n][in] w[out][in]^T (+ bias rows [b_off, b_off + out) of parameter b)
  void Linear(const T* x, int64_t n, int64_t in, WeightView w, int b, int64_t b_off, T* y, int64_t out) {
    GemmWeight(ops_, false, true, n, out, in, T(1), x, in, w, in, T(0), y, out);
    if (b >= 0) ops_.add_bias(y, W(b) + b_off, n, out);
  }
  // dx (+)= dy w; dw += dy^T x; db += colsum(dy)
  void LinearBackward(const T* dy, int64_t out, const T* x, int64_t n, int64_t in, WeightView w, T* dw, T* db, T* dx,
                      T beta) {
    GemmWeight(ops_, false, false, n, in, out, T(1), dy, out, w, in, beta, dx, in);
    if (dw) ops_.gemm(true, false, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
    if (db) ops_.bias_backward(dy, n, out, db);
  }

  // The group when split over more than one rank, else null (no communication).
  const TensorParallel* Group() const { return tp_.on() ? &tp_ : nullptr; }

  MambaConfig cfg_;
  const OpTable<T>& ops_;
  TensorParallel tp_;
  int64_t inter_, vocab_rows_;   // this rank's channels and vocabulary rows (the config's, divided by tp_.size)
  std::vector<TpShard> shards_;  // per base parameter (LoRA adapters: ShardOf)
  std::vector<LayerParams> layers_;
  int embed_ = -1, final_norm_ = -1, head_ = -1;
};

absl::Status ValidateMamba(const MambaConfig& c) {
  for (auto [field, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                          {"hidden_size", c.hidden_size},
                          {"state_size", c.state_size},
                          {"num_hidden_layers", c.num_layers},
                          {"intermediate_size", c.intermediate_size},
                          {"conv_kernel", c.conv_kernel},
                          {"time_step_rank", c.time_step_rank}}) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config field '", field, "' must be positive, got ", v));
  }
  return absl::OkStatus();
}

}  // namespace

void InitMambaScan(MambaModel& model, uint64_t seed) {
  const MambaConfig& c = model.config();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double dt_min = 1e-3, dt_max = 1e-1, dt_floor = 1e-4, dt_std = 1.0 / std::sqrt(c.time_step_rank);
  auto set = [&](Param& p, auto value) { SetFromHost(p.value, value); };
  for (Param& p : model.params()) {
    if (absl::EndsWith(p.name, "mixer.A_log")) {
      set(p, [&](int64_t i) { return std::log(static_cast<double>(i % c.state_size + 1)); });
    } else if (absl::EndsWith(p.name, "mixer.D")) {
      set(p, [](int64_t) { return 1.0; });
    } else if (absl::EndsWith(p.name, "mixer.dt_proj.weight")) {
      set(p, [&](int64_t) { return dt_std * (2 * unit(rng) - 1); });
    } else if (absl::EndsWith(p.name, "mixer.dt_proj.bias")) {
      set(p, [&](int64_t) {  // softplus(bias) = dt, log-uniform in [dt_min, dt_max]
        const double dt = std::max(dt_floor, std::exp(std::log(dt_min) + unit(rng) * std::log(dt_max / dt_min)));
        return dt + std::log(-std::expm1(-dt));
      });
    }
  }
}

absl::StatusOr<std::unique_ptr<MambaModel>> CreateMamba(const MambaConfig& config, DType dtype, Device device,
                                                        const TensorParallel& tp, bool frozen_base) {
  if (absl::Status s = ValidateMamba(config); !s.ok()) return s;
  if (absl::Status s = ValidateTensorParallel(config, tp.size); !s.ok()) return s;
  if (absl::Status s = CheckTensorParallelPlacement(tp, device); !s.ok()) return s;
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (dtype == DType::kF32)
    return std::unique_ptr<MambaModel>(new Mamba<float>(config, device, dtype, tp, frozen_base));
  if (dtype == DType::kF64)
    return std::unique_ptr<MambaModel>(new Mamba<double>(config, device, dtype, tp, frozen_base));
  // bf16 matrices over f32 compute (param_store.h), as the transformer: the CPU and CUDA tables' bf16 entries.
  if (dtype == DType::kBF16)
    return std::unique_ptr<MambaModel>(new Mamba<float>(config, device, dtype, tp, frozen_base));
  return absl::InvalidArgumentError(
      absl::StrCat("compute dtype ", DTypeName(dtype), " is not supported on the CPU backend (use f32 or f64)"));
}

}  // namespace sg
