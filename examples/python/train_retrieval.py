"""Trains the demo task (key-value retrieval over a long sequence) through the seqgrad Python package.

(KV_MARK key value) triples are scattered over filler tokens; at the end, (QUERY key value) triples ask for the
values, and only those values are labelled: the loss falls below log(num_values) only by attending back.

    python3 examples/python/train_retrieval.py --steps 20 --seq-len 256 --strategy seco --chunk 64
"""
import argparse
import math
import sys

import numpy as np

import seqgrad

PAIR_MARK, QUERY_MARK, FIRST_KEY = 1, 2, 3


def make_sequence(rng, seq_len, vocab, num_pairs, num_values):
    """One retrieval sequence (ids, labels) with -100 everywhere except the queried values."""
    keys = rng.choice(np.arange(FIRST_KEY, FIRST_KEY + 2 * num_pairs), size=num_pairs, replace=False)
    value_base = FIRST_KEY + 2 * num_pairs
    values = rng.integers(value_base, value_base + num_values, size=num_pairs)
    filler_base = value_base + num_values
    ids = rng.integers(filler_base, vocab, size=seq_len).astype(np.int32)
    labels = np.full(seq_len, -100, dtype=np.int32)
    query_start = seq_len - 3 * num_pairs
    slots = rng.choice(np.arange(0, query_start - 3, 3), size=num_pairs, replace=False)
    for k, v, s in zip(keys, values, slots):
        ids[s:s + 3] = (PAIR_MARK, k, v)
    for j, i in enumerate(rng.permutation(num_pairs)):
        p = query_start + 3 * j
        ids[p:p + 3] = (QUERY_MARK, keys[i], values[i])
        labels[p + 1] = values[i]  # predict the value after seeing the key
    return ids, labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--strategy", default="seco")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    num_pairs, num_values = 8, 16
    with seqgrad.Model.from_preset(args.preset, seed=args.seed) as model, \
            seqgrad.Trainer(model, strategy=args.strategy, chunk=args.chunk, page_size=args.chunk, lr=args.lr) as tr:
        print("seqgrad %s: %s, %d layers, vocab %d; strategy %s; chance loss %.3f" %
              (seqgrad.version(), args.preset, model.num_layers, model.vocab_size, args.strategy,
               math.log(num_values)))
        losses = []
        for step in range(1, args.steps + 1):
            batch = [make_sequence(rng, args.seq_len, model.vocab_size, num_pairs, num_values)
                     for _ in range(args.batch)]
            m = tr.step([b[0] for b in batch], [b[1] for b in batch])
            losses.append(m["loss"])
            print("step %3d loss %.4f tokens %d grad_norm %.3f peak %.1f KiB (%.0f ms)" %
                  (step, m["loss"], m["tokens"], m["grad_norm"], m["peak_bytes"] / 1024, 1000 * m["seconds"]))
    return losses


if __name__ == "__main__":
    main()
    sys.exit(0)
