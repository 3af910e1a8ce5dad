#include "distributed/data_parallel.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"
#include "core/lr_schedule.h"
#include "core/optimizer.h"
#include "core/tensor_parallel.h"

namespace sg::dist {

namespace {
template <typename V>
V Slice(const V& v, int rank, int size) {
  const size_t n = v.size();
  const size_t begin = n * rank / size, end = n * (rank + 1) / size;
  return V(v.begin() + begin, v.begin() + end);
}

bool IsEmpty(const Batch& b) { return b.sequences.empty() && b.pairs.empty() && b.groups.empty(); }

// Agrees on failure: every rank contributes `local` (OK or its error); when any rank failed, every rank returns an
// error naming the lowest failed rank (its own message on that rank).
absl::Status Agree(Communicator& comm, const absl::Status& local, const std::string& what) {
  absl::StatusOr<int> failed = FirstFailedRank(comm, !local.ok());
  if (!failed.ok()) return failed.status();
  if (*failed == comm.size()) return absl::OkStatus();
  if (!local.ok())
    return absl::Status(local.code(), absl::StrCat("rank ", comm.rank(), ": ", what, ": ", local.message()));
  return absl::AbortedError(absl::StrCat("rank ", comm.rank(), ": ", what, " failed on rank ", *failed,
                                         " (see its error); every rank stops"));
}
}  // namespace

Batch ShardOf(const Batch& whole, int rank, int size, uint64_t* first_index) {
  Batch shard;
  shard.sequences = Slice(whole.sequences, rank, size);
  shard.pairs = Slice(whole.pairs, rank, size);
  shard.groups = Slice(whole.groups, rank, size);
  if (first_index) {
    uint64_t index = whole.sequences.size() * rank / size + 2 * (whole.pairs.size() * rank / size);
    for (size_t g = 0; g < whole.groups.size() * rank / size; ++g) index += whole.groups[g].completions.size();
    *first_index = index;
  }
  return shard;
}

absl::Status DataParallel::CheckConfig() { return CheckSameConfig(comm_, TrainerRunConfig(trainer_)); }

absl::StatusOr<StepMetrics> DataParallel::ComputeGradients(const Batch& shard, uint64_t first_index) {
  const int64_t bytes_before = comm_.bytes_communicated();
  // 1. The whole batch's count of units.
  int64_t units = 0;
  absl::Status local = absl::OkStatus();
  if (!IsEmpty(shard)) {
    absl::StatusOr<int64_t> n = trainer_.CountUnits(shard);
    if (n.ok()) units = *n;
    else local = n.status();
  }
  if (absl::Status s = Agree(comm_, local, "validating the shard"); !s.ok()) return s;
  std::vector<int64_t> total = {units};
  if (absl::Status s = comm_.AllReduce(total); !s.ok()) return s;
  if (total[0] <= 0)
    return absl::InvalidArgumentError("the batch has nothing to normalise by over all ranks (no valid labels, "
                                      "pairs or groups)");
  // 2. This rank's share of the gradients: d(shard's sum)/d(params) / total.
  StepMetrics m;
  m.tokens = 0;
  m.chunks = 0;
  m.chunks_backpropagated = 0;
  if (IsEmpty(shard)) {
    ZeroGrads(trainer_.model());
    // Keep the sampling stream in step with the ranks that ran a gradient pass.
    const TrainerState st = trainer_.state();
    trainer_.set_state({st.step, st.sampling_calls + 1});
  } else {
    absl::StatusOr<StepMetrics> r = trainer_.ComputeShardGradients(shard, static_cast<double>(total[0]), first_index);
    if (r.ok()) m = *r;
    else local = r.status();
  }
  if (absl::Status s = Agree(comm_, local, "computing the shard's gradients"); !s.ok()) return s;
  // 3. Sum metrics and gradients over ranks (one all-reduce per parameter).
  std::vector<double> sums = {m.loss, static_cast<double>(m.tokens), static_cast<double>(m.chunks),
                              static_cast<double>(m.chunks_backpropagated), static_cast<double>(m.adjoint_pairs)};
  if (absl::Status s = comm_.AllReduce(sums); !s.ok()) return s;
  m.loss = sums[0];
  m.tokens = static_cast<int64_t>(std::llround(sums[1]));
  m.chunks = static_cast<int64_t>(std::llround(sums[2]));
  m.chunks_backpropagated = static_cast<int64_t>(std::llround(sums[3]));
  m.adjoint_pairs = static_cast<int64_t>(std::llround(sums[4]));
  m.micro_batches = 1;
  for (Param& p : trainer_.model().params()) {
    if (!p.grad.defined()) continue;
    if (absl::Status s = WithHostBytes(p.grad, /*write_back=*/true,  // the communicators take host memory
                                       [&](void* g) { return comm_.AllReduce(g, p.grad.numel(), p.grad.dtype(), ReduceOp::kSum); });
        !s.ok())
      return absl::Status(s.code(), absl::StrCat("all-reducing the gradient of ", p.name, ": ", s.message()));
  }
  bytes_last_step_ = comm_.bytes_communicated() - bytes_before;
  return m;
}

absl::StatusOr<StepMetrics> DataParallel::Step(const Batch& shard, uint64_t first_index) {
  absl::StatusOr<StepMetrics> m = ComputeGradients(shard, first_index);
  if (!m.ok()) return m;
  // Identical gradients on every rank: the step (NaN check, clipping, AdamW) is identical too.
  if (absl::Status s = shard_optimizer_ ? ShardedOptimizerStep(&*m) : trainer_.OptimizerStep(&*m); !s.ok()) return s;
  return m;
}

std::vector<int> DataParallel::OptimizerOwners() {
  std::vector<Param>& params = trainer_.model().params();
  std::vector<int> owner(params.size(), -1);
  double total = 0;
  for (const Param& p : params)
    if (p.grad.defined()) total += static_cast<double>(p.value.numel());
  double before = 0;
  const int W = comm_.size();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad.defined()) continue;
    const double n = static_cast<double>(params[i].value.numel());
    owner[i] = std::min(W - 1, static_cast<int>(W * (before + n / 2) / total));
    before += n;
  }
  return owner;
}

