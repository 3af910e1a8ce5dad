// What every model family keeps the same way: parameters under their Hugging Face names (with gradients), the
// tracker their memory is counted by, tensor allocation, and the chunked LM head over a final norm and a head
// matrix. A model class derives from Model's family interface and from ParamStore<T>. LoRA adapters (core/lora.h)
// are parameters of the store too, applied by the Lora* helpers inside a model's linear ops.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/lm_head.h"
#include "core/lora.h"
#include "core/tensor_parallel.h"

namespace sg {

// ParamStore::WidenRows's tile (a variable so that tests run several tiles on tiny models).
inline int64_t bf16_widen_rows = 512;

template <typename T>
class ParamStore {
 protected:
  static constexpr DType kDType = std::is_same_v<T, double> ? DType::kF64 : DType::kF32;

  // bf16 storage (T = float), set before the first Add: matrices (linear and embedding weights) are stored in bf16
  // and kernels read them tile by tile; vectors (norms, biases) and every gradient stay in T.
  absl::Status SetWeightDType(DType t) {
    if (t != kDType && !(t == DType::kBF16 && kDType == DType::kF32))
      return absl::InvalidArgumentError(absl::StrCat("--dtype: weights in ", DTypeName(t), " need f32 compute"));
    weight_dtype_ = t;
    return absl::OkStatus();
  }
  // Set before the first Add: the parameters get no gradient (a model created frozen, for LoRA to adapt or to score
  // with), so that a LoRA run never holds a gradient for the whole base (fp32: twice a bf16 base's bytes).
  void SetFrozenBase(bool frozen) { frozen_base_ = frozen; }
  int Add(const std::string& name, std::vector<int64_t> shape) {
    return AddIn(shape.size() >= 2 ? weight_dtype_ : kDType, name, shape);
  }
  // Parameters that stay in T under bf16 storage (LoRA adapters).
  int AddFullPrecision(const std::string& name, std::vector<int64_t> shape) { return AddIn(kDType, name, shape); }
  Tensor New(MemCategory cat, std::vector<int64_t> shape) { return Tensor::Empty(&mem_, cat, kDType, shape); }
  // A parameter stored in T; one stored in bf16 is read through Wv (a throw here, never a misread).
  T* W(int idx) const {
    if (params_[idx].value.dtype() != kDType)
      throw std::logic_error(absl::StrCat(params_[idx].name, " is stored in ", DTypeName(params_[idx].value.dtype()),
                                          ", not ", DTypeName(kDType)));
    return params_[idx].value.template data<T>();
  }
  WeightView Wv(int idx) const { return {params_[idx].value.raw(), params_[idx].value.dtype()}; }
  // y = alpha x op(W) + beta y with W parameter w (any storage dtype).
  void GemmW(const OpTable<T>& ops, bool trans_w, int64_t m, int64_t n, int64_t k, T alpha, const T* x, int64_t ldx,
             int w, int64_t ldw, T beta, T* y, int64_t ldy) const {
    GemmWeight(ops, false, trans_w, m, n, k, alpha, x, ldx, Wv(w), ldw, beta, y, ldy);
  }
  // A layer's output as the layer hands it on: under bf16 storage rounded to bf16 values (the activation dtype,
  // Model::activation_dtype), so that a strategy storing it in bf16 (Model::StoreRows) and one keeping it in f32
  // differentiate the same function, and a recompute starts from what the forward used.
  Tensor Boundary(const OpTable<T>& ops, Tensor t) {
    RoundAndKeep(ops, t, MemCategory::kWorkspace);
    return t;
  }
  // bf16 storage: the large tensors a layer makes inside it (normed inputs, projections, attention outputs, SwiGLU
  // and scan operands) are rounded to bf16 values where they are made, as its output is (Boundary), and a layer
  // keeps them for its backward in bf16: the forward, a recompute and the backward all read the same values, and
  // the activations a step holds halve. The layer computes them in T in workspace (ActCategory) first.
  bool HalfActivations() const {
    if constexpr (std::is_same_v<T, float>) return weight_dtype_ == DType::kBF16;
    return false;
  }
  // Where a layer computes a tensor that it keeps for its backward (act) or not: in workspace when the kept copy is
  // a bf16 one (HalfActivations).
  MemCategory ActCategory(MemCategory act) const { return HalfActivations() ? MemCategory::kWorkspace : act; }
  // Under HalfActivations t is rounded in place to bf16 values and returned in bf16 (a new tensor of category cat);
  // otherwise t itself, untouched (f32 and f64 runs are unchanged).
  Tensor RoundAndKeep(const OpTable<T>& ops, Tensor& t, MemCategory cat) {
    if (!HalfActivations()) return t;
    Tensor half = Tensor::Empty(&mem_, cat, DType::kBF16, t.shape());
    if constexpr (std::is_same_v<T, float>)
      ops.round_bf16(t.template data<float>(), t.numel(), half.template data<uint16_t>());
    return half;
  }
  // A bf16 tensor shaped like t (category cat) for a fused op to write the kept copy into; undefined unless
  // HalfActivations and wanted.
  Tensor HalfOf(const Tensor& t, MemCategory cat, bool wanted) {
    return HalfActivations() && wanted ? Tensor::Empty(&mem_, cat, DType::kBF16, t.shape()) : Tensor();
  }
  static uint16_t* Bits(Tensor& half) { return half.defined() ? half.template data<uint16_t>() : nullptr; }
  // y = rmsnorm(x) with weight w (rstd per row) followed by RoundAndKeep(y), in one pass under HalfActivations
  // (rmsnorm_forward_bf16). Returns what RoundAndKeep would, when keep; else an undefined tensor.
  Tensor NormAndKeep(const OpTable<T>& ops, const T* x, const T* w, double eps, Tensor& y, Tensor& rstd,
                     MemCategory cat, bool keep) {
    const int64_t n = rstd.numel(), d = y.numel() / n;
    if (!HalfActivations()) {
      ops.rmsnorm_forward(x, w, n, d, eps, y.template data<T>(), rstd.template data<T>());
      return keep ? y : Tensor();
    }
    Tensor half = HalfOf(y, cat, keep);
    if constexpr (std::is_same_v<T, float>)
      ops.rmsnorm_forward_bf16(x, w, n, d, eps, y.template data<float>(), rstd.template data<float>(), Bits(half));
    return half;
  }
  // out = swiglu(gate, up), with RoundAndKeep of gate and up before it and of out after it, in one pass under
  // HalfActivations (swiglu_forward_bf16; gate and up themselves are left unrounded). What RoundAndKeep would
  // return goes to each of kept_gate, kept_up, kept_out that is not null.
  void SwigluAndKeep(const OpTable<T>& ops, const Tensor& gate, const Tensor& up, Tensor& out, MemCategory cat,
                     Tensor* kept_gate, Tensor* kept_up, Tensor* kept_out) {
    Tensor gate_kept = gate, up_kept = up, out_kept = out;  // f32, f64: the tensors themselves
    if (!HalfActivations()) {
      ops.swiglu_forward(gate.template data<T>(), up.template data<T>(), out.numel(), out.template data<T>());
    } else if constexpr (std::is_same_v<T, float>) {
      gate_kept = HalfOf(gate, cat, kept_gate), up_kept = HalfOf(up, cat, kept_up);
      out_kept = HalfOf(out, cat, kept_out);
      ops.swiglu_forward_bf16(gate.template data<float>(), up.template data<float>(), out.numel(),
                              out.template data<float>(), Bits(gate_kept), Bits(up_kept), Bits(out_kept));
    }
    if (kept_gate) *kept_gate = std::move(gate_kept);
    if (kept_up) *kept_up = std::move(up_kept);
    if (kept_out) *kept_out = std::move(out_kept);
  }
  // swiglu_backward over the gate and up a forward kept (SwigluAndKeep): bf16 copies are read as they are.
  void SwigluBackwardKept(const OpTable<T>& ops, const T* dout, const Tensor& gate, const Tensor& up, T* dgate,
                          T* dup) {
    if (gate.dtype() == kDType)
      return ops.swiglu_backward(dout, gate.template data<T>(), up.template data<T>(), gate.numel(), dgate, dup);
    if constexpr (std::is_same_v<T, float>)
      ops.swiglu_backward_bf16(dout, gate.template data<uint16_t>(), up.template data<uint16_t>(), gate.numel(), dgate,
                               dup);
  }
  // t as a layer keeps it: a bf16 copy (category cat) under HalfActivations, else t itself. Exact for a t that
  // already holds bf16 values (a layer's input: Boundary's output or a bf16 embedding row).
  Tensor Narrow(const OpTable<T>& ops, const Tensor& t, MemCategory cat) {
    if (!HalfActivations()) return t;
    Tensor half = Tensor::Empty(&mem_, cat, DType::kBF16, t.shape());
    if constexpr (std::is_same_v<T, float>)
      ops.f32_to_bf16(t.template data<float>(), t.numel(), half.template data<uint16_t>());
    return half;
  }
  // Rows of kept tensors that a backward widens at a time for an elementwise op under HalfActivations, so that no
  // f32 copy of a whole [n][width] activation exists beside its gradients; all n otherwise (one call, as in f32).
  int64_t WidenRows(int64_t n) const { return HalfActivations() ? std::min(n, bf16_widen_rows) : n; }
  // A tensor a layer kept (RoundAndKeep) as its backward reads it, in T: itself, or a copy widened into workspace
  // that lives only as long as the backward needs it.
  Tensor Widen(const OpTable<T>& ops, const Tensor& kept) {
    if (kept.dtype() == kDType) return kept;
    Tensor wide = New(MemCategory::kWorkspace, kept.shape());
    if constexpr (std::is_same_v<T, float>)
      ops.bf16_to_f32(kept.template data<uint16_t>(), kept.numel(), wide.template data<float>());
    return wide;
  }
  T* G(int idx) const { return params_[idx].grad.defined() ? params_[idx].grad.template data<T>() : nullptr; }
  int AddIn(DType value_dtype, const std::string& name, const std::vector<int64_t>& shape) {
    Param p;
    p.name = name;
    p.value = Tensor::Zeros(&mem_, MemCategory::kWeights, value_dtype, shape);
    if (!frozen_base_) p.grad = Tensor::Zeros(&mem_, MemCategory::kGrads, kDType, shape);
    params_.push_back(std::move(p));
    return static_cast<int>(params_.size()) - 1;
  }
  // Frozen parameters still need somewhere for a kernel to write their gradient (one buffer per parameter, so
  // that two of them can be written by one call).
  T* GradOrScratch(int idx) {
    if (T* g = G(idx)) return g;
    Tensor& buf = scratch_[idx];
    if (!buf.defined()) buf = New(MemCategory::kWorkspace, params_[idx].value.shape());
    buf.SetZero();
    return buf.template data<T>();
  }
  void SetLmChunk(int64_t rows) { lm_chunk_ = std::max<int64_t>(1, rows); }

