"""Exactness of seqgrad's gradients against a PyTorch autograd reference, in float64.

For a few tiny Llama / Qwen2 configs this test writes a Hugging Face model directory (config.json +
model.safetensors of random f64 weights) and a ragged JSONL batch, runs `grad_dump` (the engine: loss and every
parameter gradient of the batch, through a strategy) for several strategies, KV page sizes and LM-head chunk
sizes, and compares the result with the same model written here in plain torch ops (no `transformers`):

    embedding; per layer: RMSNorm, q/k/v projections (+ bias for qwen2 and attention_bias), Qwen3's per-head
    q_norm / k_norm, RoPE (HF rotate_half convention; rope_scaling linear, dynamic, yarn or llama3 with
    transformers' formulas, cos and sin times yarn's attention factor), GQA (repeat_interleave of k/v heads),
    causal softmax attention with scale 1/sqrt(head_dim), o_proj (+ bias for Llama / Qwen3 attention_bias),
    residual, RMSNorm, SwiGLU MLP (+ biases with mlp_bias), residual; final norm; lm_head (tied or not);
    cross-entropy of logits[:-1] against labels[1:] (-100 ignored), summed over the batch and divided by the
    number of valid labels in the batch.

Every gradient must match with max|engine - ref| / max|ref| <= 1e-9 per tensor.

The DPO and GRPO objectives (grad_dump --objective=dpo|grpo --data=FILE, through Trainer::ComputeGradients(Batch))
are written here in plain torch too, on the per-token log-probs of the same reference model (log_softmax + gather
at the positions that predict the response): random JSONL batches on each config (DPO pairs with ref_* sums; GRPO
groups of G = 3 with random advantages and old / ref per-token log-probs near the policy's, so that both branches of
the clipped surrogate occur; and an on-policy GRPO batch without old / ref log-probs and no KL term) are compared for
full, ckpt, seco, streambp and spaco (with a budget of every chunk and no cap, which is then exact).

A second test trains one step with //cli:train, saves the model, and checks that the export parses, has the
input's tensor names and shapes, and loads back into the engine with gradients matching the reference.

Binaries come from the command line (`--grad_dump=PATH --train=PATH`, set by the BUILD file's args) or from the
environment (SG_GRAD_DUMP, SG_TRAIN), or are looked up in the runfiles tree.
"""
import atexit
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)
torch.set_num_threads(min(2, os.cpu_count() or 1))

TOLERANCE = 1e-9

# Strategies whose gradients are exact (spaco, being unbiased but stochastic, is not). Those that the binary does
# not know (yet) are skipped; chunked ones also run with several chunk sizes.
EXACT_STRATEGIES = ["full", "ckpt", "seco", "streambp"]
CHUNKED_STRATEGIES = {"seco", "streambp"}
PAGE_SIZES = [4, 5, 16, 256]
LM_CHUNKS = [7, 1000]
CHUNKS = [4, 16, 29]
# OpenMP thread counts for extra runs (the attention backward splits key pages into per-thread stripes).
THREAD_COUNTS = [1, 3]

# DPO / GRPO (--objective): options passed to grad_dump and used by the reference (not the engine's defaults, so
# that the flags are seen to reach the trainer).
DPO_BETA = 0.5
GRPO_CLIP_EPS = 0.25
GRPO_KL_BETA = 0.1
GRPO_G = 3
# prompt + response lengths in tokens, so the engine's sequences (the last token is a label only) have 25..32
# positions: every sequence of a DPO / GRPO batch has the same number of chunks for these chunk sizes, as spaco with
# a budget of all chunks (then exact) needs.
OBJECTIVE_TOKENS = (26, 33)
SPACO_CHUNKS = [8, 16]


# ----------------------------------------------------------------------------------------------------------------
# Binaries
# ----------------------------------------------------------------------------------------------------------------

def _runfile(rel):
    for root in (os.environ.get("RUNFILES_DIR"), os.environ.get("TEST_SRCDIR")):
        if not root:
            continue
        for ws in (os.environ.get("TEST_WORKSPACE"), "seqgrad"):
            if ws and os.path.exists(os.path.join(root, ws, rel)):
                return os.path.join(root, ws, rel)
    return rel if os.path.exists(rel) else None


def _binary(env_name, rel):
    path = os.environ.get(env_name) or _runfile(rel)
    if path and os.path.exists(path):
        return os.path.abspath(path)
    return None


def grad_dump_path():
    path = _binary("SG_GRAD_DUMP", "tests/torch_ref/grad_dump")
    if path is None:
        pytest.fail("grad_dump binary not found (pass --grad_dump=PATH or set SG_GRAD_DUMP)")
    return path


def train_path():
    return _binary("SG_TRAIN", "cli/train")


