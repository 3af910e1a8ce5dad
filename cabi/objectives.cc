// The preference and policy objectives' calls: DPO pairs and GRPO groups of completions, checked, into the engine's
// batches.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {
namespace {

// Run on a DPO or GRPO batch: the reference model is guarded too.
sg_status* RunObjectiveBatch(const char* fn, sg_trainer* t, Call call, sg_metrics* out,
                             const std::function<sg_status*()>& check, const Batch& batch) {
  Trainer& trainer = *t->trainer;
  return Run(fn, t, call, true, out, check,
             [&] { return dist::ComputeGradients(trainer, t->tp.get(), batch, call == Call::kAccumulate); });
}

sg_status* RunDpoOn(const char* fn, sg_trainer* t, const int32_t* const* chosen_ids,
                    const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                    const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                    const int64_t* rejected_lengths, const double* ref_chosen_logp, const double* ref_rejected_logp,
                    int64_t num_pairs, sg_metrics* out, Call call) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  if (t->objective.name != "dpo")
    return WrongObjective(fn, t, "dpo",
                          t->objective.name == "sft" ? "sg_trainer_step / compute_gradients"
                                                     : "sg_trainer_step_grpo / compute_gradients_grpo");
  if (!chosen_ids) return NullArg(fn, "chosen_ids");
  if (!chosen_lengths) return NullArg(fn, "chosen_lengths");
  if (!rejected_ids) return NullArg(fn, "rejected_ids");
  if (!rejected_lengths) return NullArg(fn, "rejected_lengths");
  if (num_pairs <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_pairs' is ", num_pairs, "; need at least 1 pair"));
  const int64_t vocab = t->core->model->vocab_size();
  const SequenceArgs chosen{"chosen_ids", "chosen_labels", "chosen_lengths", chosen_ids, chosen_labels, chosen_lengths};
  const SequenceArgs rejected{"rejected_ids", "rejected_labels", "rejected_lengths",
                              rejected_ids,   rejected_labels,   rejected_lengths};
  Batch batch;
  batch.pairs.resize(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    DpoPair& p = batch.pairs[i];
    if (sg_status* s = BuildSequence(fn, vocab, chosen, i, &p.chosen)) return s;
    if (sg_status* s = BuildSequence(fn, vocab, rejected, i, &p.rejected)) return s;
    const double* refs[2] = {ref_chosen_logp, ref_rejected_logp};
    const char* names[2] = {"ref_chosen_logp", "ref_rejected_logp"};
    double* dst[2] = {&p.ref_chosen_logp, &p.ref_rejected_logp};
    for (int k = 0; k < 2; ++k) {
      if (!refs[k]) continue;  // NaN: the reference model's
      if (std::isinf(refs[k][i]))
        return Invalid(absl::StrCat(fn, ": ", names[k], "[", i, "] is ", refs[k][i],
                                    "; need a finite log-prob sum, or NaN for the reference model's"));
      *dst[k] = refs[k][i];
    }
  }
  // Under the busy guard, where the reference cannot change: pairs without reference log-probs need the model.
  auto check = [&]() -> sg_status* {
    if (t->trainer->has_reference()) return nullptr;
    for (int64_t i = 0; i < num_pairs; ++i) {
      const DpoPair& p = batch.pairs[i];
      for (int k = 0; k < 2; ++k) {
        if (!std::isnan(k == 0 ? p.ref_chosen_logp : p.ref_rejected_logp)) continue;
        const double* ref = k == 0 ? ref_chosen_logp : ref_rejected_logp;
        const char* name = k == 0 ? "ref_chosen_logp" : "ref_rejected_logp";
        return Invalid(absl::StrCat(
            fn, ": ", ref ? absl::StrCat(name, "[", i, "] is NaN") : absl::StrCat("argument '", name, "' is NULL"),
            " (pair ", i,
            " has no reference log-prob) and the trainer has no reference model (sg_trainer_set_reference)"));
      }
    }
    return nullptr;
  };
  return RunObjectiveBatch(fn, t, call, out, check, batch);
}

// The groups' offsets into the completions: from 0, increasing, none empty, covering every completion.
sg_status* CheckGroupOffsets(const char* fn, const int64_t* group_offsets, int64_t num_groups,
                             int64_t num_completions) {
  if (group_offsets[0] != 0)
    return Invalid(absl::StrCat(fn, ": group_offsets[0] is ", group_offsets[0], "; must be 0"));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t begin = group_offsets[g], end = group_offsets[g + 1];
    if (end == begin)
      return Invalid(absl::StrCat(fn, ": argument 'group_offsets': group ", g, " has no completions (G = 0): ",
                                  "group_offsets[", g, "] = group_offsets[", g + 1, "] = ", end));
    if (end < begin)
      return Invalid(absl::StrCat(fn, ": group_offsets[", g + 1, "] = ", end, " is less than group_offsets[", g,
                                  "] = ", begin, "; offsets must increase"));
    if (end > num_completions)
      return Invalid(
          absl::StrCat(fn, ": group_offsets[", g + 1, "] = ", end, " is beyond 'num_completions' = ", num_completions));
  }
  if (group_offsets[num_groups] != num_completions)
    return Invalid(absl::StrCat(fn, ": group_offsets[", num_groups, "] = ", group_offsets[num_groups],
                                " but 'num_completions' is ", num_completions,
                                "; the groups must cover every completion"));
  return nullptr;
}