  // Final norm (parameter final_norm, epsilon eps) + LM head (parameter head, [vocab][d]) + objective on chunk c;
  // vocab_parallel: head holds this rank's `vocab` rows of a vocabulary split over the group (lm_head.h).
  // norm_weight: what the norm multiplies by, when it is not final_norm's weight itself (a zero-centred norm's 1 + w,
  // whose gradient is final_norm's). logit_scale: the logits are logit_scale (head hn) (Falcon-H1's
  // lm_head_multiplier).
  HeadResult Head(const OpTable<T>& ops, int final_norm, int head, double eps, int64_t d, int64_t vocab, Chunk c,
                  const Tensor& h, const int32_t* labels, const TokenObjective* objective, double grad_scale,
                  bool need_grad, const TensorParallel* vocab_parallel = nullptr, const T* norm_weight = nullptr,
                  double logit_scale = 1.0) {
    LmHeadWeights<T> w;
    w.vocab_parallel = vocab_parallel;
    w.norm = norm_weight ? norm_weight : W(final_norm);
    w.norm_grad = need_grad ? GradOrScratch(final_norm) : nullptr;
    w.head = Wv(head);
    w.head_grad = G(head);
    w.eps = eps;
    w.d = d;
    w.vocab = vocab;
    w.lm_chunk = lm_chunk_;
    w.logit_scale = logit_scale;
    return LmHeadLoss<T>(ops, mem_, kDType, w, c, h, labels, objective, grad_scale, need_grad);
  }