def run(cmd, check=True, threads=None):
    env = dict(os.environ)
    # Spinning OpenMP workers make the many tiny parallel regions crawl on a loaded machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if check and proc.returncode != 0:
        pytest.fail(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                    f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


_VENV_PYTHON = []


def venv_json(script, *args):
    """Runs script in the venv of tests/e2e/pip_venv.sh (torch, transformers and peft from PyPI; --pip_venv=PATH or
    SG_PIP_VENV names the script) with args; returns what it prints, as JSON."""
    if not _VENV_PYTHON:
        pip_venv = os.environ.get("SG_PIP_VENV") or _runfile("tests/e2e/pip_venv.sh")
        if not pip_venv:
            pytest.fail("tests/e2e/pip_venv.sh not found (pass --pip_venv=PATH or set SG_PIP_VENV)")
        _VENV_PYTHON.append(os.path.join(run(["bash", pip_venv]).stdout.strip(), "bin", "python"))
    return json.loads(run([_VENV_PYTHON[0], os.path.abspath(script), *args]).stdout)


def scratch_dir(prefix):
    if os.environ.get("TEST_TMPDIR"):  # Bazel cleans it up
        return tempfile.mkdtemp(prefix=prefix, dir=os.environ["TEST_TMPDIR"])
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------------------------------------------
# safetensors: [u64 LE header length][JSON header][data]
# ----------------------------------------------------------------------------------------------------------------

_NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: float64 numpy array}, written as F64 in insertion order."""
    header = {}
    blobs = []
    offset = 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f8").tobytes()
        header[name] = {"dtype": "F64", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    """Returns ({name: numpy array (F64/F32/F16/BF16 as float64)}, {name: dtype string}, metadata)."""
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) >= 8, f"{path}: too short"
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw), f"{path}: header length {n} exceeds the file"
    header = json.loads(raw[8:8 + n].decode())
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {}) or {}
    tensors, dtypes = {}, {}
    end_max = 0
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        dtype = info["dtype"]
        assert 0 <= begin <= end <= len(data), f"{path}: '{name}' offsets {begin}..{end} out of range"
        chunk = data[begin:end]
        if dtype == "BF16":
            bits = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
            array = bits.view(np.float32).astype(np.float64)
        else:
            array = np.frombuffer(chunk, dtype=np.dtype(_NP_DTYPES[dtype]).newbyteorder("<"))
            if array.dtype.kind == "f":
                array = array.astype(np.float64)
        assert array.size == int(np.prod(shape, dtype=np.int64)), f"{path}: '{name}' size does not match {shape}"
        tensors[name] = array.reshape(shape)
        dtypes[name] = dtype
        end_max = max(end_max, end)
    assert end_max == len(data), f"{path}: {len(data) - end_max} trailing bytes after the last tensor"
    return tensors, dtypes, metadata


# ----------------------------------------------------------------------------------------------------------------
# Configs, weights, batches
# ----------------------------------------------------------------------------------------------------------------

CONFIGS = {
    # GQA (2 query heads per kv head), untied head, 3 layers; one sequence longer than the attention kernel's
    # 64-row query block.
    "llama_gqa": dict(
        hf={"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 61, "hidden_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": False, "hidden_act": "silu"},
        lengths=[37, 100, 5], seed=1),
    # Qwen2: q/k/v biases, tied embeddings, a single kv head (MQA).
    "qwen2_tied": dict(
        hf={"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 53, "hidden_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 40,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 512,
            "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False},
        lengths=[70, 12, 41], seed=2),
    # Llama-3 RoPE scaling with original_max_position_embeddings = 16 so it changes the result at these lengths
    # (rope_theta 100 puts two frequencies in the interpolated band and the rest in the divided one); no GQA;
    # head_dim given explicitly and different from hidden_size / num_heads.
    "llama_rope_scaled": dict(
        hf={"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 47, "hidden_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 36, "rms_norm_eps": 1e-6, "rope_theta": 100.0, "max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16},
            "tie_word_embeddings": False, "hidden_act": "silu"},
        lengths=[66, 3, 41], seed=3),
}


# RoPE scaling types, Qwen3 and Llama's biases: each through every exact strategy with fewer settings (FAMILY_RUNS).
FAMILY_CONFIGS = {
    "llama_linear": dict(
        hf={"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 41, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
            "rms_norm_eps": 1e-6, "rope_theta": 50.0, "max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "linear", "factor": 2.5}, "tie_word_embeddings": False,
            "hidden_act": "silu"},
        lengths=[45, 7, 30], seed=11),
    # Dynamic NTK: the base grows with each sequence's length past max_position_embeddings = 24 (61 and 30 here;
    # 9 keeps it), so chunks of 4..29 must use the whole sequence's length.
    "llama_dynamic": dict(
        hf={"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 43, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "intermediate_size": 24, "rms_norm_eps": 1e-6, "max_position_embeddings": 24,
            "rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 100.0},
            "tie_word_embeddings": True, "hidden_act": "silu"},
        lengths=[61, 9, 30], seed=12),
    # YaRN as Qwen2.5's recipe writes it (old "type" key), on a small context so that the ramp between
    # beta_fast and beta_slow spans several frequencies; the attention factor derived from factor.
    "qwen2_yarn": dict(
        hf={"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 37, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 40,
            "rms_norm_eps": 1e-6, "rope_theta": 100.0, "max_position_embeddings": 256,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False},
        lengths=[50, 11, 33], seed=13),
    # Qwen3: per-head q_norm / k_norm, head_dim (12) unlike hidden_size / heads (6), GQA, transformers 5's
    # rope_parameters and layer_types.
    "qwen3": dict(
        hf={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 47, "hidden_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
            "intermediate_size": 36, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "layer_types": ["full_attention", "full_attention"], "attention_bias": False,
            "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False},
        lengths=[40, 6, 27], seed=14),
    # Qwen3 with attention_bias (q/k/v/o) and YaRN with DeepSeek's mscale / mscale_all_dim, no truncation, own
    # beta_fast / beta_slow.
    "qwen3_yarn_bias": dict(
        hf={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 39, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 24, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                             "beta_fast": 16.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5,
                             "truncate": False},
            "rope_theta": 500.0, "attention_bias": True, "tie_word_embeddings": False, "hidden_act": "silu"},
        lengths=[20, 35], seed=15),
    # Llama with attention_bias (q/k/v/o) and mlp_bias (gate/up/down).
    "llama_biases": dict(
        hf={"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 45, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 28,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
            "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False, "hidden_act": "silu"},
        lengths=[38, 13], seed=16),
}
ALL_CONFIGS = {**CONFIGS, **FAMILY_CONFIGS}
# (strategy, page_size, lm_chunk, chunk) for FAMILY_CONFIGS.
FAMILY_RUNS = [("full", 5, 7, 512), ("full", 256, 1000, 512), ("ckpt", 4, 1000, 512), ("seco", 5, 7, 4),
               ("seco", 16, 1000, 16), ("seco", 4, 3, 29), ("streambp", 5, 7, 4), ("streambp", 16, 1000, 16),
               ("streambp", 4, 3, 29)]


def dims(hf):
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim", hf["hidden_size"] // heads)
    return heads, kv_heads, head_dim


def make_weights(hf, seed):
    """Random f64 weights under HF names: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    d, f, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    heads, kv_heads, hd = dims(hf)
    qd, kvd = heads * hd, kv_heads * hd
    bias, o_bias, mlp_bias, qk_norm = biases(hf)

    def mat(out, inp, scale=1.0):
        return rng.normal(0.0, scale / math.sqrt(inp), size=(out, inp))

    def norm(n):
        return 1.0 + 0.1 * rng.normal(size=n)

    w = {"model.embed_tokens.weight": rng.normal(0.0, 0.7, size=(V, d))}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(qd, d, 1.5)
        w[p + "self_attn.k_proj.weight"] = mat(kvd, d, 1.5)
        w[p + "self_attn.v_proj.weight"] = mat(kvd, d)
        if bias:
            w[p + "self_attn.q_proj.bias"] = 0.1 * rng.normal(size=qd)
            w[p + "self_attn.k_proj.bias"] = 0.1 * rng.normal(size=kvd)
            w[p + "self_attn.v_proj.bias"] = 0.1 * rng.normal(size=kvd)
        w[p + "self_attn.o_proj.weight"] = mat(d, qd)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = 0.1 * rng.normal(size=d)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = mat(f, d)
        w[p + "mlp.up_proj.weight"] = mat(f, d)
        w[p + "mlp.down_proj.weight"] = mat(d, f)
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = 0.1 * rng.normal(size=f)
            w[p + "mlp.up_proj.bias"] = 0.1 * rng.normal(size=f)
            w[p + "mlp.down_proj.bias"] = 0.1 * rng.normal(size=d)
    w["model.norm.weight"] = norm(d)
    if not hf.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(V, d, 2.0)
    return w


