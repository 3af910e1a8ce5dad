"""LoRA adapters in Hugging Face PEFT's format, against plain torch and against the PEFT release from PyPI.

For a tiny Llama, Qwen2 and Mamba (the random f64 models of torch_ref_test.py) this test writes a LoRA adapter the way
PEFT's `save_pretrained` does -- adapter_config.json (peft_type LORA, r, integer lora_alpha, target_modules, ...,
with keys the engine ignores) and adapter_model.safetensors with tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] -- with random A and B on every
linear module of the family. `grad_dump --lora_init` loads it into the engine and writes the loss and the adapter
gradients of a batch for several strategies (lora_dropout 0: gradient passes apply dropout); they must match plain torch autograd, where each adapted weight is
W + (lora_alpha / r) B A (PEFT's LoRA forward without dropout, y = x W^T + s x A^T B^T), to 1e-9.

`--lora_save` writes the adapter back as the engine saves adapters: its adapter_config.json and tensor layout are
checked against PEFT's documented format (https://huggingface.co/docs/peft, LoraConfig / PeftModel.save_pretrained)
and its tensors must equal the input bit for bit. `--merged_out` writes the merged model: every adapted weight equals
W + s B A, the rest is unchanged, and no adapter tensor is left.

With PEFT 0.21 and transformers 5.x from PyPI (the venv of tests/e2e/pip_venv.sh; peft_compare.py runs there):
the engine-written adapter loaded by PeftModel.from_pretrained onto the base model read by transformers gives the
engine's loss to 1e-6 (transformers computes RMSNorm in float32 even in a float64 model; the base model shows the
same gap), as does transformers on the engine's merged export, and merge_and_unload() equals that export to 1e-12.
The other way, an adapter that PEFT creates (get_peft_model, random A and B; "all-linear" for the Llama) and saves
loads into the engine, whose loss equals PEFT's.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ref_test as ref  # noqa: E402  (the plain-torch models, safetensors helpers and grad_dump runner)

RANK = 3
ALPHA = 5  # an integer, as PEFT writes it; scale = 5 / 3
TOLERANCE = 1e-9

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAMBA_TARGETS = ["in_proj", "x_proj"]  # what PEFT applies on Mamba (core/lora.h)

CASES = {
    "llama_gqa": dict(hf=ref.CONFIGS["llama_gqa"]["hf"], family="llama", lengths=[37, 20], seed=11,
                      runs=[("full", 512), ("seco", 7), ("streambp", 16)]),
    "qwen2_tied": dict(hf=ref.CONFIGS["qwen2_tied"]["hf"], family="llama", lengths=[30, 9], seed=12,
                       runs=[("full", 512), ("seco", 8), ("ckpt", 512)]),
    # Qwen3: adapters on q/k under the per-head norms, o_proj's bias, yarn.
    "qwen3_yarn_bias": dict(hf=ref.FAMILY_CONFIGS["qwen3_yarn_bias"]["hf"], family="llama", lengths=[25, 11],
                            seed=14, runs=[("full", 512), ("seco", 6), ("streambp", 9)]),
    "mamba_untied_bias": dict(hf=ref.MAMBA_CONFIGS["mamba_untied_bias"], family="mamba", lengths=[21, 8], seed=13,
                              runs=[("full", 512), ("seco", 5), ("streambp", 4)]),
}

# What PEFT's LoraConfig.save_pretrained writes (peft 0.1x), including keys the engine does not use.
PEFT_CONFIG_EXTRA = {
    "alpha_pattern": {}, "auto_mapping": None, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "rank_pattern": {}, "revision": None, "use_dora": False, "use_rslora": False,
}


def adapted_modules(weights, targets):
    """{module path: weight name} of every [out, in] weight whose module name is a target."""
    out = {}
    for name, w in weights.items():
        if not name.endswith(".weight") or w.ndim != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in targets:
            out[module] = name
    return out


def make_adapter(weights, targets, seed):
    rng = np.random.default_rng(seed)
    adapter = {}
    for module, name in sorted(adapted_modules(weights, targets).items()):
        out_dim, in_dim = weights[name].shape
        adapter[module + ".lora_A.weight"] = rng.uniform(-1, 1, size=(RANK, in_dim)) / math.sqrt(in_dim)
        adapter[module + ".lora_B.weight"] = rng.normal(0.0, 0.5 / math.sqrt(RANK), size=(out_dim, RANK))
    return adapter


def write_peft_adapter(path, adapter, targets, base):
    """adapter_config.json + adapter_model.safetensors as PEFT's save_pretrained writes them."""
    os.makedirs(path, exist_ok=True)
    config = dict(PEFT_CONFIG_EXTRA, base_model_name_or_path=base, lora_alpha=ALPHA, lora_dropout=0.0,
                  peft_type="LORA", r=RANK, target_modules=list(reversed(targets)), task_type="CAUSAL_LM")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    ref.write_safetensors(os.path.join(path, "adapter_model.safetensors"),
                          {"base_model.model." + k: v for k, v in adapter.items()}, {"format": "pt"})