  // ---- LoRA ----
  // Adds adapters to the linear weights (parameter indices, [out][in]) whose module name is in o.targets and to
  // the expert weights ([experts][out][in], e.g. "<layer>.mlp.experts.gate_up_proj") whose last two name components
  // are, then freezes every other parameter (releases its gradient).
  absl::Status EnableLoraOn(const LoraOptions& o, const LoraKind& kind, const std::vector<int>& linear_weights,
                            const std::vector<int>& expert_weights = {}) {
    if (lora_) return absl::FailedPreconditionError("LoRA is already enabled on this model");
    if (absl::Status s = ValidateLoraOptions(o, kind); !s.ok()) return s;
    const std::set<std::string> targets(o.targets.begin(), o.targets.end());
    std::vector<int> chosen;
    for (int w : linear_weights)
      if (targets.count(LoraTargetOf(w, false))) chosen.push_back(w);
    const size_t linear_count = chosen.size();
    for (int w : expert_weights)
      if (targets.count(LoraTargetOf(w, true))) chosen.push_back(w);
    if (chosen.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("--lora_targets: no module of this model is named ", absl::StrJoin(o.targets, " or ")));
    // B A has rank at most min(in, out). A rank above that of every adapted weight only costs memory (and may not
    // fit); above some of them is allowed, as PEFT does (e.g. Mamba's narrow dt_proj among wider targets).
    int64_t widest = 0;
    std::string widest_name;
    for (size_t i = 0; i < chosen.size(); ++i) {
      const int w = chosen[i];
      const Tensor& v = params_[w].value;
      const int64_t out = v.dim(i < linear_count ? 0 : 1), in = v.numel() / out / (i < linear_count ? 1 : v.dim(0));
      if (std::min(in, out) > widest) widest = std::min(in, out), widest_name = params_[w].name;
    }
    if (o.rank > widest)
      return absl::InvalidArgumentError(absl::StrCat("--lora_rank ", o.rank, " exceeds min(in, out) = ", widest,
                                                     " of every adapted weight (largest: ", widest_name, ")"));
    // The base's gradients, unless the model was created frozen (SetFrozenBase), go now; a device allocator keeps
    // their blocks cached for reuse (docs/gpu.md, Measured on a GPU). The adapters added below get theirs.
    for (Param& p : params_) p.grad.Reset();
    frozen_base_ = false;
    auto info = std::make_unique<LoraInfo>();
    info->options = o;
    info->options.targets.clear();  // the modules this model has ("all" names every family's), as PEFT records them
    for (const std::string& t : o.targets)
      for (size_t i = 0; i < chosen.size(); ++i)
        if (LoraTargetOf(chosen[i], i >= linear_count) == t) {
          info->options.targets.push_back(t);
          break;
        }
    adapter_of_.assign(params_.size(), -1);
    std::mt19937_64 rng(o.seed ^ 0x6C6F7261496E6974ull);
    for (size_t i = 0; i < chosen.size(); ++i) {
      const int w = chosen[i];
      const Tensor& weight = params_[w].value;
      LoraAdapter ad;
      ad.weight = w;
      if (i < linear_count) {
        ad.module = params_[w].name.substr(0, params_[w].name.size() - 7);
        ad.out = weight.dim(0);
        ad.in = weight.numel() / ad.out;
      } else {
        std::vector<std::string> expert_names;
        for (size_t j = linear_count; j < chosen.size(); ++j) expert_names.push_back(params_[chosen[j]].name);
        ad.module = LoraExpertWrapper(expert_names, i - linear_count);
        ad.experts = weight.dim(0);
        ad.out = weight.dim(1);
        ad.in = weight.dim(2);
      }
      const int64_t E = std::max<int64_t>(ad.experts, 1);
      ad.a = AddFullPrecision(ad.module + ".lora_A.weight", {E * o.rank, ad.in});
      ad.b = AddFullPrecision(ad.module + ".lora_B.weight", {ad.out, o.rank * E});
      // PEFT: kaiming_uniform_(a=sqrt(5)) on [r][in], i.e. uniform in +-1/sqrt(in); B = 0.
      std::uniform_real_distribution<double> uniform(-1.0 / std::sqrt(static_cast<double>(ad.in)),
                                                     1.0 / std::sqrt(static_cast<double>(ad.in)));
      if (mem_.device() != Device::kMeta)  // meta tensors hold no values
        SetFromHost(params_[ad.a].value, [&](int64_t) { return uniform(rng); });
      adapter_of_[w] = static_cast<int>(info->adapters.size());
      info->adapters.push_back(ad);
      expert_b_order_.push_back(ad.experts ? ExpertBOrder(ad, o.rank) : Tensor());
    }
    adapter_of_.resize(params_.size(), -1);
    lora_ = std::move(info);
    mem_.ResetPeak();
    return absl::OkStatus();
  }
  const LoraInfo* LoraState() const { return lora_.get(); }

