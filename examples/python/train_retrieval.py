"""Trains the demo task (key-value retrieval over a long sequence) through the seqgrad Python package.

(KV_MARK key value) triples are scattered over filler tokens; at the end, (QUERY key value) triples ask for the
values, and only those values are labelled: the loss falls below log(num_values) only by attending back.

    python3 examples/python/train_retrieval.py --steps 20 --seq-len 256 --strategy seco --chunk 64

With LoRA, a learning-rate schedule, gradient accumulation and checkpoints (rerun with --resume to continue from the
newest checkpoint in --out-dir, with the same losses as an uninterrupted run):

    python3 examples/python/train_retrieval.py --steps 40 --lora-rank 8 --lora-targets q_proj,k_proj,v_proj,o_proj \\
        --lr-schedule cosine --warmup-steps 4 --grad-accum 2 --out-dir run --save-every 10 --keep 2 [--resume]

Record i of the data is generated from (seed, i), so a checkpoint's data position is all a resume needs.
"""
import argparse
import math
import os
import sys

import numpy as np

import seqgrad

PAIR_MARK, QUERY_MARK, FIRST_KEY = 1, 2, 3


def make_sequence(rng, seq_len, vocab, num_pairs, num_values):
    """One retrieval sequence (ids, labels, distances): labels are -100 everywhere except the queried values, and
    distances[t] is how far back the key of the value labelled at t was (0 where unlabelled)."""
    keys = rng.choice(np.arange(FIRST_KEY, FIRST_KEY + 2 * num_pairs), size=num_pairs, replace=False)
    value_base = FIRST_KEY + 2 * num_pairs
    values = rng.integers(value_base, value_base + num_values, size=num_pairs)
    filler_base = value_base + num_values
    ids = rng.integers(filler_base, vocab, size=seq_len).astype(np.int32)
    labels = np.full(seq_len, -100, dtype=np.int32)
    distances = np.zeros(seq_len, dtype=np.int64)
    query_start = seq_len - 3 * num_pairs
    slots = rng.choice(np.arange(0, query_start - 3, 3), size=num_pairs, replace=False)
    for k, v, s in zip(keys, values, slots):
        ids[s:s + 3] = (PAIR_MARK, k, v)
    for j, i in enumerate(rng.permutation(num_pairs)):
        p = query_start + 3 * j
        ids[p:p + 3] = (QUERY_MARK, keys[i], values[i])
        # Hugging Face labels: the value where it stands, predicted from the key before it.
        labels[p + 2] = values[i]
        distances[p + 2] = p + 1 - (slots[i] + 1)  # from the key of the pair to the key of the query
    return ids, labels, distances


HELD_OUT = 1 << 40  # records of the held-out set: indices from here on


def record(seed, index, seq_len, vocab, num_pairs=8, num_values=16):
    """Record `index` of the (endless) training data, or of the held-out set at HELD_OUT + i."""
    return make_sequence(np.random.default_rng([seed, index]), seq_len, vocab, num_pairs, num_values)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--strategy", default="seco")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="records per micro-batch")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine", "linear"])
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tuning")
    ap.add_argument("--lora-alpha", type=float, default=None, help="default 2 * rank")
    ap.add_argument("--lora-dropout", type=float, default=0.0)
    ap.add_argument("--lora-targets", default=None, help="comma-separated module names or 'all'")
    ap.add_argument("--out-dir", default=None, help="checkpoints (checkpoint-<step>) and the final model/adapter")
    ap.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0 = only the last)")
    ap.add_argument("--keep", type=int, default=0, help="checkpoints to keep (0 = all)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    ap.add_argument("--stop-at-step", type=int, default=0, help="stop (checkpointed) after this step, e.g. to resume")
    ap.add_argument("--eval-sequences", type=int, default=4, help="held-out sequences evaluated at the end")
    args = ap.parse_args(argv)
    if args.resume and not args.out_dir:
        ap.error("--resume needs --out-dir")

    num_values = 16
    with seqgrad.Model.from_preset(args.preset, dtype=args.dtype, seed=args.seed) as model:
        if args.lora_rank:
            model.enable_lora(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                              targets=args.lora_targets, seed=args.seed)
        with seqgrad.Trainer(model, strategy=args.strategy, chunk=args.chunk, page_size=args.chunk, lr=args.lr,
                             lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                             total_steps=args.steps, grad_accum=args.grad_accum, seed=args.seed) as tr:
            lora = model.lora
            print("seqgrad %s: %s, %d layers, vocab %d; strategy %s; %s; chance loss %.3f" %
                  (seqgrad.version(), args.preset, model.num_layers, model.vocab_size, args.strategy,
                   "LoRA r=%d on %s" % (lora["rank"], ",".join(lora["targets"])) if lora else "full fine-tuning",
                   math.log(num_values)))
            position = 0  # records consumed
            if args.resume:
                state = tr.resume(args.out_dir, missing_ok=True)
                if state:
                    position = state["data_position"]
                    print("resumed from step %d (record %d)" % (state["step"], position))
            last = min(args.steps, args.stop_at_step) if args.stop_at_step else args.steps
            losses = []
            while tr.step_count < last:
                for _ in range(args.grad_accum):
                    recs = [record(args.seed, position + i, args.seq_len, model.vocab_size)
                            for i in range(args.batch)]
                    tr.accumulate_gradients([r[0] for r in recs], [r[1] for r in recs])
                    position += args.batch
                m = tr.optimizer_step()
                losses.append(m["loss"])
                print("step %3d loss %.4f lr %.2e tokens %d grad_norm %.3f peak %.1f KiB" %
                      (m["step"], m["loss"], m["lr"], m["tokens"], m["grad_norm"], m["peak_bytes"] / 1024))
                if args.out_dir and ((args.save_every and m["step"] % args.save_every == 0) or m["step"] == last):
                    print("saved %s" % tr.save_checkpoint(args.out_dir, data_position=position, keep=args.keep))

            held_out = [record(args.seed, HELD_OUT + i, args.seq_len, model.vocab_size)
                        for i in range(args.eval_sequences)]
            ev = tr.evaluate_detailed([r[0] for r in held_out], [r[1] for r in held_out],
                                      distances=[r[2] for r in held_out])
            print("held-out: loss %.4f perplexity %.2f accuracy %.3f" % (ev["loss"], ev["perplexity"],
                                                                         ev["accuracy"]))
            for b in ev["by_distance"]:
                if b["count"]:
                    print("  distance [%d, %d): accuracy %.3f over %d queries" % (b["lo"], b["hi"], b["accuracy"],
                                                                                 b["count"]))
            finished = tr.step_count == args.steps
        if args.out_dir and finished:  # finished: the final model (or adapter) next to them
            final = os.path.join(args.out_dir, "adapter" if args.lora_rank else "model")
            if args.lora_rank:
                model.save_lora_adapter(final)
            else:
                model.save(final)
            print("wrote %s" % final)
    return losses


if __name__ == "__main__":
    main()
    sys.exit(0)
