#include "distributed/layer_sharded.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/lr_schedule.h"

namespace sg::dist {

namespace {

constexpr int kForwardTag = 0;   // boundary activations, rank r -> r + 1
constexpr int kBackwardTag = 1;  // cotangents dx, rank r + 1 -> r
constexpr int kTiedTag = 2;      // the head's part of a tied embedding's gradient, last rank -> rank 0

// The layer index of a parameter named "....layers.N....", or -1.
int LayerOfName(const std::string& name) {
  const size_t at = name.find("layers.");
  if (at == std::string::npos) return -1;
  const size_t begin = at + 7, end = name.find('.', begin);
  int layer = -1;
  if (!absl::SimpleAtoi(name.substr(begin, end == std::string::npos ? std::string::npos : end - begin), &layer))
    return -1;
  return layer;
}

}  // namespace

absl::StatusOr<LayerBlock> LayerBlockOf(int layers, int rank, int size) {
  if (size > layers)
    return absl::InvalidArgumentError(absl::StrCat("layer sharding: world size ", size, " exceeds the model's ",
                                                   layers, " layers (every rank must own at least one layer)"));
  if (rank < 0 || rank >= size)
    return absl::InvalidArgumentError(absl::StrCat("layer sharding: rank ", rank, " not in [0, ", size, ")"));
  const int64_t L = layers;
  return LayerBlock{static_cast<int>(L * rank / size), static_cast<int>(L * (rank + 1) / size)};
}

LayerShardedAdjoint::LayerShardedAdjoint(Model& model, StrategyOptions strategy, OptimizerOptions optimizer,
                                         Communicator& comm)
    : model_(model), strategy_(std::move(strategy)), opt_(std::move(optimizer)), comm_(comm) {
  const int W = comm_.size(), L = model_.num_layers();
  if (strategy_.name != "adjoint") {
    valid_ = absl::InvalidArgumentError(
        absl::StrCat("layer sharding runs the adjoint strategy only, not '", strategy_.name, "'"));
  } else if (strategy_.adjoint_form == "paper") {
    valid_ = absl::InvalidArgumentError(
        "layer sharding needs exact per-layer cotangents: --adjoint_form=paper is not supported (use pairs or scan)");
  } else {
    valid_ = ValidateStrategyForModel(strategy_, model_);
  }
  if (valid_.ok()) {
    absl::StatusOr<LayerBlock> b = LayerBlockOf(L, comm_.rank(), W);
    if (!b.ok()) valid_ = b.status();
    else block_ = *b;
  }
  std::vector<Param>& params = model_.params();
  owner_.assign(params.size(), W - 1);
  tied_ = true;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].name;
    if (absl::StrContains(name, "lm_head")) tied_ = false;
    const int layer = LayerOfName(name);
    if (layer >= 0 && layer < L) {
      // the smallest r with floor(L (r+1) / W) > layer
      int r = 0;
      while (static_cast<int64_t>(L) * (r + 1) / W <= layer) ++r;
      owner_[i] = std::min(r, W - 1);
    } else if (absl::StrContains(name, "embed")) {
      owner_[i] = 0;
      if (embed_index_ < 0) embed_index_ = static_cast<int>(i);
    }
  }
  if (embed_index_ < 0) tied_ = false;
}

absl::Status LayerShardedAdjoint::Validate() const { return valid_; }

