#!/usr/bin/python3
"""Writes the tiny DPO and GRPO example files (examples/data/dpo_tiny.jsonl, grpo_tiny.jsonl), deterministically.

The task: a prompt is a run of consecutive token ids (a, a+1, ..., a+k); a good response continues the count.
DPO pairs prefer the continuation over random tokens; a GRPO group holds G = 4 completions, each token continuing
the count with some probability, rewarded by the fraction that do, and advantages are the group-normalized
rewards. Reference and old-policy log-probs are near those of a uniform model over the 97-token vocabulary of
the `tiny` preset (ln 1/97 = -4.575) with a little noise. All token ids are below 97, so the files also work
with the `demo` preset (vocab 128).

usage: /usr/bin/python3 examples/data/make_tiny.py [--out DIR]   (default: this script's directory)
"""
import argparse
import json
import math
import os
import random

VOCAB = 97
FIRST, LAST = 2, VOCAB - 1  # token ids used
UNIFORM_LOGP = -math.log(VOCAB)
G = 4


def count_from(a, n):
    """n consecutive ids from a, wrapping within [FIRST, LAST]."""
    span = LAST - FIRST + 1
    return [FIRST + (a - FIRST + i) % span for i in range(n)]


def logprobs(rng, n):
    return [round(UNIFORM_LOGP + rng.uniform(-0.3, 0.3), 4) for _ in range(n)]


def dpo_lines(rng, count=6):
    for _ in range(count):
        k, r = rng.randint(4, 9), rng.randint(3, 6)
        run = count_from(rng.randint(FIRST, LAST), k + r)
        prompt, chosen = run[:k], run[k:]
        rejected = [rng.randint(FIRST, LAST) for _ in range(rng.randint(3, 6))]
        yield {
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "ref_chosen_logp": round(sum(logprobs(rng, len(chosen))), 4),
            "ref_rejected_logp": round(sum(logprobs(rng, len(rejected))), 4),
        }


def grpo_lines(rng, count=4):
    for _ in range(count):
        k = rng.randint(4, 9)
        run = count_from(rng.randint(FIRST, LAST), k + 8)
        prompt, completions, rewards = run[:k], [], []
        for _ in range(G):
            n = rng.randint(3, 8)
            p_right = rng.random()
            c = [run[k + j] if rng.random() < p_right else rng.randint(FIRST, LAST) for j in range(n)]
            completions.append(c)
            rewards.append(sum(t == run[k + j] for j, t in enumerate(c)) / n)
        mean = sum(rewards) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / G)
        yield {
            "prompt": prompt,
            "completions": completions,
            "advantages": [round((x - mean) / (std + 1e-4), 4) for x in rewards],
            "old_logprobs": [logprobs(rng, len(c)) for c in completions],
            "ref_logprobs": [logprobs(rng, len(c)) for c in completions],
        }


def write(path, lines):
    with open(path, "w") as f:
        for obj in lines:
            f.write(json.dumps(obj) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    write(os.path.join(args.out, "dpo_tiny.jsonl"), dpo_lines(random.Random(1)))
    write(os.path.join(args.out, "grpo_tiny.jsonl"), grpo_lines(random.Random(2)))


if __name__ == "__main__":
    main()
