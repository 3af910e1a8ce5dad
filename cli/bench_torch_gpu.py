"""PyTorch + Hugging Face transformers reference for //cli:bench --device=cuda --compare_torch.

The model bench saved (config.json + model.safetensors) is loaded with transformers' AutoModelForCausalLM on the
GPU with SDPA attention, in bfloat16 when bench multiplies in bf16 (--matmul=bf16) and float32 otherwise. For each
strategy and sequence length it times best-of-N of one gradient computation (zero grads, forward, backward) after
warm-up, with CUDA synchronisation around the timed region:
  full: plain autograd
  ckpt: model.gradient_checkpointing_enable() (every decoder layer recomputed in backward)
Peak memory is torch.cuda.max_memory_allocated() during the step (weights and gradients included, as seqgrad's
peak_bytes). A length that runs out of GPU memory gives a row with "oom": true, so bench can report the longest
length that fits. Prints one JSON object {"rows": [...], ...} as the last line of stdout.

usage: bench_torch_gpu.py --model_dir D --seq_dir S --strategies full,ckpt --seq_lens 8192,16384 \
                          --repeats 3 --warmup 1 --matmul bf16
The sequence for length T is S/seq_<T>.i32: T little-endian int32 input ids, then T labels (-100 = ignored).
"""
import argparse
import json
import math
import sys
import time

STRATEGIES = ("full", "ckpt")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def load(model_dir, dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to("cuda").train()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--seq_dir", required=True)
    ap.add_argument("--strategies", default="full,ckpt")
    ap.add_argument("--seq_lens", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--matmul", default="bf16", choices=["fp32", "tf32", "bf16"])
    args = ap.parse_args()
    # Imported after the arguments are read, so that a machine without PyTorch still checks bench's command line
    # (tools/gpu_check.sh --tiny).
    log("bench_torch_gpu.py: arguments read")
    try:
        import numpy as np
        import torch
    except ImportError as e:
        raise SystemExit(f"bench_torch_gpu.py: {e}: needs numpy, PyTorch with CUDA and transformers")
    if not torch.cuda.is_available():
        raise SystemExit("bench_torch_gpu.py: torch sees no CUDA device")

    dtype = torch.bfloat16 if args.matmul == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = args.matmul == "tf32"
    model = load(args.model_dir, dtype)
    params = [p for p in model.parameters() if p.requires_grad]

    rows = []
    for strategy in [s for s in args.strategies.split(",") if s]:
        if strategy not in STRATEGIES:
            raise SystemExit(f"bench_torch_gpu.py: unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
        if strategy == "ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        for T in [int(t) for t in args.seq_lens.split(",") if t]:
            raw = np.fromfile(f"{args.seq_dir}/seq_{T}.i32", dtype="<i4")
            if raw.size != 2 * T:
                raise SystemExit(f"bench_torch_gpu.py: seq_{T}.i32 holds {raw.size} int32, expected {2 * T}")
            ids = torch.from_numpy(raw[:T].astype(np.int64))[None].cuda()
            # seqgrad's labels[t] is the target of position t; HF shifts labels itself (logits[t] is scored against
            # labels[t + 1]), so it gets [-100] + labels[:-1]: the same targets but the last one, which HF cannot
            # express.
            hf_labels = torch.from_numpy(np.concatenate([[-100], raw[T:2 * T - 1]]).astype(np.int64))[None].cuda()
            valid = int((hf_labels >= 0).sum())

            def step():
                for p in params:
                    p.grad = None
                loss = model(input_ids=ids, labels=hf_labels).loss  # mean over valid labels, as bench reports
                loss.backward()
                return float(loss)

            row = {"engine": "torch", "strategy": strategy, "seq_len": T}
            try:
                for _ in range(args.warmup):
                    step()
                torch.cuda.synchronize()
                best, loss = math.inf, None
                torch.cuda.reset_peak_memory_stats()
                for _ in range(max(1, args.repeats)):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    loss = step()
                    torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t0)
                row.update({"time_s": best, "tokens_per_s": T / best, "loss": loss,
                            "peak_bytes": torch.cuda.max_memory_allocated(), "valid_labels": valid, "oom": False})
                log(f"torch {strategy:>5} T={T:>6}: {best:.4f} s  {T / best:,.0f} tok/s  loss {loss:.5f}  "
                    f"peak {row['peak_bytes'] / 2**20:.1f} MiB")
            except torch.cuda.OutOfMemoryError:
                row.update({"time_s": None, "tokens_per_s": None, "loss": None, "peak_bytes": None, "oom": True})
                log(f"torch {strategy:>5} T={T:>6}: out of GPU memory")
            for p in params:
                p.grad = None
            torch.cuda.empty_cache()
            rows.append(row)
    import transformers
    print(json.dumps({
        "rows": rows,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "dtype": str(dtype).replace("torch.", ""),
        "attention": "sdpa",
    }))


if __name__ == "__main__":
    main()