absl::Status LayerShardedAdjoint::Sequence1(const Sequence& s, double grad_scale, uint64_t seed, StepMetrics& m) {
  Model& md = model_;
  const StrategyOptions& o = strategy_;
  const int rank = comm_.rank(), W = comm_.size();
  const bool first = rank == 0, last = rank == W - 1;
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const std::vector<Chunk> chunks = SplitIntoChunks(T, o.chunk);
  const int L = md.num_layers();
  StateOptions so{T, o.page_size, /*resident_layers=*/L, /*resident_grad_layers=*/L};
  so.adjoint_window = o.adjoint_form == "scan" ? 0 : std::min(o.adjoint_window, T);
  std::unique_ptr<SequenceState> state = md.NewState(so.Training(seed));
  md.set_lm_chunk(o.lm_chunk);
  const int64_t H = md.hidden_size();

  auto receive = [&](Chunk c, int peer, int tag, Tensor* out) -> absl::Status {
    *out = Tensor::Empty(&md.memory(), MemCategory::kActivations, md.dtype(), {c.size(), H});
    // The communicators take host memory (a device's tensors through host copies).
    return FillFromHost(*out, [&](void* d) { return comm_.Recv(d, out->numel(), md.dtype(), peer, tag); });
  };
  auto send = [&](const Tensor& t, int peer, int tag) {
    return WithHostBytes(t, /*write_back=*/false, [&](void* d) { return comm_.Send(d, t.numel(), md.dtype(), peer, tag); });
  };

  // Stage 1: every chunk but the last, forward through the pipeline, keeping only state.
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    ThrowIfCancelled(o);
    const Chunk c = chunks[i];
    Tensor x;
    if (first) x = md.Embed(s.ids.data(), c);
    else if (absl::Status st = receive(c, rank - 1, kForwardTag, &x); !st.ok()) return st;
    for (int l = block_.begin; l < block_.end; ++l) {
      if (last && l == L - 1) md.LayerAppendState(l, c, x, *state);
      else x = md.LayerForward(l, c, x, *state, /*saved=*/nullptr);
    }
    if (!last)
      if (absl::Status st = send(x, rank + 1, kForwardTag); !st.ok()) return st;
  }

  // Stage 2: chunks in reverse, recompute with saved activations, then cotangents flow back down the ranks.
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
    ThrowIfCancelled(o);
    const Chunk c = *it;
    std::vector<LayerSaved> saved(block_.end - block_.begin);
    Tensor x;
    if (first) x = md.Embed(s.ids.data(), c);
    else if (absl::Status st = receive(c, rank - 1, kForwardTag, &x); !st.ok()) return st;
    for (int l = block_.begin; l < block_.end; ++l) x = md.LayerForward(l, c, x, *state, &saved[l - block_.begin]);
    Tensor dx;
    if (last) {
      HeadResult head = md.HeadLoss(c, x, s.labels.data(), s.objective.get(), grad_scale, /*need_grad=*/true);
      m.loss += head.loss_sum;
      m.tokens += head.tokens;
      dx = std::move(head.dh);
    } else {
      if (absl::Status st = send(x, rank + 1, kForwardTag); !st.ok()) return st;
      if (absl::Status st = receive(c, rank + 1, kBackwardTag, &dx); !st.ok()) return st;
    }
    x.Reset();
    for (int l = block_.end - 1; l >= block_.begin; --l) {
      dx = md.LayerBackward(l, c, dx, saved[l - block_.begin], *state);
      saved[l - block_.begin].Clear();
    }
    if (first) md.EmbedBackward(s.ids.data(), c, dx);
    else if (absl::Status st = send(dx, rank - 1, kBackwardTag); !st.ok()) return st;
    for (int l = block_.begin; l < block_.end; ++l) state->Release(l, c.begin);
  }
  m.chunks += static_cast<int64_t>(chunks.size());
  m.chunks_backpropagated += static_cast<int64_t>(chunks.size());
  m.adjoint_pairs += state->AdjointPairs();
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> LayerShardedAdjoint::ComputeGradients(const std::vector<Sequence>& batch) {
  if (!valid_.ok()) return valid_;
  // Validation first, identical on every rank (every rank holds the whole batch), before any communication.
  if (batch.empty()) return absl::InvalidArgumentError("batch is empty");
  int64_t valid = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Sequence& s = batch[i];
    if (s.ids.empty() || s.labels.size() != s.ids.size())
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": ", s.ids.size(), " ids and ",
                                                     s.labels.size(), " labels (need the same, at least one)"));
    for (size_t t = 0; t < s.ids.size(); ++t)
      if (s.ids[t] < 0 || s.ids[t] >= model_.vocab_size() || s.labels[t] >= model_.vocab_size())
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " position ", t, ": id ", s.ids[t],
                                                       " or label ", s.labels[t], " outside the vocabulary of ",
                                                       model_.vocab_size()));
    for (int32_t l : s.labels) valid += l >= 0;
  }
  if (valid == 0) return absl::InvalidArgumentError("batch has no valid labels (all are -100): the loss is undefined");

  const int64_t bytes_before = comm_.bytes_communicated();
  ZeroGrads(model_);
  StepMetrics m;
  const uint64_t call = calls_++;
  absl::Status status;
  try {
    for (size_t i = 0; i < batch.size() && status.ok(); ++i)
      status = Sequence1(batch[i], 1.0 / static_cast<double>(valid), SequenceSeed(strategy_.seed, call, i), m);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("rank ", comm_.rank(), ": layer-sharded adjoint: ", e.what()));
  }
  if (!status.ok()) return status;

  // Tied embeddings: the head's part of the gradient (last rank) joins the embedding's (rank 0).
  std::vector<Param>& params = model_.params();
  if (tied_ && comm_.size() > 1 && params[embed_index_].grad.defined()) {
    Tensor& g = params[embed_index_].grad;
    if (comm_.rank() == comm_.size() - 1) {
      if (absl::Status st = WithHostBytes(g, /*write_back=*/false,
                                          [&](void* d) { return comm_.Send(d, g.numel(), g.dtype(), 0, kTiedTag); });
          !st.ok())
        return st;
      g.SetZero();  // not owned here
    } else if (comm_.rank() == 0) {
      Tensor head = Tensor::Empty(&model_.memory(), MemCategory::kWorkspace, g.dtype(), g.shape());
      if (absl::Status st = FillFromHost(
              head, [&](void* d) { return comm_.Recv(d, head.numel(), g.dtype(), comm_.size() - 1, kTiedTag); });
          !st.ok())
        return st;
      std::vector<std::vector<char>> head_copy;
      const void* h = HostBytes(head, &head_copy);
      if (absl::Status st = WithHostBytes(g, /*write_back=*/true, [&](void* d) {
            for (int64_t k = 0; k < g.numel(); ++k) {
              if (g.dtype() == DType::kF64) static_cast<double*>(d)[k] += static_cast<const double*>(h)[k];
              else static_cast<float*>(d)[k] += static_cast<const float*>(h)[k];
            }
            return absl::OkStatus();
          });
          !st.ok())
        return st;
    }
  }

  // The loss lives on the last rank, the adjoint pairs on every rank: one small all-reduce.
  std::vector<double> sums = {m.loss, static_cast<double>(m.tokens), static_cast<double>(m.adjoint_pairs)};
  if (absl::Status st = comm_.AllReduce(sums); !st.ok()) return st;
  m.loss = sums[0] / static_cast<double>(valid);
  m.tokens = static_cast<int64_t>(sums[1]);
  m.adjoint_pairs = static_cast<int64_t>(sums[2]);
  if (!std::isfinite(m.loss)) return absl::InternalError(absl::StrCat("loss is ", m.loss));
  bytes_last_step_ = comm_.bytes_communicated() - bytes_before;
  return m;
}