  // One adapted linear op on a chunk: the adapter's input (x, or x with the dropout mask), its factors (an expert's
  // slices for an expert weight) and t = input A^T.
  struct LoraAct {
    const LoraAdapter* ad = nullptr;  // null: the weight has no adapter (every helper is then a no-op)
    const T* x = nullptr;             // the adapter's input [n][in]
    const T* a_w = nullptr;           // A [r][in]
    const T* b_w = nullptr;           // B [out][r]
    T* a_grad = nullptr;              // their gradients (null: none)
    T* b_grad = nullptr;
    Tensor dropped, t;  // x after dropout (when on); t [n][rank]
    Tensor dt;          // backward: the gradient of t
    int64_t n = 0;
  };
  // t = dropout(x) A^T for the adapter of base weight w over chunk c (x: [c.size()][in]).
  LoraAct LoraIn(const OpTable<T>& ops, int w, const T* x, Chunk c, const StateOptions& st) {
    LoraAct a;
    if (!lora_ || lora_->disabled || w < 0 || adapter_of_[w] < 0) return a;
    a.ad = &lora_->adapters[adapter_of_[w]];
    a.n = c.size();
    a.x = x;
    a.a_w = W(a.ad->a), a.b_w = W(a.ad->b), a.a_grad = G(a.ad->a), a.b_grad = G(a.ad->b);
    const int64_t n = a.n, in = a.ad->in;
    const double p = lora_->options.dropout;
    if (st.training && p > 0) {
      a.dropped = New(MemCategory::kWorkspace, {n, in});
      ops.lora_dropout(x, n, in, st.seed, static_cast<uint64_t>(w), c.begin, LoraColumn0(w), p, false,
                       a.dropped.template data<T>());
      a.x = a.dropped.template data<T>();
    }
    LoraProject(ops, a);
    return a;
  }
  // y[n][rows] (row stride ldy) += (alpha / r) t B[row0, row0 + rows)^T: the adapter's output rows row0.. of the
  // module (a model that splits one weight into row blocks calls this once per block).
  void LoraOut(const OpTable<T>& ops, const LoraAct& a, int64_t row0, int64_t rows, T* y, int64_t ldy) {
    if (!a.ad) return;
    const int64_t r = lora_->options.rank;
    ops.gemm(false, true, a.n, rows, r, static_cast<T>(lora_->scale()), a.t.template data<T>(), r, a.b_w + row0 * r, r,
             T(1), y, ldy);
  }
  // Backward of LoraOut given dy of the rows block: accumulates dB of those rows and the gradient of t.
  void LoraOutBackward(const OpTable<T>& ops, LoraAct& a, int64_t row0, int64_t rows, const T* dy, int64_t lddy) {
    if (!a.ad) return;
    const int64_t r = lora_->options.rank;
    const T s = static_cast<T>(lora_->scale());
    if (!a.dt.defined()) a.dt = Tensor::Zeros(&mem_, MemCategory::kWorkspace, kDType, {a.n, r});
    ops.gemm(false, false, a.n, r, rows, s, dy, lddy, a.b_w + row0 * r, r, T(1), a.dt.template data<T>(), r);
    if (a.b_grad)
      ops.gemm(true, false, rows, r, a.n, s, dy, lddy, a.t.template data<T>(), r, T(1), a.b_grad + row0 * r, r);
  }
  // Accumulates dA and adds the adapter's input gradient to dx [n][in] (through the same dropout mask).
  void LoraInBackward(const OpTable<T>& ops, const LoraAct& a, T* dx, Chunk c, const StateOptions& st) {
    if (!a.ad || !a.dt.defined()) return;
    const int64_t n = a.n, in = a.ad->in, r = lora_->options.rank;
    const T* dt = a.dt.template data<T>();
    if (a.a_grad) ops.gemm(true, false, r, in, n, T(1), dt, r, a.x, in, T(1), a.a_grad, in);
    if (!a.dropped.defined()) {
      ops.gemm(false, false, n, in, r, T(1), dt, r, a.a_w, in, T(1), dx, in);
      return;
    }
    Tensor dxd = New(MemCategory::kWorkspace, {n, in});
    ops.gemm(false, false, n, in, r, T(1), dt, r, a.a_w, in, T(0), dxd.template data<T>(), in);
    ops.lora_dropout(dxd.template data<T>(), n, in, st.seed, static_cast<uint64_t>(a.ad->weight), c.begin,
                     LoraColumn0(a.ad->weight), lora_->options.dropout, true, dx);
  }

