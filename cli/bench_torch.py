"""PyTorch references for //cli:bench: the same Llama/Qwen2/Qwen3/Qwen3.5/Qwen3-Next/Mamba-2 model, timed the same way.

bench (with --compare_torch) writes the model (config.json + model.safetensors, sg::SaveModel) and the token
sequences to a directory and runs this script with --python (default /usr/bin/python3; a PyTorch 2.x venv from
PyPI is what users have). Two engines, each timed best-of-N of one gradient computation (zero grads, forward,
loss.backward()) after warm-up:
  torch: the model in plain torch ops (F.scaled_dot_product_attention where torch has it)
         full: plain autograd; ckpt: torch.utils.checkpoint around each decoder layer. Llama, Qwen2 and Qwen3
         only: skipped, with the reason in "skipped_engines", for the hybrids (their Gated DeltaNet layers),
         mixtures of experts and Mamba-2
  hf:    Hugging Face transformers' own model class (AutoModelForCausalLM, attn_implementation="sdpa" where the
         model has attention), when transformers is importable; full: plain autograd; ckpt:
         model.gradient_checkpointing_enable(). For the hybrids (qwen3_5_text, qwen3_next) transformers runs its
         torch delta rule and convolution unless the flash-linear-attention and causal-conv1d packages are
         installed; for Mamba-2 its torch SSD chunk scan and convolution unless mamba-ssm and causal-conv1d are
         (the label says which ran)
Both take the same loss (sum of token cross-entropies over the valid labels / their count, on the logits) so the
losses compare with seqgrad's. --dtype=bf16 runs both in fp32 weights under torch.autocast("cpu", bfloat16), the
bf16 mixed precision PyTorch users train with on CPUs. Rows carry "label" (engine and versions). Prints one JSON
object {"rows": [...], ...} as the last line of stdout (progress goes to stderr).

Peak memory is not visible to seqgrad's allocator here: rows carry peak_bytes = null and
  rss_delta_bytes: growth of the process's peak RSS during a timed step (VmHWM after minus VmRSS before; VmHWM is
                   reset through /proc/self/clear_refs), null where the kernel does not allow that;
  step_peak_bytes: peak bytes held by torch's CPU allocator during one extra, profiled step, above what it held
                   before (torch.profiler memory events), null where the profiler cannot say;
  resting_bytes:   weights + gradients, allocated between steps (seqgrad's peak_bytes includes them).

usage: bench_torch.py --model_dir D --seq_dir S --strategies full,ckpt --seq_lens 1024,2048 \
                      --repeats 3 --warmup 1 --threads 2 [--dtype f32|f64|bf16] [--engines torch,hf]
The sequence for length T is S/seq_<T>.i32: T little-endian int32 input ids, then T labels (-100 = ignored).
"""
import argparse
import contextlib
import json
import math
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

