#include "core/plan.h"

#include <sys/stat.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/checked.h"
#include "core/data.h"
#include "core/io/config_fields.h"
#include "core/models/family.h"
#include "core/tensor_parallel.h"
#include "core/trainer.h"

namespace sg {
namespace {

// A model of `spec` on device; on the CPU with random weights, on meta with none. With LoRA to come (lora.rank > 0)
// the base is created frozen, as the tools create it: no gradient for it is ever allocated.
absl::StatusOr<std::unique_ptr<Model>> Create(const ModelSpec& spec, DType dtype, Device device, uint64_t seed,
                                              const std::string& what, const LoraOptions& lora) {
  if (absl::StatusOr<ModelFootprint> f = spec.Footprint(dtype); !f.ok())
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", f.status().message()));
  absl::StatusOr<std::unique_ptr<Model>> m = spec.Create(dtype, device, {}, /*frozen_base=*/lora.rank > 0);
  if (!m.ok()) return m.status();
  if (device != Device::kMeta) spec.InitRandom(**m, seed);
  return m;
}

absl::StatusOr<std::unique_ptr<Model>> WithLora(absl::StatusOr<std::unique_ptr<Model>> m, const LoraOptions& lora) {
  if (!m.ok() || lora.rank <= 0) return m;
  if (absl::Status s = EnableLora(**m, lora); !s.ok()) return s;
  return m;
}

// Token ids and labels of a synthetic sequence: only their count matters to memory (and, packed as documents of
// doc_len tokens when doc_len > 0, where attention's pieces start).
Sequence Synthetic(int64_t n, int64_t vocab, int64_t doc_len = 0) {
  Sequence s;
  s.ids.resize(n);
  s.labels.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    s.ids[i] = static_cast<int32_t>(i % vocab);
    s.labels[i] = static_cast<int32_t>((i + 1) % vocab);
  }
  s.last_token = static_cast<int32_t>(n % vocab);
  if (doc_len > 0) (void)SetDocumentsOfLength(s, doc_len, "plan");  // always valid for doc_len >= 1
  return s;
}

Batch SyntheticBatch(const ObjectiveOptions& o, int64_t n, int64_t vocab, int64_t doc_len) {
  Batch b;
  if (o.name == "dpo") {
    DpoPair p;
    p.chosen = Synthetic(n, vocab);
    p.rejected = Synthetic(n, vocab);
    p.ref_chosen_logp = p.ref_rejected_logp = 0;
    b.pairs.push_back(std::move(p));
  } else if (o.name == "grpo") {
    GrpoGroup g;
    for (double advantage : {1.0, -1.0}) {
      GrpoCompletion c;
      c.seq = Synthetic(n, vocab);
      c.advantage = advantage;
      if (o.grpo_kl_beta > 0) c.ref_logprobs.assign(n, 0.0);
      g.completions.push_back(std::move(c));
    }
    b.groups.push_back(std::move(g));
  } else {
    b.sequences.push_back(Synthetic(n, vocab, doc_len));
  }
  return b;
}

// Host bytes the synthetic batch takes (ids, labels, reference log-probs): 24 per token and sequence at most.
constexpr int64_t kHostBytesPerToken = 3 * 24;

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreatePlanModel(const std::string& spec, DType dtype, Device device,
                                                       const LoraOptions& lora, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<ModelSpec>> preset = PresetSpec(spec);
  if (preset.ok()) return WithLora(Create(**preset, dtype, device, seed, spec, lora), lora);
  struct stat st;
  if (stat(spec.c_str(), &st) != 0) return preset.status();  // names the presets
  absl::StatusOr<std::pair<std::string, std::string>> text = io::ReadConfigJson(spec);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::unique_ptr<ModelSpec>> config = ParseConfigSpec(text->first, text->second);
  if (!config.ok()) return config.status();
  return WithLora(Create(**config, dtype, device, seed, text->second, lora), lora);
}

absl::StatusOr<std::unique_ptr<Model>> MetaTwin(Model& model) {
  LoraOptions lora;
  if (model.lora()) lora = model.lora()->options;
  const DType dtype = CreatedDType(model);
  if (const TensorParallelModel* tp = TensorParallelOf(model))  // one rank of a split model: its blocks, LoRA too
    return CreateModelLike(model, Device::kMeta, {tp->tensor_parallel().rank, tp->tensor_parallel().size, nullptr});
  return WithLora(Create(*model.spec(), dtype, Device::kMeta, 0, "model", lora), lora);
}

absl::StatusOr<MemoryPlan> PlanStep(Model& model, const StrategyOptions& strategy, const ObjectiveOptions& objective,
                                    int64_t seq_len, int64_t limit, int64_t doc_len) {
  if (doc_len < 0) return absl::InvalidArgumentError(absl::StrCat("--doc_len must be >= 0, got ", doc_len));
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  // Byte counts that overflow int64 are refused before anything is allocated: the KV cache (or scan states) of
  // every layer, and the host's synthetic tokens.
  int64_t state_bytes = 0, host_bytes = 0;
  if (!CheckedMul(seq_len, model.StateBytesPerToken(), &state_bytes) || !CheckedMul(state_bytes, 2, &state_bytes) ||
      !CheckedMul(seq_len, std::max<int64_t>(model.hidden_size(), model.vocab_size()), &host_bytes) ||
      !CheckedMul(host_bytes, 64, &host_bytes))
    return absl::InvalidArgumentError(absl::StrCat("--seq_len=", seq_len,
                                                   ": the plan's byte counts overflow 64 bits (the state of ", seq_len,
                                                   " tokens over ", model.num_layers(), " layers alone)"));
  const int64_t host_available = HostAvailableBytes();
  int64_t token_bytes = 0;
  if (!CheckedMul(seq_len, kHostBytesPerToken, &token_bytes) || (host_available >= 0 && token_bytes > host_available))
    return absl::ResourceExhaustedError(absl::StrCat("--seq_len=", seq_len, ": the plan's synthetic tokens need ",
                                                     seq_len, " x ", kHostBytesPerToken, " bytes of host memory, ",
                                                     host_available, " available"));
  MemoryTracker& mem = model.memory();
  const int64_t previous_limit = mem.limit();
  MemoryPlan plan;
  plan.seq_len = seq_len;
  absl::StatusOr<StepMetrics> m;
  {
    const Batch batch = SyntheticBatch(objective, seq_len, model.vocab_size(), doc_len);
    OptimizerOptions opt;
    opt.lr = 1e-30;  // the step's values do not matter (CPU plans keep their weights near where they were)
    Trainer trainer(model, strategy, opt, objective);
    mem.ResetPeak();
    mem.set_limit(limit);
    // A run's steps after its first hold the optimizer moments through the gradient pass: plan that step.
    if (absl::Status st = trainer.optimizer().EnsureMoments(model); !st.ok())
      m = st;
    else
      m = trainer.Step(batch);
  }  // the trainer's optimizer moments are freed here, as a run's are at its end
  mem.set_limit(previous_limit);
  plan.device = mem.Snapshot();
  mem.ResetPeak();
  if (!m.ok()) return m.status();
  plan.host_bytes = m->offloaded_bytes;
  return plan;
}

absl::StatusOr<MemoryPlan> LongestFit(Model& model, const StrategyOptions& strategy, const ObjectiveOptions& objective,
                                      int64_t memory, int64_t max_seq_len) {
  if (memory <= 0) return absl::InvalidArgumentError(absl::StrCat("--memory must be positive bytes, got ", memory));
  // The shortest length the strategy accepts (spaco samples among at least spaco_budget chunks).
  const int64_t shortest = strategy.name == "spaco" ? strategy.chunk * strategy.spaco_budget : 1;
  // The plan at n under the memory as its limit (a plan that does not fit stops where it passes it); peak -1:
  // unknown (it did not fit, or n is too long to plan at all: overflow, the host's tokens).
  struct Probe {
    bool fits = false;
    int64_t peak = -1;
    MemoryPlan plan;
  };
  auto probe = [&](int64_t n) -> absl::StatusOr<Probe> {
    absl::StatusOr<MemoryPlan> p = PlanStep(model, strategy, objective, n, memory);
    if (p.ok()) return Probe{true, p->device.total_peak, *std::move(p)};
    const absl::StatusCode code = p.status().code();
    if (code == absl::StatusCode::kResourceExhausted || (n > shortest && code == absl::StatusCode::kInvalidArgument))
      return Probe{};
    return p.status();
  };
  absl::StatusOr<Probe> first = probe(shortest);
  if (!first.ok()) return first.status();
  if (!first->fits) {
    absl::StatusOr<MemoryPlan> need = PlanStep(model, strategy, objective, shortest);
    return absl::ResourceExhaustedError(absl::StrCat(
        "--memory=", memory, ": even ", shortest, " tokens do not fit (",
        need.ok() ? absl::StrCat(need->device.total_peak, " bytes needed") : std::string(need.status().message()),
        ")"));
  }
  // lo and before: the two longest that fit; hi: the shortest that does not (seq_len 0: none found yet).
  Probe lo = *std::move(first), before, hi;
  auto narrow = [&](int64_t n) -> absl::Status {
    absl::StatusOr<Probe> p = probe(n);
    if (!p.ok()) return p.status();
    p->plan.seq_len = n;
    if (p->fits) {
      before = std::move(lo);
      lo = *std::move(p);
    } else {
      hi = *std::move(p);
    }
    return absl::OkStatus();
  };
  while (hi.plan.seq_len == 0 && lo.plan.seq_len < max_seq_len) {
    const int64_t n = lo.plan.seq_len > max_seq_len / 2 ? max_seq_len : 2 * lo.plan.seq_len;
    if (absl::Status s = narrow(n); !s.ok()) return s;
  }
  // The peak grows about linearly with T: extrapolate from the two longest that fit, bisecting instead every other
  // step when that did not halve the bracket (the peak is a staircase at page and chunk boundaries), to one token.
  bool extrapolate = true;
  while (hi.plan.seq_len > 0 && hi.plan.seq_len - lo.plan.seq_len > 1) {
    const int64_t a = lo.plan.seq_len, b = hi.plan.seq_len;
    int64_t n = a + (b - a) / 2;
    if (extrapolate && before.peak >= 0 && lo.peak > before.peak) {
      const double per_token = static_cast<double>(lo.peak - before.peak) / (a - before.plan.seq_len);
      n = static_cast<int64_t>(std::min<double>(b - 1, a + 1 + (memory - lo.peak) / per_token));
      n = std::clamp<int64_t>(n, a + 1, b - 1);
    }
    if (absl::Status s = narrow(n); !s.ok()) return s;
    extrapolate = !extrapolate || 2 * (hi.plan.seq_len - lo.plan.seq_len) <= b - a;
  }
  return lo.plan;
}

}  // namespace sg
