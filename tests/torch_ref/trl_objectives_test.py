"""The engine's dpo and grpo objectives against TRL's definitions (trl 1.16, DPOTrainer / GRPOTrainer._compute_loss),
written here in TRL's batched form: completions padded into a [N, T] tensor with a completion mask, every
normalisation as TRL applies it. The engine's loss and gradients (grad_dump, seco) must equal

  DPO  loss_type="sigmoid", f_divergence_type="reverse_kl", ld_alpha=None, use_weighting=False:
       mean over pairs of -log sigmoid(beta ((sum chosen logps - ref) - (sum rejected logps - ref)))
  GRPO loss_type="grpo", importance_sampling_level="token", epsilon_high=None, delta=None, and TRL's default
       use_bias_correction_kl=True: per token -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta r k3, k3 =
       exp(ref - logp) - (ref - logp) - 1, summed over each completion's tokens / its length, mean over completions;
       with --grpo_kl_bias_correction=false, use_bias_correction_kl=False: beta k3 instead of beta r k3

to 1e-10, and differ from TRL's other normalisations (DPO "sigmoid_norm"; GRPO "bnpo"/"dapo", "dr_grpo"), which the
test prints, so that it shows which settings ours is.
"""
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ref_test as ref  # noqa: E402  (models, data makers and the grad_dump runner)

HF = ref.CONFIGS["llama_gqa"]["hf"]
TOLERANCE = 1e-10


def padded(rows):
    """[N, T] tensors (zero-padded) of per-token values and the completion mask."""
    T = max(len(r) for r in rows)
    values = torch.zeros(len(rows), T, dtype=torch.float64)
    mask = torch.zeros(len(rows), T, dtype=torch.float64)
    for i, r in enumerate(rows):
        values[i, : len(r)] = r if torch.is_tensor(r) else torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = 1
    return values, mask


def trl_dpo(W, rows, beta):
    """{loss_type: loss} of TRL's DPO on the pairs, reference sums from the data (precompute_ref_logps)."""
    chosen, c_mask = padded([ref.response_logprobs(HF, W, r["prompt"], r["chosen"]) for r in rows])
    rejected, r_mask = padded([ref.response_logprobs(HF, W, r["prompt"], r["rejected"]) for r in rows])
    ref_c = torch.tensor([r["ref_chosen_logp"] for r in rows], dtype=torch.float64)
    ref_r = torch.tensor([r["ref_rejected_logp"] for r in rows], dtype=torch.float64)
    chosen_scores = (chosen * c_mask).sum(1) - ref_c
    rejected_scores = (rejected * r_mask).sum(1) - ref_r
    norm_delta = chosen_scores / c_mask.sum(1).clamp(min=1) - rejected_scores / r_mask.sum(1).clamp(min=1)
    return {"sigmoid": (-F.logsigmoid(beta * (chosen_scores - rejected_scores))).mean(),
            "sigmoid_norm": (-F.logsigmoid(beta * norm_delta)).mean()}


def trl_grpo(W, rows, eps, beta, bias_correction=True):
    """{loss_type: loss} of TRL's GRPO over every completion of every group (one batch, no accumulation), with
    use_bias_correction_kl=bias_correction; "grpo, other KL" is loss_type "grpo" with the other setting."""
    logps, mask = padded([ref.response_logprobs(HF, W, g["prompt"], c) for g in rows for c in g["completions"]])
    old, _ = padded([o for g in rows for o in g["old_logprobs"]])
    ref_logps, _ = padded([o for g in rows for o in g["ref_logprobs"]])
    advantages = torch.tensor([a for g in rows for a in g["advantages"]], dtype=torch.float64)[:, None]
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    policy = -torch.min(coef_1 * advantages, coef_2 * advantages)
    x = ref_logps - logps
    per_token_kl = torch.exp(x) - x - 1
    per_token = policy + beta * (per_token_kl * coef_1 if bias_correction else per_token_kl)
    other_kl = policy + beta * (per_token_kl if bias_correction else per_token_kl * coef_1)
    masked = per_token * mask
    return {"grpo": (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean(),
            "grpo, other KL": ((other_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(),
            "bnpo/dapo": masked.sum() / mask.sum().clamp(min=1),
            "dr_grpo": masked.sum() / (mask.size(0) * mask.size(1))}


CASES = {
    "dpo": ("dpo", ref.make_dpo_data, lambda W, rows: trl_dpo(W, rows, ref.DPO_BETA), "sigmoid",
            [f"--dpo_beta={ref.DPO_BETA!r}"]),
    "grpo": ("grpo", ref.make_grpo_data,
             lambda W, rows: trl_grpo(W, rows, ref.GRPO_CLIP_EPS, ref.GRPO_KL_BETA), "grpo",
             [f"--grpo_clip_eps={ref.GRPO_CLIP_EPS!r}", f"--grpo_kl_beta={ref.GRPO_KL_BETA!r}"]),
    "grpo_plain_kl": ("grpo", ref.make_grpo_data,
                      lambda W, rows: trl_grpo(W, rows, ref.GRPO_CLIP_EPS, ref.GRPO_KL_BETA, bias_correction=False),
                      "grpo", [f"--grpo_clip_eps={ref.GRPO_CLIP_EPS!r}", f"--grpo_kl_beta={ref.GRPO_KL_BETA!r}",
                               "--grpo_kl_bias_correction=false"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_objective_equals_trl(name):
    objective, make_data, trl, ours_is, flags = CASES[name]
    root = ref.scratch_dir(f"trl_{name}_")
    weights = ref.make_weights(HF, 21)
    model_dir, data = os.path.join(root, "model"), os.path.join(root, "data.jsonl")
    ref.write_model_dir(model_dir, HF, weights)
    rows = make_data(HF, weights, 21)
    ref.write_rows(data, rows)
    loss, grads, _ = ref.grad_dump(model_dir, data, os.path.join(root, "g.safetensors"), "seco", page_size=5,
                                   lm_chunk=7, chunk=6, objective=objective, flags=flags)
    W = ref.leaf_weights(weights)
    losses = trl(W, rows)
    losses[ours_is].backward()
    expected = (losses[ours_is].item(), {k: t.grad.numpy().copy() for k, t in W.items()})
    print(f"{name}: engine {loss:.15f}; TRL " + ", ".join(f"{k} {v.item():.15f}" for k, v in losses.items()))
    ref.compare((loss, grads), expected, f"{name} vs TRL loss_type={ours_is}")
    for other, value in losses.items():
        if other != ours_is:
            assert abs(value.item() - loss) > 1e3 * TOLERANCE * abs(loss), f"{other} is not told apart"


if __name__ == "__main__":
    args = []
    for a in sys.argv[1:]:
        if a.startswith("--grad_dump="):
            os.environ["SG_GRAD_DUMP"] = os.path.abspath(a.split("=", 1)[1])
        else:
            args.append(a)
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-s", "-p", "no:cacheprovider"] + args))