absl::Status LayerShardedAdjoint::OptimizerStep(StepMetrics* metrics) {
  if (absl::Status s = ValidateOptimizerOptions(opt_); !s.ok()) return s;
  std::vector<Param>& params = model_.params();
  const int rank = comm_.rank();
  // Gradients of parameters not owned here are zero, so the local squared norm is the owned part.
  absl::StatusOr<double> sq = GradSquaredNorm(model_, absl::StrCat("at step ", adam_.step() + 1, " on rank ", rank));
  if (!sq.ok()) return sq.status();
  std::vector<double> total = {*sq};
  if (absl::Status s = comm_.AllReduce(total); !s.ok()) return s;
  const double norm = std::sqrt(total[0]);
  if (metrics) metrics->grad_norm = norm;
  if (opt_.clip_grad_norm > 0 && norm > opt_.clip_grad_norm) ScaleGrads(model_, opt_.clip_grad_norm / norm);
  const double lr = ScheduledLr(opt_, adam_.step() + 1);
  if (metrics) metrics->lr = lr;
  // AdamW over the owned parameters only: the others' gradients are hidden during the step (no moments for them).
  std::vector<Tensor> hidden(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    if (owner_[i] != rank) std::swap(hidden[i], params[i].grad);
  absl::Status stepped = adam_.Step(model_, opt_, lr);
  for (size_t i = 0; i < params.size(); ++i)
    if (owner_[i] != rank) std::swap(hidden[i], params[i].grad);
  if (!stepped.ok()) return stepped;
  // Every rank gets every updated parameter from its owner.
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad.defined()) continue;  // frozen: unchanged everywhere
    Tensor& v = params[i].value;
    if (absl::Status s = WithHostBytes(v, /*write_back=*/true,
                                       [&](void* d) { return comm_.Broadcast(d, v.numel(), v.dtype(), owner_[i]); });
        !s.ok())
      return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> LayerShardedAdjoint::Step(const std::vector<Sequence>& batch) {
  absl::StatusOr<StepMetrics> m = ComputeGradients(batch);
  if (!m.ok()) return m.status();
  const int64_t bytes = bytes_last_step_, before = comm_.bytes_communicated();
  if (absl::Status s = OptimizerStep(&*m); !s.ok()) return s;
  bytes_last_step_ = bytes + comm_.bytes_communicated() - before;
  return m;
}

}  // namespace sg::dist