STRATEGIES = ("full", "ckpt")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --- a tiny safetensors reader ---------------------------------------------------------------------------------
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """name -> float tensor (bf16 is widened through its bit pattern; numpy has no bfloat16)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        shape = info["shape"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] in _ST_DTYPES:
            arr = np.frombuffer(raw, dtype=_ST_DTYPES[info["dtype"]])
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        out[name] = torch.from_numpy(arr.copy()).reshape(shape)
    return out


# --- the model --------------------------------------------------------------------------------------------------
def rope_inv_freq(cfg):
    """Same as sg::RopeInverseFrequencies (Llama-3 scaling when the config asks for it), in float64."""
    hd = cfg["head_dim"]
    inv = [cfg.get("rope_theta", 10000.0) ** (-2.0 * i / hd) for i in range(hd // 2)]
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling type {kind!r} is not supported")
        old = float(rs["original_max_position_embeddings"])
        low, high, factor = rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    return torch.tensor(inv, dtype=torch.float64)


# Hybrids: Gated DeltaNet layers, which the plain-ops engine does not implement; nor mixtures of experts, nor Mamba-2
# mixers (mamba2 has no attention, the others are Mamba-2 / attention hybrids).
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen3_5_moe_text", "qwen3_5_moe")
MAMBA2_MODEL_TYPES = ("mamba2", "bamba", "nemotron_h", "falcon_h1")
ATTENTION_FREE_MODEL_TYPES = ("mamba2",)


def plain_ops_gap(cfg):
    """Why the plain-ops engine cannot run this config (None: it can)."""
    if cfg.get("model_type") in HYBRID_MODEL_TYPES:
        return (f"the plain-ops engine has no Gated DeltaNet ({cfg['model_type']}): transformers' model class (hf) "
                "is the reference for the hybrids")
    if cfg.get("model_type") in MOE_MODEL_TYPES:
        return (f"the plain-ops engine has no mixture of experts ({cfg['model_type']}): transformers' model class (hf) "
                "is the reference")
    if cfg.get("model_type") in MAMBA2_MODEL_TYPES:
        return (f"the plain-ops engine has no Mamba-2 mixer ({cfg['model_type']}): transformers' model class (hf) "
                "is the reference")
    return None


class Llama:
    """Llama / Qwen2 / Qwen3 decoder (GQA, RoPE, RMSNorm, SwiGLU; Qwen3's per-head q/k RMSNorm) over a single
    sequence [T]."""

    def __init__(self, cfg, tensors, dtype):
        self.cfg = cfg
        self.L = cfg["num_hidden_layers"]
        self.H = cfg["num_attention_heads"]
        self.KV = cfg.get("num_key_value_heads") or self.H
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.H
        self.eps = cfg["rms_norm_eps"]
        self.dtype = dtype
        self.inv_freq = rope_inv_freq(dict(cfg, head_dim=self.hd))
        self.p = {}
        for name, t in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            self.p[name] = t.to(dtype).requires_grad_(True)
        if "lm_head.weight" not in self.p:
            if not cfg.get("tie_word_embeddings", False):
                raise ValueError("model.safetensors has no lm_head.weight and the embeddings are not tied")
            self.head = self.p["model.embed_tokens.weight"]
        else:
            self.head = self.p["lm_head.weight"]

    def params(self):
        return list(self.p.values())

    def rope_tables(self, T):
        pos = torch.arange(T, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([pos.cos(), pos.cos()], dim=-1).to(self.dtype)  # [T, hd]
        sin = torch.cat([pos.sin(), pos.sin()], dim=-1).to(self.dtype)
        return cos[None], sin[None]  # [1, T, hd]

    def rms_norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def rope(x, cos, sin):  # x [heads, T, hd]; HF rotate_half convention
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def layer(self, i, x, cos, sin, mask):
        p = self.p
        pre = f"model.layers.{i}."
        T = x.shape[0]
        xn = self.rms_norm(x, p[pre + "input_layernorm.weight"])
        q = F.linear(xn, p[pre + "self_attn.q_proj.weight"], p.get(pre + "self_attn.q_proj.bias"))
        k = F.linear(xn, p[pre + "self_attn.k_proj.weight"], p.get(pre + "self_attn.k_proj.bias"))
        v = F.linear(xn, p[pre + "self_attn.v_proj.weight"], p.get(pre + "self_attn.v_proj.bias"))
        q = q.view(T, self.H, self.hd)
        k = k.view(T, self.KV, self.hd)
        if pre + "self_attn.q_norm.weight" in p:  # Qwen3: RMSNorm over each head before RoPE
            q = self.rms_norm(q, p[pre + "self_attn.q_norm.weight"])
            k = self.rms_norm(k, p[pre + "self_attn.k_norm.weight"])
        q = q.transpose(0, 1)  # [H, T, hd]
        k = k.transpose(0, 1)  # [KV, T, hd]
        v = v.view(T, self.KV, self.hd).transpose(0, 1)
        q = self.rope(q, cos, sin)
        k = self.rope(k, cos, sin)
        group = self.H // self.KV
        if group > 1:  # query head h reads kv head h // group
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        if hasattr(F, "scaled_dot_product_attention"):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0: plain causal softmax attention
            s = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(self.hd))
            a = torch.bmm(torch.softmax(s, dim=-1), v)
        a = a.transpose(0, 1).reshape(T, self.H * self.hd)
        h = x + F.linear(a, p[pre + "self_attn.o_proj.weight"])
        hn = self.rms_norm(h, p[pre + "post_attention_layernorm.weight"])
        g = F.linear(hn, p[pre + "mlp.gate_proj.weight"])
        u = F.linear(hn, p[pre + "mlp.up_proj.weight"])
        return h + F.linear(F.silu(g) * u, p[pre + "mlp.down_proj.weight"])

    def loss(self, ids, labels, valid, strategy):
        """Mean token loss over the valid labels (the scaling seqgrad's Trainer::ComputeGradients uses)."""
        T = ids.shape[0]
        cos, sin = self.rope_tables(T)
        mask = None
        if not hasattr(F, "scaled_dot_product_attention"):
            mask = torch.full((T, T), float("-inf"), dtype=self.dtype).triu_(1)[None]
        x = F.embedding(ids, self.p["model.embed_tokens.weight"])
        for i in range(self.L):
            if strategy == "ckpt":
                x = torch.utils.checkpoint.checkpoint(self.layer, i, x, cos, sin, mask, use_reentrant=False)
            else:
                x = self.layer(i, x, cos, sin, mask)
        hn = self.rms_norm(x, self.p["model.norm.weight"])
        logits = F.linear(hn, self.head)
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / valid


# --- measurement ------------------------------------------------------------------------------------------------
def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def reset_peak_rss():
    """Resets VmHWM to the current RSS; returns the current RSS in bytes, or None when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        kib = _status_kib("VmRSS")
        return None if kib is None else kib * 1024
    except OSError:
        return None


def peak_rss():
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def allocator_peak(step):
    """Peak bytes the torch CPU allocator holds during step() above what it held before (torch.profiler memory
    events, replayed in order), or None when the profiler cannot say."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception as e:  # an older/newer profiler API: leave the field empty
        log(f"torch.profiler memory events unavailable: {e}")
        return None
    # start_ns in torch 2.x, start_us before; sort is stable: ties keep the recorded order.
    events.sort(key=lambda e: e.start_ns() if hasattr(e, "start_ns") else 1000 * e.start_us())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


class HFModel:
    """transformers' own causal LM class over the saved directory, with SDPA attention where it has attention
    (transformers refuses to set it on a model without)."""

    def __init__(self, model_dir, dtype, cfg):
        from transformers import AutoModelForCausalLM
        attention = {} if cfg.get("model_type") in ATTENTION_FREE_MODEL_TYPES else {"attn_implementation": "sdpa"}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **attention)
        self.model.train()
        self.ckpt = None

    def params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, ids, labels, valid, strategy):
        if self.ckpt != strategy:
            m = self.model
            m.config.use_cache = False  # a training step keeps no KV cache
            kwargs = {"use_reentrant": False}
            if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x renamed gradient_checkpointing_*
                on = lambda: m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
                off = m.activation_checkpointing_disable
            else:
                on = lambda: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
                off = m.gradient_checkpointing_disable
            on() if strategy == "ckpt" else off()
            self.ckpt = strategy
        # seqgrad's labels[t] is the target of position t: the loss is taken here on the logits rather than by HF
        # (which shifts labels itself and cannot score the last position), so both engines sum the same terms.
        logits = self.model(input_ids=ids[None]).logits[0]
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / valid