def reference(case, weights, adapter, batch):
    """(mean token loss, {adapter tensor: gradient}) with W_eff = W + s B A and only A, B trainable."""
    hf = case["hf"]
    scale = ALPHA / RANK
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in adapter.items()}
    W = {k: torch.tensor(v, dtype=torch.float64) for k, v in weights.items()}
    for module, name in adapted_modules(weights, LLAMA_TARGETS + MAMBA_TARGETS).items():
        if module + ".lora_A.weight" in leaves:
            W[name] = W[name] + scale * leaves[module + ".lora_B.weight"] @ leaves[module + ".lora_A.weight"]
    logits_fn = ref.mamba_logits if case["family"] == "mamba" else (lambda h, w, ids: ref.forward_logits(h, w, ids))
    loss_sum, valid = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in batch:
        labels_t = torch.tensor(labels, dtype=torch.long)
        logits = logits_fn(hf, W, ids)
        loss_sum = loss_sum + F.cross_entropy(logits[:-1], labels_t[1:], ignore_index=-100, reduction="sum")
        valid += int((labels_t[1:] != -100).sum())
    loss = loss_sum / valid
    loss.backward()
    return loss.item(), {k: t.grad.numpy().copy() for k, t in leaves.items()}


def check_peft_layout(path, adapter, targets, base):
    """The engine-written adapter against PEFT's documented format."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA", config
    assert config["task_type"] == "CAUSAL_LM", config
    assert isinstance(config["r"], int) and config["r"] == RANK, config
    assert config["lora_alpha"] == ALPHA, config
    assert config["lora_dropout"] == 0.0, config
    assert sorted(config["target_modules"]) == sorted(targets), config
    assert config["bias"] == "none" and config["fan_in_fan_out"] is False, config
    assert config["use_rslora"] is False and config["use_dora"] is False, config
    assert config.get("modules_to_save") is None and config.get("layers_to_transform") is None, config
    assert config.get("rank_pattern", {}) == {} and config.get("alpha_pattern", {}) == {}, config
    assert config["base_model_name_or_path"] == base, config
    tensors, dtypes, metadata = ref.read_safetensors(os.path.join(path, "adapter_model.safetensors"))
    assert metadata.get("format") == "pt", metadata
    expected = {"base_model.model." + k for k in adapter}
    assert set(tensors) == expected, (sorted(set(tensors) - expected), sorted(expected - set(tensors)))
    for name, value in adapter.items():
        saved = tensors["base_model.model." + name]
        assert dtypes["base_model.model." + name] == "F64"
        assert saved.shape == value.shape, (name, saved.shape, value.shape)
        assert np.array_equal(saved, value), f"{name} changed in the round trip"


def check_merged(path, weights, adapter):
    tensors, _, _ = ref.read_safetensors(os.path.join(path, "model.safetensors"))
    assert not [n for n in tensors if "lora_" in n], sorted(tensors)
    assert sorted(tensors) == sorted(weights), (sorted(tensors), sorted(weights))
    modules = adapted_modules(weights, LLAMA_TARGETS + MAMBA_TARGETS)
    merged = {name: module for module, name in modules.items() if module + ".lora_A.weight" in adapter}
    worst = 0.0
    for name, w in weights.items():
        if name in merged:
            m = merged[name]
            expected = w + ALPHA / RANK * adapter[m + ".lora_B.weight"] @ adapter[m + ".lora_A.weight"]
            worst = max(worst, float(np.max(np.abs(tensors[name] - expected))))
        else:
            assert np.array_equal(tensors[name], w), f"{name} changed by the merge"
    assert worst <= 1e-12, f"merged weights differ from W + s B A by {worst:.3e}"
    with open(os.path.join(path, "config.json")) as f:
        json.load(f)


_PEFT_PYTHON = []


def peft_python():
    """The python of the venv with PEFT, transformers and torch from PyPI (tests/e2e/pip_venv.sh, made once)."""
    if not _PEFT_PYTHON:
        venv = subprocess.run([os.environ["SG_PIP_VENV"]], check=True, stdout=subprocess.PIPE, text=True).stdout
        _PEFT_PYTHON.append(os.path.join(venv.strip(), "bin", "python"))
    return _PEFT_PYTHON[0]


def peft_compare(*args):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peft_compare.py")
    proc = subprocess.run([peft_python(), script, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# transformers runs RMSNorm (and RoPE's cos/sin) in float32 even for a float64 model, so its losses agree with a
# float64 computation to about 1e-7 only: the same gap separates the engine from transformers on the base model.
PEFT_TOLERANCE = 1e-6


def check_with_peft(model_dir, adapter_dir, merged_dir, jsonl, engine_loss, engine_base_loss):
    r = peft_compare("load", model_dir, adapter_dir, merged_dir, jsonl)
    print(f"PEFT {r['peft_version']} / transformers {r['transformers_version']}: base loss {r['base']:.15f} (engine "
          f"{engine_base_loss:.15f}); PeftModel.from_pretrained(engine adapter) loss {r['peft']:.15f} (engine "
          f"{engine_loss:.15f}); engine's merged export in transformers {r['merged']:.15f}; merge_and_unload() vs "
          f"the engine's merged export: {r['merge_diff']:.2e}")
    assert abs(r["base"] - engine_base_loss) <= PEFT_TOLERANCE * abs(engine_base_loss), r
    assert abs(r["peft"] - engine_loss) <= PEFT_TOLERANCE * abs(engine_loss), (r, engine_loss)
    assert abs(r["merged"] - engine_loss) <= PEFT_TOLERANCE * abs(engine_loss), (r, engine_loss)
    assert abs(r["peft"] - r["base"]) > 1e3 * PEFT_TOLERANCE * abs(r["base"]), "the adapter changes nothing"
    assert r["merge_diff"] <= 1e-12, r


def setup_case(name, prefix):
    """(scratch dir, weights, batch, model dir, batch JSONL) of CASES[name]."""
    case = CASES[name]
    hf = case["hf"]
    root = ref.scratch_dir(f"{prefix}_{name}_")
    mamba = case["family"] == "mamba"
    weights = ref.make_mamba_weights(hf, case["seed"]) if mamba else ref.make_weights(hf, case["seed"])
    batch = ref.make_batch(hf, case["lengths"], case["seed"])
    model_dir, jsonl = os.path.join(root, "model"), os.path.join(root, "batch.jsonl")
    ref.write_model_dir(model_dir, hf, weights)
    ref.write_jsonl(jsonl, batch)
    return root, weights, batch, model_dir, jsonl


@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_adapter_matches_torch_and_peft_format(name):
    case = CASES[name]
    mamba = case["family"] == "mamba"
    root, weights, batch, model_dir, jsonl = setup_case(name, "lora")
    targets = MAMBA_TARGETS if mamba else LLAMA_TARGETS
    adapter = make_adapter(weights, targets, case["seed"] + 100)
    adapter_in = os.path.join(root, "adapter_in")
    write_peft_adapter(adapter_in, adapter, targets, model_dir)

    expected = reference(case, weights, adapter, batch)
    adapter_out, merged_out = os.path.join(root, "adapter_out"), os.path.join(root, "merged")
    engine_loss = None
    for strategy, chunk in case["runs"]:
        flags = [f"--lora_init={adapter_in}"]
        if strategy == "full":
            flags += [f"--lora_save={adapter_out}", f"--merged_out={merged_out}"]
        loss, grads, _ = ref.grad_dump(model_dir, jsonl, os.path.join(root, "grads.safetensors"), strategy,
                                       page_size=5, lm_chunk=7, chunk=chunk, flags=flags)
        ref.compare((loss, grads), expected, f"{name} LoRA {strategy} chunk={chunk}")
        engine_loss = engine_loss if engine_loss is not None else loss

    base_loss, _, _ = ref.grad_dump(model_dir, jsonl, os.path.join(root, "base.safetensors"), "full", page_size=5,
                                    lm_chunk=7)
    check_peft_layout(adapter_out, adapter, targets, model_dir)
    check_merged(merged_out, weights, adapter)
    check_with_peft(model_dir, adapter_out, merged_out, jsonl, engine_loss, base_loss)


# PEFT_WRITTEN[case]: the target_modules handed to PEFT's LoraConfig ("all-linear" is expanded by PEFT, which then
# saves module paths or suffixes in its own order).
PEFT_WRITTEN = {"llama_gqa": "all-linear", "qwen2_tied": "v_proj,q_proj,down_proj",
                "mamba_untied_bias": "x_proj,in_proj", "qwen3_yarn_bias": "k_proj,o_proj,q_proj,up_proj"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_peft_written_adapter_loads_into_engine(name):
    """An adapter that PEFT itself creates and saves (random A and B) gives the engine PEFT's loss."""
    root, _, _, model_dir, jsonl = setup_case(name, "peft_written")
    adapter = os.path.join(root, "adapter")
    r = peft_compare("write", model_dir, adapter, jsonl, RANK, ALPHA, PEFT_WRITTEN[name])
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        written = json.load(f)["target_modules"]
    loss, _, _ = ref.grad_dump(model_dir, jsonl, os.path.join(root, "g.safetensors"), "seco", page_size=5,
                               lm_chunk=7, chunk=6, flags=[f"--lora_init={adapter}"])
    base, _, _ = ref.grad_dump(model_dir, jsonl, os.path.join(root, "b.safetensors"), "full", page_size=5, lm_chunk=7)
    print(f"{name}: PEFT {r['peft_version']} wrote target_modules {written}; PEFT's loss {r['peft']:.15f}, the "
          f"engine's (seco) {loss:.15f}, base {base:.15f}")
    assert abs(r["peft"] - loss) <= PEFT_TOLERANCE * abs(loss), (r, loss)
    assert abs(loss - base) > 1e3 * PEFT_TOLERANCE * abs(base), "the adapter changes nothing"