  // ---- LoRA on expert weights [E][out][in] (lora.h: PEFT's target_parameters) ----
  // A MoE pass's view of one expert weight's adapter: B_e of every expert, gathered from lora_B [out][r E] into
  // [E][out][r] so that each is a plain [out][r] matrix; in a backward pass also their gradient, which
  // ExpertLoraEnd adds back into lora_B's.
  struct ExpertLora {
    const LoraAdapter* ad = nullptr;  // null: the weight has no adapter
    Tensor b, db;
  };
  ExpertLora ExpertLoraOf(const OpTable<T>& ops, int w, bool backward) {
    ExpertLora L;
    if (!lora_ || lora_->disabled || w < 0 || adapter_of_[w] < 0) return L;
    L.ad = &lora_->adapters[adapter_of_[w]];
    const Tensor& order = expert_b_order_[adapter_of_[w]];
    L.b = New(MemCategory::kWorkspace, {order.numel()});
    ops.gather_rows(W(L.ad->b), order.template data<int32_t>(), order.numel(), 1, L.b.template data<T>());
    if (backward && G(L.ad->b)) L.db = Tensor::Zeros(&mem_, MemCategory::kWorkspace, kDType, {order.numel()});
    return L;
  }
  void ExpertLoraEnd(const OpTable<T>& ops, const ExpertLora& L) {
    if (!L.db.defined()) return;
    const Tensor& order = expert_b_order_[adapter_of_[L.ad->weight]];
    ops.scatter_add_rows(L.db.template data<T>(), order.template data<int32_t>(), nullptr, order.numel(), 1,
                         G(L.ad->b));
  }
  // t = x A_e^T for expert e's rows x [n][in] (no dropout: refused on expert weights, as PEFT does).
  LoraAct ExpertLoraIn(const OpTable<T>& ops, const ExpertLora& L, int64_t e, const T* x, int64_t n) {
    LoraAct a;
    if (!L.ad) return a;
    const int64_t r = lora_->options.rank, in = L.ad->in, out = L.ad->out;
    a.ad = L.ad;
    a.n = n;
    a.x = x;
    a.a_w = W(L.ad->a) + e * r * in;
    a.b_w = L.b.template data<T>() + e * out * r;
    if (T* g = G(L.ad->a)) a.a_grad = g + e * r * in;
    if (L.db.defined()) a.b_grad = L.db.template data<T>() + e * out * r;
    LoraProject(ops, a);
    return a;
  }