def hf_path(cfg):
    """The label's attention and scan: sdpa or none, and for a hybrid or Mamba-2 whether transformers finds the
    packages of compiled Gated DeltaNet or SSD kernels (it uses them when importable; hub kernels only on request,
    which this script does not make) or runs its torch code."""
    model_type = cfg.get("model_type")
    attention = "no attention" if model_type in ATTENTION_FREE_MODEL_TYPES else "sdpa"
    if model_type in HYBRID_MODEL_TYPES:
        scan, packages = "delta rule", ("fla", "causal_conv1d")
    elif model_type in MAMBA2_MODEL_TYPES:
        scan, packages = "SSD scan", ("mamba_ssm", "causal_conv1d")
    else:
        return attention
    import importlib.util
    found = [m for m in packages if importlib.util.find_spec(m) is not None]
    return f"{attention}, {scan}: {'+'.join(found)} installed" if found else f"{attention}, torch {scan} and conv1d"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--seq_dir", required=True)
    ap.add_argument("--strategies", default="full,ckpt")
    ap.add_argument("--seq_lens", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    ap.add_argument("--doc_len", type=int, default=1024,
                    help="full:docs, ckpt:docs: the sequence's documents of this many tokens, one by one")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f64", "bf16"],
                    help="bf16: fp32 weights under torch.autocast('cpu', bfloat16)")
    ap.add_argument("--engines", default="torch,hf",
                    help="torch (plain ops) and/or hf (transformers; skipped with a message where not installed)")
    ap.add_argument("--no_profile_memory", action="store_true",
                    help="skip the extra (untimed) profiled step that measures the allocator peak")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = torch.float64 if args.dtype == "f64" else torch.float32
    autocast = args.dtype == "bf16"
    if autocast and not hasattr(torch, "autocast"):
        raise SystemExit(f"bench_torch.py: --dtype=bf16 needs torch.autocast (torch >= 1.10; this is {torch.__version__})")
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s.removesuffix(":docs") not in STRATEGIES:
            raise SystemExit(f"bench_torch.py: unknown strategy {s!r} (known: {', '.join(STRATEGIES)})")
    seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ("torch", "hf"):
            raise SystemExit(f"bench_torch.py: unknown engine {e!r} (known: torch, hf)")

    with open(f"{args.model_dir}/config.json") as f:
        cfg = json.load(f)
    precision = "bf16 autocast" if autocast else args.dtype
    attention = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "baddbmm+softmax+bmm"
    models, labels_by_engine, skipped = {}, {}, {}
    if "torch" in engines and plain_ops_gap(cfg):
        skipped["torch"] = plain_ops_gap(cfg)
        log(f"bench_torch.py: skipping torch: {skipped['torch']}")
    elif "torch" in engines:
        models["torch"] = Llama(cfg, read_safetensors(f"{args.model_dir}/model.safetensors"), dtype)
        labels_by_engine["torch"] = f"torch {torch.__version__} plain ops ({attention}, {precision})"
    transformers_version = None
    if "hf" in engines:
        try:
            import transformers
            transformers_version = transformers.__version__
            models["hf"] = HFModel(args.model_dir, dtype, cfg)
            labels_by_engine["hf"] = (f"transformers {transformers.__version__} {cfg.get('architectures', ['?'])[0]} "
                                      f"(torch {torch.__version__}, {hf_path(cfg)}, {precision})")
        except ImportError as e:
            skipped["hf"] = f"transformers is not importable by {sys.executable}: {e}"
            log(f"bench_torch.py: skipping hf: {skipped['hf']}")

    rows = []
    for engine, model in models.items():
        params = model.params()
        # Weights and (after the first backward) gradients: what stays allocated between steps, as in seqgrad.
        resting = 2 * sum(p.numel() * p.element_size() for p in params)
        for strategy in strategies:
            for T in seq_lens:
                raw = np.fromfile(f"{args.seq_dir}/seq_{T}.i32", dtype="<i4")
                if raw.size != 2 * T:
                    raise SystemExit(f"bench_torch.py: seq_{T}.i32 holds {raw.size} int32, expected {2 * T}")
                ids = torch.from_numpy(raw[:T].astype(np.int64))
                labels = torch.from_numpy(raw[T:].astype(np.int64))
                valid = int((labels >= 0).sum())

                # :docs: the documents of --doc_len tokens one by one (each document's last label, the next one's
                # first token, ignored: what seqgrad's packed documents train), gradients summed.
                plain, docs = strategy.removesuffix(":docs"), strategy.endswith(":docs")
                pieces = [(ids, labels)]
                if docs:
                    pieces, labels = [], labels.clone()
                    for b in range(0, T, args.doc_len):
                        e = min(T, b + args.doc_len)
                        if b + args.doc_len <= T:  # the next document starts at e: its first token is no label
                            labels[e - 1] = -100
                        pieces.append((ids[b:e], labels[b:e]))
                    valid = int((labels >= 0).sum())

                def step():
                    for p in params:
                        p.grad = None
                    total = 0.0
                    for piece_ids, piece_labels in pieces:
                        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                        with ctx:
                            loss = model.loss(piece_ids, piece_labels, valid, plain)
                        loss.backward()
                        total += loss.item()
                    return total

                for _ in range(args.warmup):
                    step()
                best, best_cpu, loss, rss = math.inf, math.inf, None, None
                for _ in range(max(1, args.repeats)):
                    base = reset_peak_rss()
                    c0, t0 = time.process_time(), time.perf_counter()
                    loss = step()
                    dt = time.perf_counter() - t0
                    best = min(best, dt)
                    best_cpu = min(best_cpu, time.process_time() - c0)
                    top = peak_rss()
                    if base is not None and top is not None:
                        rss = max(rss or 0, top - base)
                alloc = None if args.no_profile_memory else allocator_peak(step)
                log(f"{engine} {strategy:>5} T={T:>6}: {best:.4f} s  {T / best:,.0f} tok/s  loss {loss:.5f}"
                    + ("" if alloc is None else f"  step peak {alloc / 2**20:.1f} MiB"))
                rows.append({
                    "engine": engine,
                    "label": labels_by_engine[engine],
                    "strategy": strategy,
                    "seq_len": T,
                    "time_s": best,
                    "cpu_s": best_cpu,  # user + system CPU seconds of the process (all threads), fastest run
                    "tokens_per_s": T / best,
                    "loss": loss,
                    "peak_bytes": None,
                    "rss_delta_bytes": rss,
                    # torch's CPU allocator: peak above the resting state during one step, and the resting state.
                    "step_peak_bytes": alloc,
                    "resting_bytes": resting,
                })
    print(json.dumps({
        "rows": rows,
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "labels": labels_by_engine,
        "skipped_engines": skipped,
        "threads": torch.get_num_threads(),
        "dtype": precision,
        "attention": attention,
    }))


if __name__ == "__main__":
    main()