def make_batch(hf, lengths, seed):
    """HF convention: labels as long as input_ids, unshifted, -100 = ignored. Labels are mostly the inputs (as in
    causal LM training), some replaced by other tokens, some masked; in the longest sequence a run of 15 labels is
    masked so that a whole LM-head chunk of 7 rows has no valid label."""
    rng = np.random.default_rng(1000 + seed)
    V = hf["vocab_size"]
    batch = []
    longest = int(np.argmax(lengths))
    for s, n in enumerate(lengths):
        ids = rng.integers(0, V, size=n)
        labels = ids.copy()
        swap = rng.random(n) < 0.2
        labels[swap] = rng.integers(0, V, size=int(swap.sum()))
        labels[rng.random(n) < 0.2] = -100
        labels[0] = -100  # never used (shifted out); HF masks prompts like this
        if s == longest:
            labels[1:16] = -100
        if (labels[1:] >= 0).sum() == 0:
            labels[-1] = ids[-1]
        batch.append((ids.tolist(), labels.tolist()))
    return batch


def write_model_dir(path, hf, weights):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), weights, {"format": "pt"})


def write_jsonl(path, batch):
    with open(path, "w") as f:
        for ids, labels in batch:
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")


def make_prompt_response(rng, V, n_prompt=None):
    """(prompt length: 3..10, or n_prompt; random response tokens) such that prompt + response has between
    OBJECTIVE_TOKENS[0] and OBJECTIVE_TOKENS[1] tokens."""
    n_prompt = int(rng.integers(3, 11)) if n_prompt is None else n_prompt
    total = int(rng.integers(OBJECTIVE_TOKENS[0], OBJECTIVE_TOKENS[1] + 1))
    return n_prompt, rng.integers(0, V, size=total - n_prompt).tolist()


def make_dpo_data(hf, weights, seed, pairs=3):
    """DPO pairs {prompt, chosen, rejected, ref_chosen_logp, ref_rejected_logp}: the reference sums are the policy's
    own response log-prob sums plus N(0, 2^2) noise, so that beta * margin is O(1) and the sigmoid is not saturated."""
    rng = np.random.default_rng(2000 + seed)
    V = hf["vocab_size"]
    W = leaf_weights(weights)
    data = []
    for _ in range(pairs):
        n_prompt, chosen = make_prompt_response(rng, V)
        prompt = rng.integers(0, V, size=n_prompt).tolist()
        _, rejected = make_prompt_response(rng, V, n_prompt)
        row = dict(prompt=prompt, chosen=chosen, rejected=rejected)
        with torch.no_grad():
            for key in ("chosen", "rejected"):
                pi = float(response_logprobs(hf, W, prompt, row[key]).sum())
                row[f"ref_{key}_logp"] = pi + float(rng.normal(0.0, 2.0))
        data.append(row)
    return data


def make_grpo_data(hf, weights, seed, groups=2, old=True, ref=True):
    """GRPO groups {prompt, completions (G = GRPO_G), advantages ~ N(0, 1), old_logprobs, ref_logprobs}: the
    per-token old / ref log-probs are the policy's own plus N(0, 0.3^2) noise, so that the ratio r leaves the clip
    range [1 - eps, 1 + eps] on both sides (check_grpo_branches)."""
    rng = np.random.default_rng(3000 + seed)
    V = hf["vocab_size"]
    W = leaf_weights(weights)
    data = []
    for _ in range(groups):
        n_prompt = int(rng.integers(3, 11))
        row = dict(prompt=rng.integers(0, V, size=n_prompt).tolist(), completions=[],
                   advantages=rng.normal(size=GRPO_G).tolist())
        if old:
            row["old_logprobs"] = []
        if ref:
            row["ref_logprobs"] = []
        for _ in range(GRPO_G):
            _, completion = make_prompt_response(rng, V, n_prompt)
            row["completions"].append(completion)
            with torch.no_grad():
                lp = response_logprobs(hf, W, row["prompt"], completion).numpy()
            for key in ("old_logprobs", "ref_logprobs"):
                if key in row:
                    row[key].append((lp + rng.normal(0.0, 0.3, size=lp.shape)).tolist())
        data.append(row)
    return data


def write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Reference model (plain torch, float64)
# ----------------------------------------------------------------------------------------------------------------