  // The embedding rows of chunk c's tokens (table `embed` [vocab][d]); backward accumulates into its gradient.
  // vocab_parallel: the table holds this rank's rows of a vocabulary split over the group; other ranks' tokens get
  // zeros here and the rows are summed over the group.
  Tensor EmbedRows(const OpTable<T>& ops, int embed, const int32_t* ids, Chunk c,
                   const TensorParallel* vocab_parallel = nullptr) {
    // A chunk's pass starts here: an asynchronous device reports faults of earlier work and labels what follows.
    if (const DeviceBackend* b = FindBackend(mem_.device()); b && b->begin_chunk)
      b->begin_chunk(absl::StrCat("chunk [", c.begin, ", ", c.end, ")"));
    const Tensor& table = params_[embed].value;
    const int64_t n = c.size(), rows = table.dim(0), d = table.dim(1);
    const int64_t v0 = vocab_parallel ? vocab_parallel->rank * rows : 0;  // a whole table: one shard of all rows
    Tensor x = New(MemCategory::kActivations, {n, d});
    if (table.dtype() == DType::kBF16) {
      if constexpr (std::is_same_v<T, float>)
        ops.embedding_shard_forward_bf16(ids + c.begin, n, table.template data<uint16_t>(), rows, v0, d,
                                         x.template data<float>());
    } else if (vocab_parallel) {
      ops.embedding_shard_forward(ids + c.begin, n, W(embed), rows, v0, d, x.template data<T>());
    } else {
      ops.embedding_forward(ids + c.begin, n, W(embed), d, x.template data<T>());
    }
    if (vocab_parallel) vocab_parallel->AllReduce(x.raw(), n * d, kDType);
    return x;
  }
  void EmbedRowsBackward(const OpTable<T>& ops, int embed, const int32_t* ids, Chunk c, const Tensor& dx,
                         const TensorParallel* vocab_parallel = nullptr) {
    T* g = G(embed);
    if (!g) return;
    const int64_t rows = params_[embed].value.dim(0), d = params_[embed].value.dim(1);
    if (!vocab_parallel) return ops.embedding_backward(ids + c.begin, c.size(), dx.template data<T>(), d, g);
    ops.embedding_shard_backward(ids + c.begin, c.size(), dx.template data<T>(), rows, vocab_parallel->rank * rows, d,
                                 g);
  }
  // y[n][d] += a[n][k] W[d][k]^T (+ bias b) (+ the LoRA adapter of W). Row-parallel (tp non-null): W holds this
  // rank's k columns, so the product is summed over the group (one all-reduce) before the replicated bias is added.
  void RowParallelAdd(const OpTable<T>& ops, const TensorParallel* tp, const T* a, int64_t n, int64_t k, int64_t d,
                      int w, int b, Chunk c, const StateOptions& st, T* y) {
    if (!tp) {
      GemmW(ops, true, n, d, k, T(1), a, k, w, k, T(1), y, d);
      if (b >= 0) ops.add_bias(y, W(b), n, d);
      LoraAdd(ops, w, a, c, st, y, d);
      return;
    }
    Tensor part = New(MemCategory::kWorkspace, {n, d});
    GemmW(ops, true, n, d, k, T(1), a, k, w, k, T(0), part.template data<T>(), d);
    LoraAdd(ops, w, a, c, st, part.template data<T>(), d);
    tp->AllReduce(part.raw(), n * d, kDType);
    ops.add_inplace(y, part.template data<T>(), n * d);
    if (b >= 0) ops.add_bias(y, W(b), n, d);
  }

