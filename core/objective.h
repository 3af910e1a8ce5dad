// Training objectives on top of the LM head. Every one is a sum over labelled tokens of a function of that
// token's log-probability, loss = sum_t f_t(logp_t), so the head can work chunk by chunk and no T x vocab logits
// ever exist (StreamBP §3.2.1):
//   sft   f_t = -logp_t / N                                              (N: valid tokens of the batch)
//   grpo  f_t = (-min(r_t A, clip(r_t, 1-eps, 1+eps) A) + beta w_t k3(ref_t - logp_t)) / (|o_i| G B),
//         r_t = exp(logp_t - old_t), k3(x) = e^x - x - 1, w_t = r_t (bias-corrected KL, TRL's default) or 1
//                                                                      (per token: already a sum)
//   dpo   L = -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))) per pair, pi = sum of logp over the response.
//         Not a sum over tokens, but its gradient is: dL/dlogp_t = -+ beta sigmoid(-z): once a first pass has
//         accumulated the per-sequence sums chunk by chunk, the backward pass uses f_t = c logp_t with that c.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/strategy.h"

namespace sg {

// f_t for one sequence: Term returns f_t(logp) for the labelled position t and sets *dloss = f_t'(logp).
class TokenObjective {
 public:
  virtual ~TokenObjective() = default;
  virtual double Term(int64_t t, double logp, double* dloss) const = 0;
  // Evaluation: an objective that returns true here also gets, for every labelled position t, the arg max of its
  // logits over the vocabulary (the lowest id among ties) through Argmax, before Term (core/eval.h's accuracy).
  virtual bool wants_argmax() const { return false; }
  virtual void Argmax(int64_t t, int32_t token) const {}
};

struct ObjectiveOptions {
  std::string name = "sft";  // sft | dpo | grpo
  double dpo_beta = 0.1;
  double grpo_clip_eps = 0.2;
  double grpo_kl_beta = 0.04;
  // The KL term times the importance ratio r_t (TRL's use_bias_correction_kl, on by default in TRL 1.16), which makes
  // its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2); off: plain k3.
  bool grpo_kl_bias_correction = true;
};

// A DPO preference pair: two sequences (prompt + response, labels only on the response). Reference log-probs
// (sums over each response's labelled tokens) come with the data, or from a frozen reference model when NaN.
struct DpoPair {
  Sequence chosen, rejected;
  double ref_chosen_logp = NAN, ref_rejected_logp = NAN;
};

// One GRPO completion: prompt + completion (labels only on the completion), its advantage, and per position the
// old-policy and reference log-probs of the label (aligned with labels; empty: old = the current policy, which
// makes r = 1; ref from the reference model, or no KL term when grpo_kl_beta = 0).
struct GrpoCompletion {
  Sequence seq;
  double advantage = 0;
  std::vector<double> old_logprobs, ref_logprobs;
};
struct GrpoGroup {
  std::vector<GrpoCompletion> completions;  // G completions of one prompt
};

// A batch for any objective: sft uses sequences, dpo pairs, grpo groups.
struct Batch {
  std::vector<Sequence> sequences;
  std::vector<DpoPair> pairs;
  std::vector<GrpoGroup> groups;
};

absl::Status ValidateObjectiveOptions(const ObjectiveOptions& o);

// f_t = c logp_t: DPO's backward pass, c from the pair's log-prob sums.
std::shared_ptr<const TokenObjective> LinearObjective(double c);
// f_t = -logp_t, recording logp_t into (*out)[t] (out sized to the sequence): per-token log-probs of a forward.
std::shared_ptr<const TokenObjective> RecordingObjective(std::vector<double>* out);
// GRPO's f_t for one completion times `scale`; ref holds the reference log-prob per position (or is empty
// when o.grpo_kl_beta = 0).
std::shared_ptr<const TokenObjective> GrpoObjective(const GrpoCompletion& c, std::vector<double> ref,
                                                    const ObjectiveOptions& o, double scale);

}  // namespace sg
