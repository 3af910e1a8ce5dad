#include "distributed/tensor_parallel.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"

namespace sg::dist {

absl::Status CheckSameTp(Communicator& world, int tp) {
  const int n = world.size();
  std::vector<int64_t> all(n);
  const int64_t mine = tp;
  if (absl::Status s = world.AllGather(&mine, all.data(), 1, DType::kI64); !s.ok())
    return absl::Status(s.code(), absl::StrCat("--tp: agreeing on the tensor-parallel size: ", s.message()));
  for (int r = 1; r < n; ++r) {
    if (all[r] == all[0]) continue;
    std::string each;
    for (int q = 0; q < n; ++q) absl::StrAppend(&each, q ? ", " : "", "rank ", q, ": ", all[q]);
    return absl::FailedPreconditionError(absl::StrCat("--tp differs across ranks (", each, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorParallelGrid> CreateTensorParallelGrid(Communicator& world, int tp) {
  if (absl::Status s = CheckSameTp(world, tp); !s.ok()) return s;
  const int n = world.size();
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp must be at least 1, got ", tp));
  if (n % tp != 0)
    return absl::InvalidArgumentError(absl::StrCat("--tp=", tp, ": the job has ", n, " ranks, which is not tp (", tp,
                                                   ") x a data-parallel size (", n, " % ", tp, " = ", n % tp, ")"));
  TensorParallelGrid g;
  absl::StatusOr<std::unique_ptr<Communicator>> t = world.Split(world.rank() / tp, world.rank());
  if (!t.ok()) return t.status();
  absl::StatusOr<std::unique_ptr<Communicator>> d = world.Split(world.rank() % tp, world.rank());
  if (!d.ok()) return d.status();
  g.tp = std::move(*t);
  g.dp = std::move(*d);
  return g;
}

namespace {
// The split model's parameters' shards, with its group.
struct Split {
  const TensorParallelModel* model;
  TensorParallel tp;
};
absl::StatusOr<Split> SplitOf(Trainer& split) {
  const auto* m = dynamic_cast<const TensorParallelModel*>(&split.model());
  if (!m) return absl::InvalidArgumentError("tensor parallel: the trainer's model cannot be split");
  return Split{m, m->tensor_parallel()};
}
// f(whole tensor, split tensor, shard) over the moments and masters both optimizers hold.
template <typename F>
absl::Status ForEachOptimizerTensor(Trainer& whole, Trainer& split, const Split& s, F f) {
  const std::vector<Param>& params = split.model().params();
  for (auto pick : {&AdamW::mutable_m, &AdamW::mutable_v, &AdamW::mutable_master}) {
    std::vector<Tensor>& w = (whole.optimizer().*pick)();
    std::vector<Tensor>& b = (split.optimizer().*pick)();
    for (size_t i = 0; i < params.size() && i < w.size() && i < b.size(); ++i) {
      if (!w[i].defined() || !b[i].defined()) continue;
      if (absl::Status st = f(w[i], b[i], s.model->ShardOf(static_cast<int>(i))); !st.ok())
        return absl::Status(st.code(), absl::StrCat("optimizer state of ", params[i].name, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Model>> SplitModel(Model& whole, const TensorParallel& tp,
                                                  std::optional<Device> device) {
  absl::StatusOr<std::unique_ptr<Model>> split = CreateModelLike(whole, device.value_or(whole.memory().device()), tp);
  if (!split.ok()) return split.status();
  if (absl::Status s = ScatterParams(whole, **split); !s.ok()) return s;
  return split;
}

absl::StatusOr<WholeTrainer> MakeWholeTrainer(Trainer& split, Device device) {
  WholeTrainer w;
  absl::StatusOr<std::unique_ptr<Model>> m = CreateModelLike(split.model(), device, {});
  if (!m.ok()) return m.status();
  w.model = std::move(*m);
  w.trainer = std::make_unique<Trainer>(*w.model, split.strategy(), split.optimizer_options(), split.objective());
  w.trainer->set_num_threads(split.num_threads());
  return w;
}

absl::Status ScatterTrainer(Trainer& whole, Trainer& split) {
  absl::StatusOr<Split> s = SplitOf(split);
  if (!s.ok()) return s.status();
  if (absl::Status st = ScatterParams(whole.model(), split.model()); !st.ok()) return st;
  split.set_state(whole.state());
  if (!whole.optimizer().has_moments()) return absl::OkStatus();
  if (absl::Status st = split.optimizer().EnsureMoments(split.model()); !st.ok()) return st;
  return ForEachOptimizerTensor(whole, split, *s,
                                [&](Tensor& w, Tensor& b, TpShard shard) { return SliceTensor(w, shard, s->tp, b); });
}

absl::Status GatherTrainer(Trainer& split, Trainer& whole) {
  absl::StatusOr<Split> s = SplitOf(split);
  if (!s.ok()) return s.status();
  if (absl::Status st = GatherParams(split.model(), whole.model()); !st.ok()) return st;
  whole.set_state(split.state());
  if (!split.optimizer().has_moments()) return absl::OkStatus();
  if (absl::Status st = whole.optimizer().EnsureMoments(whole.model()); !st.ok()) return st;
  return ForEachOptimizerTensor(whole, split, *s,
                                [&](Tensor& w, Tensor& b, TpShard shard) { return GatherTensor(b, shard, s->tp, w); });
}

absl::StatusOr<WholeTrainer> GatherWholeTrainer(Trainer& split) {
  absl::StatusOr<WholeTrainer> whole = MakeWholeTrainer(split, Device::kCPU);
  if (!whole.ok()) return whole.status();
  if (absl::Status s = GatherTrainer(split, *whole->trainer); !s.ok()) return s;
  return whole;
}

absl::Status TensorParallelRun::ScatterFrom(Model& whole) {
  split->memory().set_limit(whole.memory().limit());
  return ScatterParams(whole, *split);
}

absl::Status TensorParallelRun::GatherInto(Model& whole, bool grads, bool values) {
  if (grads)
    if (absl::Status s = GatherGrads(*split, whole); !s.ok()) return s;
  if (values) return GatherParams(*split, whole);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TensorParallelRun>> JoinTensorParallel(std::unique_ptr<Communicator> world, Model& whole,
                                                                      int tp, const absl::Status& precheck) {
  auto run = std::make_unique<TensorParallelRun>();
  run->world = std::move(world);
  absl::StatusOr<TensorParallelGrid> grid = CreateTensorParallelGrid(*run->world, tp);
  if (!grid.ok()) return grid.status();  // the same verdict on every rank
  run->grid = std::move(*grid);
  absl::Status local = precheck;
  if (local.ok()) {
    absl::StatusOr<std::unique_ptr<Model>> split = SplitModel(whole, run->grid.layers());
    if (split.ok())
      run->split = std::move(*split);
    else if (absl::StartsWith(split.status().message(), "--tp"))
      local = split.status();
    else
      local = absl::Status(split.status().code(), absl::StrCat("--tp=", tp, ": ", split.status().message()));
  }
  if (absl::Status s = AgreeAcrossRanks(*run->world, local); !s.ok()) return s;
  return run;
}

absl::Status CheckSameRun(TensorParallelRun& run, Trainer& split) {
  // The whole model's configuration (a meta twin), as checkpoints record it.
  absl::StatusOr<WholeTrainer> meta = MakeWholeTrainer(split, Device::kMeta);
  absl::Status local = meta.status();
  RunConfig config;
  if (meta.ok()) {
    config = TrainerRunConfig(*meta->trainer);
    config.erase(absl::StrCat(kRuntimePrefix, "threads"));  // ranks may use different thread counts
  }
  if (absl::Status s = AgreeAcrossRanks(*run.world, local); !s.ok()) return s;
  if (absl::Status s = CheckSameConfig(*run.world, config); !s.ok()) return s;
  if (run.grid.dp->size() > 1) run.data_parallel = std::make_unique<DataParallel>(split, *run.grid.dp);
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> ComputeGradients(Trainer& trainer, TensorParallelRun* run, const Batch& batch,
                                             bool accumulate) {
  if (!run || !run->data_parallel)
    return accumulate ? trainer.AccumulateGradients(batch) : trainer.ComputeGradients(batch);
  if (accumulate)
    return absl::UnimplementedError(absl::StrCat(
        "accumulating micro-batches across ", run->grid.dp->size(),
        " tensor-parallel groups: pass the whole batch to compute_gradients / step (each group takes its share)"));
  uint64_t first = 0;
  const Batch shard = ShardOf(batch, run->grid.dp->rank(), run->grid.dp->size(), &first);
  return run->data_parallel->ComputeGradients(shard, first);
}

}  // namespace sg::dist
