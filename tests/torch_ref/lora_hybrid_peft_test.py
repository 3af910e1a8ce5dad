"""LoRA on the Gated DeltaNet hybrids against PEFT 0.21 and transformers 5.23, both ways, in float64.

The three tiny models of qwen3_next_hf_test.py (qwen3_5_text, qwen3_next dense, and the published qwen3_5 layout
whose text model lives under model.language_model. beside a vision tower), made by its helpers. PEFT itself adapts
the gated attention's q_proj and v_proj and the Gated DeltaNet projections (TARGETS: in_proj_qkv, in_proj_z and
out_proj on Qwen3.5, in_proj_qkvz, in_proj_ba and out_proj on Qwen3-Next) with random A and B (get_peft_model,
init_lora_weights=False) and saves the adapter; its loss and adapter gradients on qwen3_next_hf_test's batch (151 and
120 tokens) are the reference, with transformers' float32 made float64 (documents_hf_test's patch).
  * PEFT -> engine: grad_dump --lora_init loads PEFT's adapter; under full, seco (chunks of 48 and 50, which cut
    both sequences) and streambp the loss and every adapter gradient match PEFT's to 1e-10 relative. PEFT's module
    names are checked to be the checkpoint's (base_model.model.model.language_model.layers... on the published
    layout) with no vision tower module adapted.
  * engine -> PEFT: the adapter the engine saves (--lora_save) has PEFT's tensor names and values bit for bit;
    PeftModel.from_pretrained loads it with no missing or unexpected keys and gives the engine's loss and adapter
    gradients to 1e-10. The merged export (--merged_out) loads into transformers (its config's class) with nothing
    missing or unexpected, the vision tower unchanged; transformers' loss and every gradient of it match the
    engine's on the same export to 1e-10, and PEFT's merge_and_unload() equals it to 1e-12.
  * qwen3_5_text's adapter (model.layers...) on the published layout (model.language_model.layers...) is refused by
    name.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers, peft from PyPI) as a script:
      lora_hybrid_peft_test.py write ROOT BATCH
          makes the three models (ROOT/NAME/model) and PEFT's adapters (ROOT/NAME/peft_adapter); prints
          {NAME: {"loss", "grads", "target_modules", "adapted"}}: PEFT's loss and adapter gradients (engine names).
      lora_hybrid_peft_test.py load MODEL ADAPTER MERGED BATCH
          PeftModel.from_pretrained(MODEL, ADAPTER)'s loss, adapter gradients and loading info; transformers'
          reference of MERGED (qwen3_next_hf_test.reference); merge_diff: max |merge_and_unload() - MERGED|.
  * the test, under the pinned /usr/bin/python3 (qwen3_next_hf_test's and torch_ref_test's runners and readers).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_next_hf_test as hybrid  # noqa: E402  (the models, the batch, the float64 transformers)

TOLERANCE = 1e-10
MERGE_AGREEMENT = 1e-12
RANK = 3
ALPHA = 5  # an integer, as PEFT writes it; scale 5 / 3
ATTENTION = ["q_proj", "v_proj"]
TARGETS = {"qwen3_5_text": ATTENTION + ["in_proj_qkv", "in_proj_z", "out_proj"],
           "qwen3_next": ATTENTION + ["in_proj_qkvz", "in_proj_ba", "out_proj"],
           "qwen3_5": ATTENTION + ["in_proj_qkv", "in_proj_z", "out_proj"]}
# (strategy, chunk, KV page)
RUNS = [("full", 512, 16), ("seco", 48, 3), ("seco", 50, 16), ("streambp", 50, 3)]
PEFT_PREFIX = "base_model.model."


# ---- the venv half ----------------------------------------------------------------------------------------------

def _engine_name(peft_name):
    """PEFT's parameter name as the engine (and PEFT's saved file, less its prefix) calls it."""
    assert peft_name.startswith(PEFT_PREFIX), peft_name
    return peft_name[len(PEFT_PREFIX):].replace(".default.", ".")


def _adapter_loss_and_grads(model, batch):
    """The loss and the adapter gradients (engine names) of the PeftModel on the batch."""
    hybrid.DELTA_RULE.update(calls=0, worst=0.0, longest=0)
    out = hybrid._docs().loss_and_grads(model, batch)
    assert hybrid.DELTA_RULE["worst"] <= hybrid.DELTA_RULE_AGREEMENT, hybrid.DELTA_RULE
    out["grads"] = {_engine_name(n): g for n, g in out["grads"].items()}
    return out


def _base(directory):
    """The model in directory as transformers loads it (its config's class), float64, with its loading info."""
    import torch
    import transformers

    hybrid._docs()._float64_transformers()
    hybrid._check_delta_rule()
    with open(os.path.join(directory, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    return cls.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager", output_loading_info=True)


def write(root, batch):
    import peft
    import torch

    out = {}
    for seed, name in enumerate(hybrid.MODELS):
        directory = hybrid.make(root, name, seed)
        model, _ = _base(directory)
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[name], task_type="CAUSAL_LM",
                                 init_lora_weights=False)  # A and B random: every gradient matters
        torch.manual_seed(100 + seed)
        model = peft.get_peft_model(model, config).to(torch.float64)
        adapter = os.path.join(root, name, "peft_adapter")
        model.save_pretrained(adapter)
        out[name] = _adapter_loss_and_grads(model, batch)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            out[name]["target_modules"] = sorted(json.load(f)["target_modules"])
        out[name]["adapted"] = sorted(n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear))
    return out


def load(model_dir, adapter_dir, merged_dir, batch):
    import peft
    import safetensors.torch

    base, _ = _base(model_dir)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    # Loaded again to see what from_pretrained only warns of: file keys no module took, adapters the file lacked.
    result = peft.set_peft_model_state_dict(model, peft.load_peft_weights(adapter_dir))
    out = _adapter_loss_and_grads(model, batch)
    out["adapter_loading"] = {"unexpected": sorted(result.unexpected_keys),
                              "missing": sorted(k for k in result.missing_keys if "lora_" in k)}
    out["merged"] = hybrid.reference(merged_dir, batch)
    merged = model.merge_and_unload().state_dict()
    exported = safetensors.torch.load_file(os.path.join(merged_dir, "model.safetensors"))
    out["merge_unmatched"] = sorted(set(exported) - set(merged))
    out["merge_diff"] = max(float((merged[k] - v).abs().max()) for k, v in exported.items() if k in merged)
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

_WRITTEN = {}


def written():
    """{"root", "batch", "peft": {NAME: PEFT's reference}}: the models and PEFT's adapters, made once."""
    if not _WRITTEN:
        root = hybrid._docs()._scratch()
        batch = hybrid._write_batch(os.path.join(root, "batch.jsonl"))
        _WRITTEN.update(root=root, batch=batch, peft=hybrid._ref().venv_json(__file__, "write", root, batch))
    return _WRITTEN


def _dir(name, leaf):
    return os.path.join(written()["root"], name, leaf)


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", hybrid.MODELS)


def _adapted_modules(name):
    """The checkpoint's module paths whose leaf is one of TARGETS[name] (the vision tower's excluded)."""
    tensors, _, _ = hybrid._ref().read_safetensors(os.path.join(_dir(name, "model"), "model.safetensors"))
    return sorted(n[:-len(".weight")] for n, t in tensors.items()
                  if n.endswith(".weight") and t.ndim == 2 and not n.startswith(hybrid.VISUAL)
                  and n[:-len(".weight")].rsplit(".", 1)[-1] in TARGETS[name])


def test_peft_adapts_the_checkpoints_modules(name):
    """PEFT adapts exactly the text model's target modules, under the checkpoint's names (model.language_model. on
    the published layout), both linear-attention and attention layers, and names its saved tensors after them."""
    want = written()["peft"][name]
    modules = _adapted_modules(name)
    assert sorted(_engine_name(m + ".") for m in want["adapted"]) == [m + "." for m in modules], \
        (want["adapted"], modules)
    assert want["target_modules"] == sorted(TARGETS[name]), want["target_modules"]
    assert any(".linear_attn." in m for m in modules) and any(".self_attn." in m for m in modules), modules
    tensors, _, _ = hybrid._ref().read_safetensors(os.path.join(_dir(name, "peft_adapter"),
                                                                 "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(PEFT_PREFIX + m + f".lora_{ab}.weight" for m in modules for ab in "AB"), \
        sorted(tensors)
    if name == "qwen3_5":
        assert all(m.startswith("model.language_model.layers.") for m in modules), modules


def test_peft_adapter_gradients_match_engine(name):
    """PEFT's adapter in the engine: the loss and every adapter gradient are PEFT's under each run."""
    want = written()["peft"][name]
    assert want["grads"] and all(any(g) for g in want["grads"].values()), name
    out = _dir(name, "grads.safetensors")
    failures = []
    for strategy, chunk, page in RUNS:
        loss, grads, _ = hybrid._ref().grad_dump(_dir(name, "model"), written()["batch"], out, strategy, page,
                                                 lm_chunk=7, chunk=chunk,
                                                 flags=[f"--lora_init={_dir(name, 'peft_adapter')}"])
        worst = hybrid._docs()._worst((loss, grads), want)
        label = f"{name} PEFT adapter {strategy} chunk={chunk} page={page}"
        print(f"{label}: loss {loss:.17g} (PEFT {want['loss']:.17g}), worst rel {worst:.2e}")
        if not worst <= TOLERANCE:
            failures.append(f"{label}: rel {worst:.2e}")
    assert not failures, "the engine differs from PEFT: " + "; ".join(failures)


def test_engine_adapter_and_merged_export_load_in_peft_and_transformers(name):
    """The engine's saved adapter is PEFT's file back; PeftModel loads it with the engine's loss and gradients;
    transformers loads the merged export whole, with the engine's loss and gradients on it."""
    import numpy as np

    ref = hybrid._ref()
    model_dir, peft_adapter = _dir(name, "model"), _dir(name, "peft_adapter")
    saved, merged = _dir(name, "engine_adapter"), _dir(name, "merged")
    loss, grads, _ = ref.grad_dump(model_dir, written()["batch"], _dir(name, "g.safetensors"), "seco", 16,
                                   lm_chunk=7, chunk=48,
                                   flags=[f"--lora_init={peft_adapter}", f"--lora_save={saved}",
                                          f"--merged_out={merged}"])

    theirs, _, _ = ref.read_safetensors(os.path.join(peft_adapter, "adapter_model.safetensors"))
    ours, _, _ = ref.read_safetensors(os.path.join(saved, "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for n in theirs:
        assert ours[n].tobytes() == theirs[n].tobytes(), f"{n} changed in the engine's round trip"
    with open(os.path.join(saved, "adapter_config.json")) as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == sorted(TARGETS[name]) and config["r"] == RANK, config

    r = ref.venv_json(__file__, "load", model_dir, saved, merged, written()["batch"])
    assert r["adapter_loading"] == {"unexpected": [], "missing": []}, r["adapter_loading"]
    worst = hybrid._docs()._worst((loss, grads), r)
    print(f"{name}: PeftModel on the engine's adapter: loss {r['loss']:.17g} (engine {loss:.17g}), worst rel "
          f"{worst:.2e}; merge_and_unload() vs the export {r['merge_diff']:.2e}")
    assert worst <= TOLERANCE, f"{name}: PeftModel on the engine's adapter differs from the engine: rel {worst:.2e}"
    assert not r["merge_unmatched"] and r["merge_diff"] <= MERGE_AGREEMENT, (r["merge_unmatched"], r["merge_diff"])

    want = r["merged"]
    assert not any(want["loading_info"].values()), want["loading_info"]
    before, _, _ = ref.read_safetensors(os.path.join(model_dir, "model.safetensors"))
    after, _, _ = ref.read_safetensors(os.path.join(merged, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    for n in before:
        if n.startswith(hybrid.VISUAL):
            assert after[n].tobytes() == before[n].tobytes(), n
    adapted = {m + ".weight" for m in _adapted_modules(name)}
    for n in before:
        assert (n in adapted) != np.array_equal(after[n], before[n]), f"{n}: merged wrongly"
    assert abs(want["loss"] - r["loss"]) <= TOLERANCE * abs(r["loss"]), (want["loss"], r["loss"])
    hybrid.check_runs(f"{name} merged", merged, written()["batch"], want, [("full", 512, 16), ("seco", 50, 3)])


def test_text_model_adapter_refused_on_published_layout():
    """PEFT's adapter of qwen3_5_text (model.layers...) has the shapes of the published layout's text model but not
    its names (model.language_model.layers...): refused, naming the file and the tensor, before any work."""
    out = _dir("qwen3_5", "unused.safetensors")
    proc = hybrid._ref().run([hybrid._ref().grad_dump_path(), f"--model_dir={_dir('qwen3_5', 'model')}",
                              f"--batch_jsonl={written()['batch']}", f"--out={out}",
                              f"--lora_init={_dir('qwen3_5_text', 'peft_adapter')}"], check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "adapter_model.safetensors: tensor 'base_model.model.model.layers.0." in proc.stderr, proc.stderr
    assert not os.path.exists(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"]:
        print(json.dumps(write(*sys.argv[2:])))
        sys.exit(0)
    if sys.argv[1:2] == ["load"]:
        print(json.dumps(load(*sys.argv[2:])))
        sys.exit(0)
    hybrid._ref().main(__file__)