sg_status* RunGrpoOn(const char* fn, sg_trainer* t, const int32_t* const* ids, const int32_t* const* labels,
                     const int64_t* lengths, const double* advantages, const double* const* old_logprobs,
                     const double* const* ref_logprobs, int64_t num_completions, const int64_t* group_offsets,
                     int64_t num_groups, sg_metrics* out, Call call) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  if (t->objective.name != "grpo")
    return WrongObjective(fn, t, "grpo",
                          t->objective.name == "sft" ? "sg_trainer_step / compute_gradients"
                                                     : "sg_trainer_step_dpo / compute_gradients_dpo");
  if (!ids) return NullArg(fn, "ids");
  if (!lengths) return NullArg(fn, "lengths");
  if (!advantages) return NullArg(fn, "advantages");
  if (!group_offsets) return NullArg(fn, "group_offsets");
  if (num_completions <= 0)
    return Invalid(
        absl::StrCat(fn, ": argument 'num_completions' is ", num_completions, "; need at least 1 completion"));
  if (num_groups <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_groups' is ", num_groups, "; need at least 1 group"));
  if (sg_status* s = CheckGroupOffsets(fn, group_offsets, num_groups, num_completions)) return s;
  const int64_t vocab = t->core->model->vocab_size();
  const SequenceArgs seqs{"ids", "labels", "lengths", ids, labels, lengths};
  Batch batch;
  batch.groups.resize(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t c = group_offsets[g]; c < group_offsets[g + 1]; ++c) {
      GrpoCompletion& comp = batch.groups[g].completions.emplace_back();
      if (sg_status* s = BuildSequence(fn, vocab, seqs, c, &comp.seq)) return s;
      if (!std::isfinite(advantages[c]))
        return Invalid(absl::StrCat(fn, ": advantages[", c, "] is ", advantages[c], "; need a finite advantage"));
      comp.advantage = advantages[c];
      const double* const* arrays[2] = {old_logprobs, ref_logprobs};
      const char* names[2] = {"old_logprobs", "ref_logprobs"};
      std::vector<double>* dst[2] = {&comp.old_logprobs, &comp.ref_logprobs};
      for (int k = 0; k < 2; ++k) {
        const double* lp = arrays[k] ? arrays[k][c] : nullptr;
        if (!lp) continue;  // absent
        // Given aligned with the C API's labels (entry t for label t); the engine's position t - 1 predicts it.
        const int64_t n = lengths[c];
        dst[k]->assign(n - 1, NAN);
        for (int64_t pos = 0; pos + 1 < n; ++pos) {
          if (comp.seq.labels[pos] < 0) continue;
          if (!std::isfinite(lp[pos + 1]))
            return Invalid(absl::StrCat(fn, ": ", names[k], "[", c, "][", pos + 1, "] is ", lp[pos + 1], " (group ", g,
                                        ") where the label is ", comp.seq.labels[pos],
                                        "; need a finite log-prob at every labelled position"));
          (*dst[k])[pos] = lp[pos + 1];
        }
      }
    }
  }
  // Under the busy guard: completions without reference log-probs need the reference model for the KL term.
  auto check = [&]() -> sg_status* {
    if (t->trainer->has_reference() || !(t->objective.grpo_kl_beta > 0)) return nullptr;
    for (int64_t g = 0; g < num_groups; ++g)
      for (int64_t c = group_offsets[g]; c < group_offsets[g + 1]; ++c) {
        if (!batch.groups[g].completions[c - group_offsets[g]].ref_logprobs.empty()) continue;
        return Invalid(absl::StrCat(fn, ": ",
                                    ref_logprobs ? absl::StrCat("ref_logprobs[", c, "] is NULL")
                                                 : std::string("argument 'ref_logprobs' is NULL"),
                                    " (group ", g, " completion ", c - group_offsets[g],
                                    "), grpo_kl_beta = ", t->objective.grpo_kl_beta,
                                    " > 0 needs reference log-probs, and the trainer has no reference model "
                                    "(sg_trainer_set_reference)"));
      }
    return nullptr;
  };
  return RunObjectiveBatch(fn, t, call, out, check, batch);
}

// The calls, agreeing across tensor-parallel ranks (Agreed).
template <typename... A>
sg_status* RunDpo(const char* fn, sg_trainer* t, A... a) {
  return Agreed(fn, t, [&] { return RunDpoOn(fn, t, a...); });
}
template <typename... A>
sg_status* RunGrpo(const char* fn, sg_trainer* t, A... a) {
  return Agreed(fn, t, [&] { return RunGrpoOn(fn, t, a...); });
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_status* sg_trainer_compute_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                            const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                            const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                                            const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                            const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kGradients);
  });
}

sg_status* sg_trainer_step_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                               const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                               const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                               const int64_t* rejected_lengths, const double* ref_chosen_logp,
                               const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kStep);
  });
}

sg_status* sg_trainer_accumulate_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                               const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                               const int32_t* const* rejected_ids,
                                               const int32_t* const* rejected_labels, const int64_t* rejected_lengths,
                                               const double* ref_chosen_logp, const double* ref_rejected_logp,
                                               int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kAccumulate);
  });
}

sg_status* sg_trainer_compute_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                             const int32_t* const* labels, const int64_t* lengths,
                                             const double* advantages, const double* const* old_logprobs,
                                             const double* const* ref_logprobs, int64_t num_completions,
                                             const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kGradients);
  });
}

sg_status* sg_trainer_step_grpo(sg_trainer* trainer, const int32_t* const* ids, const int32_t* const* labels,
                                const int64_t* lengths, const double* advantages, const double* const* old_logprobs,
                                const double* const* ref_logprobs, int64_t num_completions,
                                const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kStep);
  });
}

sg_status* sg_trainer_accumulate_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                                const int32_t* const* labels, const int64_t* lengths,
                                                const double* advantages, const double* const* old_logprobs,
                                                const double* const* ref_logprobs, int64_t num_completions,
                                                const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kAccumulate);
  });
}

}  // extern "C"