def test_engine_rejects_adapter_of_another_model():
    """An adapter written for llama_gqa (d 32, 3 layers) does not load into qwen2_tied (d 24): the error names the
    file, the tensor and both shapes."""
    root = ref.scratch_dir("lora_mismatch_")
    src = CASES["llama_gqa"]
    weights = ref.make_weights(src["hf"], 1)
    adapter_dir = os.path.join(root, "adapter")
    write_peft_adapter(adapter_dir, make_adapter(weights, ["q_proj"], 2), ["q_proj"], "llama")
    other = CASES["qwen2_tied"]["hf"]
    model_dir = os.path.join(root, "model")
    ref.write_model_dir(model_dir, other, ref.make_weights(other, 3))
    jsonl = os.path.join(root, "batch.jsonl")
    ref.write_jsonl(jsonl, ref.make_batch(other, [9], 3))
    proc = ref.run([ref.grad_dump_path(), f"--model_dir={model_dir}", f"--batch_jsonl={jsonl}",
                    f"--out={os.path.join(root, 'g.safetensors')}", f"--lora_init={adapter_dir}"], check=False)
    assert proc.returncode != 0
    assert "adapter_model.safetensors: tensor 'base_model.model.model.layers." in proc.stderr, proc.stderr
    assert "has shape [3, 32] but this model needs [3, 24]" in proc.stderr or "[32, 3]" in proc.stderr, proc.stderr


if __name__ == "__main__":
    args = []
    for a in sys.argv[1:]:
        if a.startswith("--grad_dump="):
            os.environ["SG_GRAD_DUMP"] = os.path.abspath(a.split("=", 1)[1])
        elif a.startswith("--pip_venv="):
            os.environ["SG_PIP_VENV"] = os.path.abspath(a.split("=", 1)[1])
        else:
            args.append(a)
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-s", "-p", "no:cacheprovider"] + args))