absl::Status DataParallel::ShardedOptimizerStep(StepMetrics* metrics) {
  const OptimizerOptions& opt = trainer_.optimizer_options();
  if (absl::Status s = ValidateOptimizerOptions(opt); !s.ok()) return s;
  Model& model = trainer_.model();
  // The gradients are already the same on every rank: so are the norm and the clipping.
  absl::StatusOr<double> sq = TensorParallelGradSquaredNorm(model, absl::StrCat("at step ", trainer_.step() + 1));
  if (!sq.ok()) return sq.status();
  const double norm = std::sqrt(*sq);
  if (metrics) metrics->grad_norm = norm;
  if (opt.clip_grad_norm > 0 && norm > opt.clip_grad_norm) ScaleGrads(model, opt.clip_grad_norm / norm);
  const double lr = ScheduledLr(opt, trainer_.step() + 1);
  if (metrics) metrics->lr = lr;
  const std::vector<int> owner = OptimizerOwners();
  std::vector<Param>& params = model.params();
  // AdamW over this rank's parameters only: the others' gradients are hidden during the step (no moments for them).
  std::vector<Tensor> hidden(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    if (owner[i] >= 0 && owner[i] != comm_.rank()) std::swap(hidden[i], params[i].grad);
  absl::Status stepped = trainer_.optimizer().Step(model, opt, lr);
  for (size_t i = 0; i < params.size(); ++i)
    if (owner[i] >= 0 && owner[i] != comm_.rank()) std::swap(hidden[i], params[i].grad);
  if (absl::Status s = Agree(comm_, stepped, "the sharded optimizer step"); !s.ok()) return s;
  for (size_t i = 0; i < params.size(); ++i) {
    if (owner[i] < 0) continue;
    Tensor& v = params[i].value;
    if (absl::Status s = WithHostBytes(v, /*write_back=*/true,
                                       [&](void* d) { return comm_.Broadcast(d, v.numel(), v.dtype(), owner[i]); });
        !s.ok())
      return absl::Status(s.code(), absl::StrCat("broadcasting ", params[i].name, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace sg::dist