  // A whole adapter on one linear op: y[n][out] += its output for input x over chunk c (no-op without an adapter);
  // backward (recomputing from x): dA, dB accumulated and dx[n][in] += its input gradient.
  void LoraAdd(const OpTable<T>& ops, int w, const T* x, Chunk c, const StateOptions& st, T* y, int64_t out) {
    LoraAct a = LoraIn(ops, w, x, c, st);
    LoraOut(ops, a, 0, out, y, out);
  }
  void LoraBackward(const OpTable<T>& ops, int w, const T* x, const T* dy, int64_t out, T* dx, Chunk c,
                    const StateOptions& st) {
    LoraAct a = LoraIn(ops, w, x, c, st);
    if (!a.ad) return;
    LoraOutBackward(ops, a, 0, out, dy, out);
    LoraInBackward(ops, a, dx, c, st);
  }

  MemoryTracker mem_;
  DType weight_dtype_ = kDType;
  std::vector<Param> params_;
  int64_t lm_chunk_ = 256;
  std::map<int, Tensor> scratch_;  // frozen parameters' gradient sinks, on the model's device
  bool frozen_base_ = false;
  std::unique_ptr<LoraInfo> lora_;
  std::vector<int> adapter_of_;  // per parameter: the index of the adapter whose base weight it is, or -1
  // Per adapter of an expert weight: position (e out + o) r + k of the [E][out][r] gather holds lora_B's element
  // (o r + k) E + e (column k E + e of row o); undefined for a linear weight's.
  std::vector<Tensor> expert_b_order_;
  Tensor ExpertBOrder(const LoraAdapter& ad, int64_t r) {
    const int64_t E = ad.experts, out = ad.out;
    std::vector<int32_t> order(E * out * r);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t k = 0; k < r; ++k) order[(e * out + o) * r + k] = static_cast<int32_t>((o * r + k) * E + e);
    Tensor t = Tensor::Empty(&mem_, MemCategory::kWeights, DType::kI32, {E * out * r});
    CopyFromHost(t, order.data());
    return t;
  }
  // The --lora_targets name of a linear weight ("<module>.weight": the module's name) or of an expert weight
  // ("<...>.experts.gate_up_proj": its last two components).
  std::string LoraTargetOf(int w, bool expert) const {
    const std::string& name = params_[w].name;
    if (expert) return LoraParameterTarget(name);
    const std::string module = name.substr(0, name.size() - 7);
    return module.substr(module.rfind('.') + 1);
  }
  // t = x A^T [n][r] of an act whose input and factors are set.
  void LoraProject(const OpTable<T>& ops, LoraAct& a) {
    const int64_t r = lora_->options.rank, in = a.ad->in;
    a.t = New(MemCategory::kWorkspace, {a.n, r});
    ops.gemm(false, true, a.n, r, in, T(1), a.x, in, a.a_w, in, T(0), a.t.template data<T>(), r);
  }
  // Tensor parallelism, per adapter: the whole input's column of its first input column (a row-parallel weight's
  // input is split). Dropout masks are drawn per whole-input column, so every rank drops what one process would.
  std::vector<int64_t> lora_col0_;  // empty: 0 for every adapter
  int64_t LoraColumn0(int w) const { return lora_col0_.empty() ? 0 : lora_col0_[adapter_of_[w]]; }
};

}  // namespace sg