def rope_block(hf):
    """(rope_theta, the rope_scaling / rope_parameters dict with transformers' standardisation, or None)."""
    rs = hf.get("rope_parameters") or hf.get("rope_scaling")
    theta = float((rs or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    if not rs or rs.get("rope_type", rs.get("type")) == "default":
        return theta, None
    rs = dict(rs, rope_type=rs.get("rope_type", rs.get("type")))
    if rs["rope_type"] in ("llama3", "yarn"):
        if "original_max_position_embeddings" in hf:
            rs["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rs.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return theta, rs


def rope_parameters(hf, seq_len, apply_scaling=True):
    """(inverse frequencies, attention factor) as transformers' modeling_rope_utils computes them (in float64) for a
    sequence of seq_len tokens (the dynamic type's seq_len = max(position_ids) + 1)."""
    _, _, hd = dims(hf)
    base, rs = rope_block(hf)
    if not apply_scaling or rs is None:
        return base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd), 1.0
    kind, factor = rs["rope_type"], rs.get("factor")
    exponents = torch.arange(0, hd, 2, dtype=torch.float64) / hd
    if kind == "linear":  # _compute_linear_scaling_rope_parameters
        return 1.0 / base ** exponents / factor, 1.0
    if kind == "dynamic":  # _compute_dynamic_ntk_parameters
        mpe = hf["max_position_embeddings"]
        length = max(seq_len, mpe)
        base = base * ((factor * length / mpe) - (factor - 1)) ** (hd / (hd - 2))
        return 1.0 / base ** exponents, 1.0
    if kind == "yarn":  # _compute_yarn_parameters
        old_ctx = rs["original_max_position_embeddings"]
        if factor is None:
            factor = hf["max_position_embeddings"] / old_ctx

        def get_mscale(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = rs.get("attention_factor")
        if attention_factor is None:
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                attention_factor = get_mscale(factor, rs["mscale"]) / get_mscale(factor, rs["mscale_all_dim"])
            else:
                attention_factor = get_mscale(factor)
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def correction_dim(rotations):
            return hd * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(hd // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        pos_freqs = base ** exponents
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, attention_factor
    assert kind == "llama3", kind  # _compute_llama3_parameters
    inv = base ** -exponents
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def biases(hf):
    """(q/k/v bias, o_proj bias, mlp biases, Qwen3's q_norm / k_norm) of the config, as transformers builds it."""
    kind = hf["model_type"]
    attention_bias = hf.get("attention_bias", False)
    return (kind == "qwen2" or attention_bias, kind != "qwen2" and attention_bias,
            kind == "llama" and hf.get("mlp_bias", False), kind == "qwen3")


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def leaf_weights(weights, dtype=torch.float64):
    return {k: torch.tensor(v, dtype=torch.float64).to(dtype).requires_grad_() for k, v in weights.items()}


def forward_logits(hf, W, ids, apply_rope_scaling=True):
    """Logits [T, vocab] of the model with parameters W (torch tensors under HF names) at every position of ids."""
    heads, kv_heads, hd = dims(hf)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    bias, o_bias, mlp_bias, qk_norm = biases(hf)
    head = W["model.embed_tokens.weight"] if hf.get("tie_word_embeddings", False) else W["lm_head.weight"]
    T = len(ids)
    inv, attention_factor = rope_parameters(hf, T, apply_rope_scaling)

    def proj(x, name, with_bias=bias):
        y = x @ W[name + ".weight"].T
        return y + W[name + ".bias"] if with_bias else y

    def heads_of(x, name, n):  # [T, n * hd] -> [n, T, hd], through Qwen3's per-head norm
        x = x.view(T, n, hd)
        return (rms_norm(x, W[name + ".weight"], eps) if qk_norm else x).transpose(0, 1)

    ids_t = torch.tensor(ids, dtype=torch.long)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    dtype = W["model.embed_tokens.weight"].dtype  # bf16 models (bf16_accuracy_test.py) rotate in bf16
    cos, sin = (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)  # [T, hd]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)

    x = W["model.embed_tokens.weight"][ids_t]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xn = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = heads_of(proj(xn, p + "self_attn.q_proj"), p + "self_attn.q_norm", heads)
        k = heads_of(proj(xn, p + "self_attn.k_proj"), p + "self_attn.k_norm", kv_heads)
        v = proj(xn, p + "self_attn.v_proj").view(T, kv_heads, hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        attn = (probs @ v).transpose(0, 1).reshape(T, heads * hd)
        h = x + proj(attn, p + "self_attn.o_proj", o_bias)
        hn = rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)
        gate = proj(hn, p + "mlp.gate_proj", mlp_bias)
        up = proj(hn, p + "mlp.up_proj", mlp_bias)
        x = h + proj(F.silu(gate) * up, p + "mlp.down_proj", mlp_bias)
    return rms_norm(x, W["model.norm.weight"], eps) @ head.T


def reference(hf, weights, batch, apply_rope_scaling=True, logits_fn=None, dtype=torch.float64):
    """Returns (mean token loss, {name: gradient}) as float64, computed by torch autograd in `dtype`.
    logits_fn(hf, W, ids): another model family."""
    W = leaf_weights(weights, dtype)
    loss_sum = torch.zeros((), dtype=torch.float64)
    valid = 0
    for ids, labels in batch:
        labels_t = torch.tensor(labels, dtype=torch.long)
        logits = logits_fn(hf, W, ids) if logits_fn else forward_logits(hf, W, ids, apply_rope_scaling)
        loss_sum = loss_sum + F.cross_entropy(logits[:-1], labels_t[1:], ignore_index=-100, reduction="sum")
        valid += int((labels_t[1:] != -100).sum())
    loss = loss_sum / valid
    loss.backward()
    return loss.item(), {k: t.grad.double().numpy().copy() for k, t in W.items()}


def response_logprobs(hf, W, prompt, response):
    """log p(response[j] | prompt + response[:j]) for every j: log_softmax of the logits at the positions that predict
    the response tokens (the last token is only predicted, so the model runs on prompt + response[:-1])."""
    tokens = list(prompt) + list(response)
    logits = forward_logits(hf, W, tokens[:-1])[len(prompt) - 1:]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0]


def reference_dpo(hf, weights, pairs, beta):
    """Mean over pairs of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), pi = response log-prob sum."""
    W = leaf_weights(weights)
    loss = torch.zeros((), dtype=torch.float64)
    for p in pairs:
        pi_c = response_logprobs(hf, W, p["prompt"], p["chosen"]).sum()
        pi_r = response_logprobs(hf, W, p["prompt"], p["rejected"]).sum()
        z = beta * ((pi_c - p["ref_chosen_logp"]) - (pi_r - p["ref_rejected_logp"]))
        loss = loss - F.logsigmoid(z)
    loss = loss / len(pairs)
    loss.backward()
    return loss.item(), {k: t.grad.double().numpy().copy() for k, t in W.items()}


def grpo_ratios(hf, weights, groups):
    """Per completion token: (ratio r = exp(logp - old), advantage) under the given weights."""
    W = leaf_weights(weights)
    out = []
    with torch.no_grad():
        for g in groups:
            for i, completion in enumerate(g["completions"]):
                lp = response_logprobs(hf, W, g["prompt"], completion).numpy()
                r = np.exp(lp - np.asarray(g["old_logprobs"][i]))
                out += [(float(x), g["advantages"][i]) for x in r]
    return out


def reference_grpo(hf, weights, groups, clip_eps, kl_beta):
    """sum over groups b, completions i, tokens t of
         (-min(r A_i, clip(r, 1 - eps, 1 + eps) A_i) + kl_beta r (e^x - x - 1)) / (|o_i| G B),
    r = exp(logp - old) (old absent: logp detached, r = 1), x = ref - logp; the KL term bias-corrected (times r), the
    engine's default as TRL's."""
    W = leaf_weights(weights)
    B = len(groups)
    loss = torch.zeros((), dtype=torch.float64)
    for g in groups:
        G = len(g["completions"])
        for i, completion in enumerate(g["completions"]):
            lp = response_logprobs(hf, W, g["prompt"], completion)
            old = torch.tensor(g["old_logprobs"][i]) if "old_logprobs" in g else lp.detach()
            A = g["advantages"][i]
            r = torch.exp(lp - old)
            term = -torch.minimum(r * A, torch.clamp(r, 1 - clip_eps, 1 + clip_eps) * A)
            if kl_beta > 0:
                x = torch.tensor(g["ref_logprobs"][i]) - lp
                term = term + kl_beta * r * (torch.exp(x) - x - 1)
            loss = loss + term.sum() / (len(completion) * G * B)
    loss.backward()
    return loss.item(), {k: t.grad.double().numpy().copy() for k, t in W.items()}


# ----------------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------------

def rel_error(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


def compare(engine, ref, label):
    """engine / ref: (loss, {name: grad}). Returns (worst relative error, worst tensor name); fails past TOLERANCE."""
    e_loss, e_grads = engine
    r_loss, r_grads = ref
    assert sorted(e_grads) == sorted(r_grads), (
        f"{label}: gradient names differ: engine-only {sorted(set(e_grads) - set(r_grads))}, "
        f"reference-only {sorted(set(r_grads) - set(e_grads))}")
    loss_err = abs(e_loss - r_loss) / abs(r_loss)
    errors = {}
    for name, g in r_grads.items():
        assert e_grads[name].shape == g.shape, f"{label}: {name} shape {e_grads[name].shape} != {g.shape}"
        assert np.all(np.isfinite(e_grads[name])), f"{label}: {name} has non-finite entries"
        errors[name] = rel_error(e_grads[name], g)
    worst = max(errors, key=errors.get)
    print(f"{label}: loss {e_loss:.15f} (ref {r_loss:.15f}, rel err {loss_err:.2e}); "
          f"worst gradient {worst}: rel err {errors[worst]:.2e}")
    bad = sorted(((e, n) for n, e in errors.items() if e > TOLERANCE), reverse=True)
    assert loss_err <= TOLERANCE, f"{label}: loss {e_loss!r} vs reference {r_loss!r} (rel err {loss_err:.3e})"
    assert not bad, f"{label}: gradients differ from the reference:\n" + "\n".join(
        f"  {n}: max rel err {e:.3e}" for e, n in bad)
    return max(loss_err, errors[worst]), worst


def grad_dump(model_dir, data, out, strategy, page_size, lm_chunk, chunk=512, threads=None, objective="sft",
              flags=()):
    """Runs grad_dump on a batch (sft: --batch_jsonl, else --data); returns (loss, {name: grad}, metadata)."""
    data_flag = "--batch_jsonl" if objective == "sft" else "--data"
    run([grad_dump_path(), f"--model_dir={model_dir}", f"{data_flag}={data}", f"--objective={objective}",
         f"--strategy={strategy}", f"--chunk={chunk}", f"--page_size={page_size}", f"--lm_chunk={lm_chunk}",
         f"--out={out}", *flags], threads=threads)
    tensors, dtypes, metadata = read_safetensors(out)
    assert set(dtypes.values()) == {"F64"}, dtypes
    assert "loss" in metadata, metadata
    assert metadata.get("objective") == objective, metadata
    return float(metadata["loss"]), tensors, metadata


def run_grad_dump(model_dir, jsonl, out, strategy, page_size, lm_chunk, chunk=512, threads=None):
    loss, tensors, _ = grad_dump(model_dir, jsonl, out, strategy, page_size, lm_chunk, chunk, threads)
    return loss, tensors


# ----------------------------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------------------------

_CASES = {}


def case(name):
    """Writes the model dir and batch for config `name` once, with its reference loss and gradients."""
    if name not in _CASES:
        spec = ALL_CONFIGS[name]
        root = scratch_dir(f"torch_ref_{name}_")
        weights = make_weights(spec["hf"], spec["seed"])
        batch = make_batch(spec["hf"], spec["lengths"], spec["seed"])
        model_dir = os.path.join(root, "model")
        write_model_dir(model_dir, spec["hf"], weights)
        jsonl = os.path.join(root, "batch.jsonl")
        write_jsonl(jsonl, batch)
        _CASES[name] = dict(root=root, model_dir=model_dir, jsonl=jsonl, weights=weights, batch=batch,
                            ref=reference(spec["hf"], weights, batch))
    return _CASES[name]


_KNOWN = None


def known_strategies():
    """Names the binary accepts (an unknown name is an error that lists the known ones)."""
    global _KNOWN
    if _KNOWN is None:
        _KNOWN = [s for s in EXACT_STRATEGIES if _accepts_strategy(s)]
    return _KNOWN


def _accepts_strategy(name):
    c = case("llama_gqa")
    out = os.path.join(c["root"], f"probe_{name}.safetensors")
    proc = run([grad_dump_path(), f"--model_dir={c['model_dir']}", f"--batch_jsonl={c['jsonl']}",
                f"--strategy={name}", f"--out={out}"], check=False)
    if proc.returncode == 0:
        return True
    assert "unknown strategy" in proc.stderr, f"--strategy={name} failed:\n{proc.stderr}"
    return False


def strategy_runs(strategy):
    runs = []
    for page_size in PAGE_SIZES:
        for lm_chunk in LM_CHUNKS:
            if strategy in CHUNKED_STRATEGIES:
                runs += [dict(page_size=page_size, lm_chunk=lm_chunk, chunk=c) for c in CHUNKS]
            else:
                runs.append(dict(page_size=page_size, lm_chunk=lm_chunk))
    extra = dict(chunk=CHUNKS[0]) if strategy in CHUNKED_STRATEGIES else {}
    runs += [dict(page_size=PAGE_SIZES[0], lm_chunk=LM_CHUNKS[0], threads=t, **extra) for t in THREAD_COUNTS]
    return runs


# DPO / GRPO batches: name -> (--objective, data maker, reference, grad_dump flags).
OBJECTIVES = {
    "dpo": ("dpo", make_dpo_data, lambda hf, w, rows: reference_dpo(hf, w, rows, DPO_BETA),
            [f"--dpo_beta={DPO_BETA!r}"]),
    # old_logprobs (clipped and unclipped branches) and ref_logprobs (k3 KL term).
    "grpo": ("grpo", make_grpo_data, lambda hf, w, rows: reference_grpo(hf, w, rows, GRPO_CLIP_EPS, GRPO_KL_BETA),
             [f"--grpo_clip_eps={GRPO_CLIP_EPS!r}", f"--grpo_kl_beta={GRPO_KL_BETA!r}"]),
    # Neither: old = the current policy (r = 1), and no KL term.
    "grpo_on_policy": ("grpo", lambda hf, w, seed: make_grpo_data(hf, w, seed + 50, old=False, ref=False),
                       lambda hf, w, rows: reference_grpo(hf, w, rows, GRPO_CLIP_EPS, 0.0),
                       [f"--grpo_clip_eps={GRPO_CLIP_EPS!r}", "--grpo_kl_beta=0"]),
}
OBJECTIVE_STRATEGIES = ["full", "ckpt", "seco", "streambp", "spaco"]

_OBJECTIVE_CASES = {}


def objective_sequence_lengths(rows):
    """Positions of every engine sequence of a DPO / GRPO batch (prompt + response, less the last token)."""
    lengths = []
    for row in rows:
        for response in ([row["chosen"], row["rejected"]] if "chosen" in row else row["completions"]):
            lengths.append(len(row["prompt"]) + len(response) - 1)
    return lengths


def check_grpo_branches(hf, weights, rows, label):
    """Both branches of min(r A, clip(r) A) occur: tokens where the clipped, constant branch wins (no surrogate
    gradient), tokens outside the clip range where r A wins, and tokens inside it; and no ratio lies within 1e-6 of
    a clip bound, where rounding could pick the other branch."""
    lo, hi = 1 - GRPO_CLIP_EPS, 1 + GRPO_CLIP_EPS
    clipped = unclipped_outside = inside = 0
    for r, a in grpo_ratios(hf, weights, rows):
        assert min(abs(r - lo), abs(r - hi)) > 1e-6, f"{label}: ratio {r!r} too close to a clip bound"
        if lo < r < hi:
            inside += 1
        elif (a > 0) == (r > hi):
            clipped += 1
        else:
            unclipped_outside += 1
    print(f"{label}: grpo tokens: {clipped} clipped, {unclipped_outside} unclipped outside the clip range, "
          f"{inside} inside")
    assert clipped > 0 and unclipped_outside > 0 and inside > 0, (clipped, unclipped_outside, inside)


def objective_case(config, name):
    """The data file and reference (loss, gradients) of objective batch `name` on config's model."""
    key = (config, name)
    if key not in _OBJECTIVE_CASES:
        spec = CONFIGS[config]
        c = case(config)
        objective, make, ref, flags = OBJECTIVES[name]
        rows = make(spec["hf"], c["weights"], spec["seed"])
        if "old_logprobs" in rows[0]:
            check_grpo_branches(spec["hf"], c["weights"], rows, f"{config}/{name}")
        data = os.path.join(c["root"], f"{name}.jsonl")
        write_rows(data, rows)
        _OBJECTIVE_CASES[key] = dict(model_dir=c["model_dir"], root=c["root"], data=data, rows=rows,
                                     objective=objective, flags=flags, lengths=objective_sequence_lengths(rows),
                                     ref=ref(spec["hf"], c["weights"], rows))
    return _OBJECTIVE_CASES[key]


def objective_runs(strategy, lengths):
    """grad_dump settings per strategy for DPO / GRPO batches (sequences of 25..32 positions): chunked strategies
    with 7-8, 2 and 1-2 chunks; spaco with a budget of all chunks and no cap, which makes it exact."""
    if strategy == "full":
        return [dict(page_size=5, lm_chunk=7), dict(page_size=256, lm_chunk=1000),
                dict(page_size=4, lm_chunk=3, threads=THREAD_COUNTS[-1])]
    if strategy == "ckpt":
        return [dict(page_size=5, lm_chunk=7)]
    if strategy == "spaco":
        runs = []
        for chunk in SPACO_CHUNKS:
            ks = {-(-n // chunk) for n in lengths}
            assert len(ks) == 1, f"sequences of {sorted(set(lengths))} positions have {sorted(ks)} chunks of {chunk}"
            runs.append(dict(page_size=5, lm_chunk=7, chunk=chunk,
                             flags=[f"--spaco_budget={ks.pop()}", "--spaco_cap=0", "--seed=11"]))
        return runs
    return [dict(page_size=ps, lm_chunk=lm, chunk=c) for c, ps, lm in zip(CHUNKS, (5, 16, 4), (7, 1000, 3))]


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------

def test_reference_self_check():
    """The reference itself: RoPE scaling changes the loss of the scaled config (so that config tests it), and
    autograd's directional derivative agrees with central finite differences."""
    spec = CONFIGS["llama_rope_scaled"]
    c = case("llama_rope_scaled")
    unscaled_loss, _ = reference(spec["hf"], c["weights"], c["batch"], apply_rope_scaling=False)
    assert abs(unscaled_loss - c["ref"][0]) > 1e-4 * abs(c["ref"][0]), (unscaled_loss, c["ref"][0])
    for name in ("llama_linear", "llama_dynamic", "qwen2_yarn", "qwen3_yarn_bias"):
        spec, c = FAMILY_CONFIGS[name], case(name)
        unscaled_loss, _ = reference(spec["hf"], c["weights"], c["batch"], apply_rope_scaling=False)
        assert abs(unscaled_loss - c["ref"][0]) > 1e-4 * abs(c["ref"][0]), (name, unscaled_loss, c["ref"][0])
    # Dynamic NTK: the frequencies of a sequence depend on its whole length past max_position_embeddings (24), not
    # below it; yarn's ramp leaves some frequencies kept, some divided and some between.
    dynamic = FAMILY_CONFIGS["llama_dynamic"]["hf"]
    assert torch.equal(rope_parameters(dynamic, 9)[0], rope_parameters(dynamic, 24)[0])
    assert not torch.allclose(rope_parameters(dynamic, 61)[0], rope_parameters(dynamic, 30)[0])
    for name in ("qwen2_yarn", "qwen3_yarn_bias"):
        hf = FAMILY_CONFIGS[name]["hf"]
        inv, attention_factor = rope_parameters(hf, 1)
        plain, _ = rope_parameters(hf, 1, apply_scaling=False)
        ratio = plain / inv
        factor = hf["rope_scaling"]["factor"]
        kept, divided = torch.isclose(ratio, torch.tensor(1.0)), torch.isclose(ratio, torch.tensor(float(factor)))
        assert kept.any() and divided.any(), (name, ratio)
        assert ((ratio > 1.001) & (ratio < factor * 0.999)).any(), (name, ratio)
        assert attention_factor != 1, (name, attention_factor)
    hf = CONFIGS["qwen2_tied"]["hf"]
    cq = case("qwen2_tied")
    loss, grads = cq["ref"]
    rng = np.random.default_rng(7)
    direction = {k: rng.normal(size=v.shape) for k, v in cq["weights"].items()}
    eps = 1e-5
    plus = {k: v + eps * direction[k] for k, v in cq["weights"].items()}
    minus = {k: v - eps * direction[k] for k, v in cq["weights"].items()}
    fd = (reference(hf, plus, cq["batch"])[0] - reference(hf, minus, cq["batch"])[0]) / (2 * eps)
    analytic = sum(float(np.sum(grads[k] * direction[k])) for k in grads)
    assert abs(fd - analytic) <= 1e-6 * max(1.0, abs(analytic)), (fd, analytic)

    # response_logprobs (DPO / GRPO) agrees with the cross-entropy of the same prompt + response labelled on the
    # response only, HF style.
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, hf["vocab_size"], size=5).tolist()
    response = rng.integers(0, hf["vocab_size"], size=9).tolist()
    with torch.no_grad():
        lp = response_logprobs(hf, leaf_weights(cq["weights"]), prompt, response)
    ce, _ = reference(hf, cq["weights"], [(prompt + response, [-100] * len(prompt) + response)])
    assert abs(-float(lp.mean()) - ce) <= 1e-12 * abs(ce), (-float(lp.mean()), ce)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gradients_match_torch(config):
    c = case(config)
    strategies = known_strategies()
    assert "full" in strategies and "ckpt" in strategies, strategies
    summary = []
    for strategy in strategies:
        worst = (0.0, "")
        for r in strategy_runs(strategy):
            label = f"{config}/{strategy} " + " ".join(f"{k}={v}" for k, v in r.items())
            out = os.path.join(c["root"], "grads.safetensors")
            engine = run_grad_dump(c["model_dir"], c["jsonl"], out, strategy, **r)
            worst = max(worst, compare(engine, c["ref"], label))
        summary.append(f"{config}/{strategy}: max rel err {worst[0]:.2e} ({worst[1]})")
    print("\n".join(["SUMMARY"] + summary))


@pytest.mark.parametrize("config", sorted(FAMILY_CONFIGS))
def test_family_gradients_match_torch(config):
    """RoPE scaling types, Qwen3 and Llama's biases: loaded from the HF directory the test writes, exact against the
    reference for full, ckpt, seco and streambp (chunks shorter than the sequences, several page sizes)."""
    c = case(config)
    summary = []
    for strategy, page_size, lm_chunk, chunk in FAMILY_RUNS:
        label = f"{config}/{strategy} page_size={page_size} lm_chunk={lm_chunk} chunk={chunk}"
        out = os.path.join(c["root"], "grads.safetensors")
        engine = run_grad_dump(c["model_dir"], c["jsonl"], out, strategy, page_size, lm_chunk, chunk)
        worst = compare(engine, c["ref"], label)
        summary.append(f"{label}: max rel err {worst[0]:.2e} ({worst[1]})")
    print("\n".join(["SUMMARY"] + summary))


def test_unknown_rope_type_refused():
    """A RoPE type the engine does not implement is refused, naming the file and the field."""
    c = case("llama_linear")
    hf = dict(FAMILY_CONFIGS["llama_linear"]["hf"],
              rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2})
    model_dir = os.path.join(c["root"], "longrope")
    write_model_dir(model_dir, hf, c["weights"])
    out = os.path.join(c["root"], "unused_longrope.safetensors")
    proc = run([grad_dump_path(), f"--model_dir={model_dir}", f"--batch_jsonl={c['jsonl']}", f"--out={out}"],
               check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    for needle in (os.path.join(model_dir, "config.json"), "'rope_scaling.rope_type'", "'longrope'"):
        assert needle in proc.stderr, (needle, proc.stderr)
    assert not os.path.exists(out)


def test_grad_dump_errors():
    c = case("qwen2_tied")
    out = os.path.join(c["root"], "unused.safetensors")
    proc = run([grad_dump_path(), f"--model_dir={c['model_dir']}", f"--batch_jsonl={c['jsonl']}",
                "--strategy=no_such_strategy", f"--out={out}"], check=False)
    assert proc.returncode == 1 and "no_such_strategy" in proc.stderr, (proc.returncode, proc.stderr)
    proc = run([grad_dump_path(), f"--model_dir={c['root']}/missing", f"--batch_jsonl={c['jsonl']}",
                f"--out={out}"], check=False)
    assert proc.returncode == 1 and proc.stderr.strip(), (proc.returncode, proc.stderr)
    assert not os.path.exists(out)


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_objective_gradients_match_torch(config, objective):
    """DPO / GRPO through Trainer::ComputeGradients(Batch) against the plain-torch objectives on the reference
    model, for every exact strategy and spaco with all chunks kept."""
    oc = objective_case(config, objective)
    strategies = [s for s in OBJECTIVE_STRATEGIES if s == "spaco" or s in known_strategies()]
    summary = []
    for strategy in strategies:
        worst = (0.0, "")
        for r in objective_runs(strategy, oc["lengths"]):
            r = dict(r)
            flags = oc["flags"] + r.pop("flags", [])
            label = f"{config}/{objective}/{strategy} " + " ".join(f"{k}={v}" for k, v in r.items())
            out = os.path.join(oc["root"], "objective_grads.safetensors")
            loss, grads, metadata = grad_dump(oc["model_dir"], oc["data"], out, strategy, objective=oc["objective"],
                                              flags=flags, **r)
            if strategy == "spaco":
                assert metadata["chunks_backpropagated"] == metadata["chunks"], (label, metadata)
            worst = max(worst, compare((loss, grads), oc["ref"], label))
        summary.append(f"{config}/{objective}/{strategy}: max rel err {worst[0]:.2e} ({worst[1]})")
    print("\n".join(["SUMMARY"] + summary))


def test_grad_dump_objective_errors():
    c = case("qwen2_tied")
    out = os.path.join(c["root"], "unused_objective.safetensors")
    base = [grad_dump_path(), f"--model_dir={c['model_dir']}", f"--out={out}"]

    def fails(flags, *needles):
        proc = run(base + flags, check=False)
        assert proc.returncode == 1, (flags, proc.returncode, proc.stderr)
        assert proc.stderr.startswith("grad_dump: error: "), proc.stderr
        for needle in needles:
            assert needle in proc.stderr, (flags, needle, proc.stderr)
        assert not os.path.exists(out)
        return proc.stderr

    # A GRPO group with no completions (G = 0): the message names the file, its line and the field.
    empty = os.path.join(c["root"], "grpo_g0.jsonl")
    write_rows(empty, [dict(prompt=[1, 2, 3], completions=[[4, 5]], advantages=[0.5]),
                       dict(prompt=[1, 2, 3], completions=[], advantages=[])])
    message = fails(["--objective=grpo", f"--data={empty}"], f"{empty}:2", "completions")
    assert "G >= 1" in message or "G = 0" in message or "empty" in message, message
    # GRPO with a KL term but neither ref_logprobs nor a reference model.
    no_ref = objective_case("qwen2_tied", "grpo_on_policy")["data"]
    fails(["--objective=grpo", f"--data={no_ref}", "--grpo_kl_beta=0.1"], "ref_logprobs", "reference model")
    fails(["--objective=dpo"], "--data")
    fails(["--objective=ppo", f"--data={no_ref}"], "ppo")
    fails(["--objective=dpo", f"--data={no_ref}", "--dpo_beta=0"], "--dpo_beta")
    fails(["--objective=grpo", f"--data={no_ref}", "--grpo_clip_eps=1.5"], "--grpo_clip_eps")
    budget = ["--strategy=spaco", "--chunk=16", "--spaco_budget=3"]  # sequences of 25..32 positions: 2 chunks
    fails(["--objective=grpo", f"--data={no_ref}", "--grpo_kl_beta=0"] + budget, "--spaco_budget=3")


@pytest.mark.parametrize("config", ["llama_gqa", "qwen2_tied", "llama_rope_scaled", "llama_dynamic", "qwen3_yarn_bias",
                                    "llama_biases"])
def test_saved_model_loads_back(config):
    """One training step with //cli:train --save: the export parses, has the input's tensor names and shapes
    (no lm_head.weight when tied) and config, and loads back into the engine with exact gradients."""
    train = train_path()
    if train is None:
        pytest.skip("//cli:train is not available")
    spec = ALL_CONFIGS[config]
    c = case(config)
    saved = os.path.join(c["root"], "saved")
    shutil.rmtree(saved, ignore_errors=True)
    # One short step: the batch's longer records are cut at --seq_len, which train refuses unless asked to.
    run([train, f"--model={c['model_dir']}", "--steps=1", "--seq_len=16", "--overlong=truncate", "--dtype=f64",
         f"--save={saved}", f"--data={c['jsonl']}"])

    tensors, dtypes, metadata = read_safetensors(os.path.join(saved, "model.safetensors"))
    assert metadata.get("format") == "pt", metadata
    assert sorted(tensors) == sorted(c["weights"]), (sorted(tensors), sorted(c["weights"]))
    for name, w in c["weights"].items():
        assert tensors[name].shape == w.shape, (name, tensors[name].shape, w.shape)
        assert dtypes[name] == "F64", (name, dtypes[name])
        assert np.all(np.isfinite(tensors[name])), name
    changed = [n for n, w in c["weights"].items() if not np.array_equal(tensors[n], w)]
    assert changed, "the training step changed no weight"

    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    # RoPE: the same frequencies and attention factor (the export writes rope_scaling with every field).
    for length in (5, 61):
        for saved_value, value in zip(rope_parameters(cfg, length), rope_parameters(spec["hf"], length)):
            assert np.array_equal(np.asarray(saved_value), np.asarray(value)), (length, cfg, spec["hf"])
    for key, value in spec["hf"].items():
        if key in ("use_sliding_window", "rope_scaling", "rope_parameters", "rope_theta", "layer_types"):
            continue
        assert cfg.get(key) == value, f"config.json field {key}: {cfg.get(key)!r} != {value!r}"

    # The export loads back into the engine, which agrees with the reference on the trained weights.
    hf = dict(spec["hf"])
    ref = reference(hf, tensors, c["batch"])
    engine = run_grad_dump(saved, c["jsonl"], os.path.join(c["root"], "saved_grads.safetensors"), "full", 16, 7)
    compare(engine, ref, f"{config}/saved")


def main(test_file):
    """Runs pytest on test_file; --grad_dump=PATH and --train=PATH name the binaries, --pip_venv=PATH
    tests/e2e/pip_venv.sh (Bazel passes them)."""
    paths = {"--grad_dump": "SG_GRAD_DUMP", "--train": "SG_TRAIN", "--pip_venv": "SG_PIP_VENV"}
    args = []
    for a in sys.argv[1:]:
        flag, _, path = a.partition("=")
        if flag in paths and path:
            os.environ[paths[flag]] = os.path.abspath(path)
        else:
            args.append(a)
    sys.exit(pytest.main([os.path.abspath(test_file), "-q", "-s", "-p", "no:cacheprovider"] + args))


if __name__ == "__main__":
    main(__file__)


# ----------------------------------------------------------------------------------------------------------------
# Mamba-1 (MambaForCausalLM): a plain-torch reference with a sequential scan, as HF's slow path
# ----------------------------------------------------------------------------------------------------------------

MAMBA_CONFIGS = {
    "mamba_tied": {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": 61, "hidden_size": 12,
                   "state_size": 4, "num_hidden_layers": 2, "expand": 2, "conv_kernel": 4, "time_step_rank": "auto",
                   "use_bias": False, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
                   "tie_word_embeddings": True, "hidden_act": "silu", "residual_in_fp32": True},
    "mamba_untied_bias": {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": 53,
                          "hidden_size": 20, "state_size": 3, "num_hidden_layers": 3, "expand": 2, "conv_kernel": 3,
                          "time_step_rank": 2, "use_bias": True, "use_conv_bias": True, "layer_norm_epsilon": 1e-6,
                          "tie_word_embeddings": False, "hidden_act": "silu"},
}
# (strategy, chunk): chunks shorter than the conv tail, ragged, and one chunk.
MAMBA_RUNS = [("full", 512), ("ckpt", 512), ("seco", 1), ("seco", 4), ("seco", 7), ("streambp", 3),
              ("streambp", 16)]


def mamba_dims(hf):
    d, N = hf["hidden_size"], hf["state_size"]
    rank = hf["time_step_rank"]
    R = math.ceil(d / 16) if rank == "auto" else rank
    return d, hf["expand"] * d, N, R, hf["conv_kernel"]


def make_mamba_weights(hf, seed):
    rng = np.random.default_rng(seed)
    d, E, N, R, K = mamba_dims(hf)
    V = hf["vocab_size"]

    def mat(out, inp, scale=1.0):
        return rng.normal(0.0, scale / math.sqrt(inp), size=(out, inp))

    def small(*shape):
        return 0.1 * rng.normal(size=shape)

    w = {"backbone.embeddings.weight": rng.normal(0.0, 0.7, size=(V, d))}
    for i in range(hf["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        w[p + "norm.weight"] = 1.0 + small(d)
        w[p + "mixer.in_proj.weight"] = mat(2 * E, d, 1.5)
        w[p + "mixer.conv1d.weight"] = rng.normal(0.0, 0.5, size=(E, 1, K))
        w[p + "mixer.conv1d.bias"] = small(E)
        w[p + "mixer.x_proj.weight"] = mat(R + 2 * N, E, 1.5)
        w[p + "mixer.dt_proj.weight"] = mat(E, R)
        w[p + "mixer.dt_proj.bias"] = small(E) - 1.0
        w[p + "mixer.A_log"] = np.log(np.arange(1, N + 1))[None, :] + small(E, N)
        w[p + "mixer.D"] = 1.0 + small(E)
        w[p + "mixer.out_proj.weight"] = mat(d, E)
        if hf["use_bias"]:
            w[p + "mixer.in_proj.bias"] = small(2 * E)
            w[p + "mixer.out_proj.bias"] = small(d)
    w["backbone.norm_f.weight"] = 1.0 + small(d)
    if not hf["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(V, d, 2.0)
    return w


def mamba_logits(hf, W, ids):
    d, E, N, R, K = mamba_dims(hf)
    eps = float(hf["layer_norm_epsilon"])
    T = len(ids)
    x = W["backbone.embeddings.weight"][torch.tensor(ids, dtype=torch.long)]
    for i in range(hf["num_hidden_layers"]):
        p = f"backbone.layers.{i}.mixer."
        xz = rms_norm(x, W[f"backbone.layers.{i}.norm.weight"], eps) @ W[p + "in_proj.weight"].T
        if hf["use_bias"]:
            xz = xz + W[p + "in_proj.bias"]
        xi, z = xz[:, :E], xz[:, E:]
        conv = F.conv1d(xi.T[None], W[p + "conv1d.weight"], W[p + "conv1d.bias"], padding=K - 1, groups=E)
        u = F.silu(conv[0, :, :T].T)
        dt, B, C = torch.split(u @ W[p + "x_proj.weight"].T, [R, N, N], dim=-1)
        delta = F.softplus(dt @ W[p + "dt_proj.weight"].T + W[p + "dt_proj.bias"])
        A = -torch.exp(W[p + "A_log"])
        h = torch.zeros(E, N, dtype=torch.float64)
        ys = []
        for t in range(T):
            h = torch.exp(delta[t][:, None] * A) * h + delta[t][:, None] * B[t][None, :] * u[t][:, None]
            ys.append(h @ C[t] + W[p + "D"] * u[t])
        out = (torch.stack(ys) * F.silu(z)) @ W[p + "out_proj.weight"].T
        x = x + (out + W[p + "out_proj.bias"] if hf["use_bias"] else out)
    head = W["backbone.embeddings.weight"] if hf["tie_word_embeddings"] else W["lm_head.weight"]
    return rms_norm(x, W["backbone.norm_f.weight"], eps) @ head.T


@pytest.mark.parametrize("config", sorted(MAMBA_CONFIGS))
def test_mamba_gradients_match_torch(config):
    hf = MAMBA_CONFIGS[config]
    root = scratch_dir(f"torch_ref_{config}_")
    weights = make_mamba_weights(hf, 5)
    batch = make_batch(hf, [29, 17], 5)
    model_dir = os.path.join(root, "model")
    write_model_dir(model_dir, hf, weights)
    jsonl = os.path.join(root, "batch.jsonl")
    write_jsonl(jsonl, batch)
    ref = reference(hf, weights, batch, logits_fn=mamba_logits)
    summary = []
    for strategy, chunk in MAMBA_RUNS:
        out = os.path.join(root, "grads.safetensors")
        engine = run_grad_dump(model_dir, jsonl, out, strategy, page_size=16, lm_chunk=7, chunk=chunk)
        worst = compare(engine, ref, f"{config}/{strategy} chunk={chunk}")
        summary.append(f"{config}/{strategy} chunk={chunk}: max rel err {worst[0]:.2e} ({worst[1]})")
    print("\n".join(["SUMMARY"] + summary))
