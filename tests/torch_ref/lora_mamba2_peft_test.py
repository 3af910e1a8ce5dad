"""LoRA on Mamba-2, Bamba, Nemotron-H and Falcon-H1 against PEFT 0.21 and transformers 5.23, both ways, in float64.

The tiny models of mamba2_hf_test.py (mamba2, bamba, nemotron_h, falcon_h1), made by its helpers. PEFT itself adapts the
targets it accepts there (TARGETS: the Mamba-2 mixers' in_proj, whose rows are z, xBC and dt fused; Bamba's out_proj
too; the attention's and MLPs' projections of the hybrids) with random A and B (get_peft_model,
init_lora_weights=False) and saves the adapter; its loss and adapter gradients on mamba2_hf_test's batch (151 and 120
tokens) are the reference, with transformers' float32 casts made float64 (mamba2_hf_test's patch, its torch SSD scan
recorded in float64).
  * PEFT -> engine: grad_dump --lora_init loads PEFT's adapter (Nemotron-H's under PEFT's model.* names, the engine
    holding backbone.*); under full, seco (chunks of 37 and 50) and streambp the loss and every adapter gradient
    match PEFT's to 1e-10 relative.
  * engine -> PEFT: the adapter the engine saves (--lora_save) holds PEFT's tensors bit for bit (Nemotron-H's under
    the backbone.* names transformers saves); PeftModel.from_pretrained loads it with no missing or unexpected keys
    and gives the engine's loss and adapter gradients to 1e-10. The merged export (--merged_out) loads into
    transformers with nothing missing or unexpected; transformers' loss and every gradient of it match the engine's
    on the same export to 1e-10, and PEFT's merge_and_unload() equals it to 1e-12.
  * Falcon-H1's µP multipliers act on its projections' inputs or outputs in transformers (ssm_multipliers on in_proj's
    row groups, key and MLP gate/down multipliers), so on base + adapter alike: the engine scales the adapted
    projection's whole output.
  * PEFT's own rules, recorded: it refuses out_proj and conv1d on mamba2, nemotron_h and falcon_h1 and defaults
    nemotron_h to q/k/v/o_proj; the engine refuses an adapter file naming out_proj on mamba2, by field and reason.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers, peft from PyPI) as a script:
      lora_mamba2_peft_test.py write ROOT BATCH
          makes the models (ROOT/NAME/model) and PEFT's adapters (ROOT/NAME/peft_adapter); prints
          {NAME: {"loss", "grads", "target_modules", "refused", "default_targets"}}.
      lora_mamba2_peft_test.py load MODEL ADAPTER MERGED BATCH
          PeftModel.from_pretrained(MODEL, ADAPTER)'s loss, adapter gradients and loading info; transformers'
          reference of MERGED (mamba2_hf_test.reference); merge_diff: max |merge_and_unload() - MERGED|.
  * the test, under the pinned /usr/bin/python3 (mamba2_hf_test's and torch_ref_test's runners and readers).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mamba2_hf_test as mamba2  # noqa: E402  (the models, the batch, the float64 transformers)

TOLERANCE = 1e-10
MERGE_AGREEMENT = 1e-12
RANK = 3
ALPHA = 5  # an integer, as PEFT writes it; scale 5 / 3
MODELS = {"mamba2": 0, "bamba": 2, "nemotron_h": 3, "falcon_h1": 4}  # mamba2_hf_test's seeds
TARGETS = {"mamba2": ["in_proj"],
           "bamba": ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"],
           "nemotron_h": ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
           "falcon_h1": ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
PEFT_MAMBA_TYPES = ("mamba2", "nemotron_h", "falcon_h1")  # where PEFT refuses out_proj and conv1d
# (strategy, chunk, KV page)
RUNS = [("full", 512, 16), ("seco", 37, 16), ("seco", 50, 16), ("streambp", 37, 16)]
PEFT_PREFIX = "base_model.model."


# ---- the venv half ----------------------------------------------------------------------------------------------

def _engine_name(model, peft_name):
    """PEFT's parameter name as the engine calls it (transformers' saved name, less PEFT's prefix and adapter)."""
    assert peft_name.startswith(PEFT_PREFIX), peft_name
    return mamba2._docs()._saved_name(model, peft_name[len(PEFT_PREFIX):].replace(".default.", "."))


def _adapter_loss_and_grads(model, batch):
    """The loss and the adapter gradients (engine names) of the PeftModel on the batch, the torch SSD scan run."""
    mamba2.SCAN.update(calls=0, longest=0, chunk_sizes=[])
    out = mamba2._docs().loss_and_grads(model, batch)
    assert mamba2.SCAN["calls"], mamba2.SCAN
    out["grads"] = {_engine_name(model, n): g for n, g in out["grads"].items()}
    return out


def _base(directory):
    """The model in directory as transformers loads it (its config's class), float64, with its loading info."""
    import torch
    import transformers

    mamba2._docs()._float64_transformers()
    mamba2._record_scan()
    with open(os.path.join(directory, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    model, info = cls.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager",
                                      output_loading_info=True)
    model.config.use_cache = False  # the whole sequence at once, no recurrent cache
    return model, info


def _peft_refusals(directory):
    """{module: PEFT's error} for out_proj and conv1d; the targets PEFT picks when given none (or its error)."""
    import peft

    refused = {}
    for module in ("out_proj", "conv1d"):
        try:
            peft.get_peft_model(_base(directory)[0], peft.LoraConfig(r=RANK, target_modules=[module]))
        except ValueError as e:
            refused[module] = str(e)
    try:
        model = peft.get_peft_model(_base(directory)[0], peft.LoraConfig(r=RANK, task_type="CAUSAL_LM"))
        default = sorted(model.peft_config["default"].target_modules)
    except ValueError as e:
        default = str(e)
    return refused, default


def write(root, batch):
    import peft
    import torch

    out = {}
    for name, seed in MODELS.items():
        directory = mamba2.make(root, name, seed)
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
        out[name]["refused"], out[name]["default_targets"] = _peft_refusals(directory)
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
    out["merged"] = mamba2.reference(merged_dir, batch)
    merged = {mamba2._docs()._saved_name(model, n): v for n, v in model.merge_and_unload().state_dict().items()}
    exported = safetensors.torch.load_file(os.path.join(merged_dir, "model.safetensors"))
    out["merge_unmatched"] = sorted(set(exported) - set(merged))
    out["merge_diff"] = max(float((merged[k] - v).abs().max()) for k, v in exported.items() if k in merged)
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

_WRITTEN = {}


def written():
    """{"root", "batch", "peft": {NAME: PEFT's reference}}: the models and PEFT's adapters, made once."""
    if not _WRITTEN:
        root = mamba2._docs()._scratch()
        batch = mamba2._write_batch(os.path.join(root, "batch.jsonl"))
        _WRITTEN.update(root=root, batch=batch, peft=mamba2._ref().venv_json(__file__, "write", root, batch))
    return _WRITTEN


def _dir(name, leaf):
    return os.path.join(written()["root"], name, leaf)


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", list(MODELS))


def _adapted_modules(name):
    """The checkpoint's module paths whose leaf is one of TARGETS[name]."""
    tensors, _, _ = mamba2._ref().read_safetensors(os.path.join(_dir(name, "model"), "model.safetensors"))
    return sorted(n[:-len(".weight")] for n, t in tensors.items()
                  if n.endswith(".weight") and t.ndim == 2 and n[:-len(".weight")].rsplit(".", 1)[-1] in TARGETS[name])


def test_peft_rules_for_mamba2_models(name):
    """PEFT adapts the targets (in_proj on every Mamba-2 layer); it refuses out_proj and conv1d on its Mamba model
    types (mamba2, nemotron_h, falcon_h1), and nemotron_h's default targets are attention's four projections."""
    want = written()["peft"][name]
    assert want["target_modules"] == sorted(TARGETS[name]), want["target_modules"]
    assert set(want["grads"]) == {m + f".lora_{ab}.weight" for m in _adapted_modules(name) for ab in "AB"}, \
        sorted(want["grads"])
    assert any(m.endswith(".in_proj") for m in _adapted_modules(name))
    if name in PEFT_MAMBA_TYPES:
        assert sorted(want["refused"]) == ["conv1d", "out_proj"], want["refused"]
        assert all("incompatible with Mamba-based models" in e for e in want["refused"].values()), want["refused"]
    else:
        assert "out_proj" not in want["refused"], want["refused"]
    if name == "nemotron_h":
        assert want["default_targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"], want["default_targets"]


def test_peft_adapter_gradients_match_engine(name):
    """PEFT's adapter in the engine: the loss and every adapter gradient are PEFT's under each run."""
    want = written()["peft"][name]
    assert want["grads"] and all(any(g) for g in want["grads"].values()), name
    out = _dir(name, "grads.safetensors")
    failures = []
    for strategy, chunk, page in RUNS:
        loss, grads, _ = mamba2._ref().grad_dump(_dir(name, "model"), written()["batch"], out, strategy, page,
                                                 lm_chunk=7, chunk=chunk,
                                                 flags=[f"--lora_init={_dir(name, 'peft_adapter')}"])
        worst = mamba2._docs()._worst((loss, grads), want)
        label = f"{name} PEFT adapter {strategy} chunk={chunk}"
        print(f"{label}: loss {loss:.17g} (PEFT {want['loss']:.17g}), worst rel {worst:.2e}")
        if not worst <= TOLERANCE:
            failures.append(f"{label}: rel {worst:.2e}")
    assert not failures, "the engine differs from PEFT: " + "; ".join(failures)


def test_engine_adapter_and_merged_export_load_in_peft_and_transformers(name):
    """The engine's saved adapter holds PEFT's tensors; PeftModel loads it with the engine's loss and gradients;
    transformers loads the merged export whole, with the engine's loss and gradients on it."""
    import numpy as np

    ref = mamba2._ref()
    model_dir, peft_adapter = _dir(name, "model"), _dir(name, "peft_adapter")
    saved, merged = _dir(name, "engine_adapter"), _dir(name, "merged")
    loss, grads, _ = ref.grad_dump(model_dir, written()["batch"], _dir(name, "g.safetensors"), "seco", 16,
                                   lm_chunk=7, chunk=50,
                                   flags=[f"--lora_init={peft_adapter}", f"--lora_save={saved}",
                                          f"--merged_out={merged}"])

    theirs, _, _ = ref.read_safetensors(os.path.join(peft_adapter, "adapter_model.safetensors"))
    ours, _, _ = ref.read_safetensors(os.path.join(saved, "adapter_model.safetensors"))
    # PEFT names Nemotron-H's adapters as transformers holds it in memory (model.*), the engine as it is saved.
    theirs = {n.replace(PEFT_PREFIX + "model.", PEFT_PREFIX + "backbone.") if name == "nemotron_h" else n: t
              for n, t in theirs.items()}
    assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for n in theirs:
        assert ours[n].tobytes() == theirs[n].tobytes(), f"{n} changed in the engine's round trip"
    with open(os.path.join(saved, "adapter_config.json")) as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == sorted(TARGETS[name]) and config["r"] == RANK, config

    r = ref.venv_json(__file__, "load", model_dir, saved, merged, written()["batch"])
    assert r["adapter_loading"] == {"unexpected": [], "missing": []}, r["adapter_loading"]
    worst = mamba2._docs()._worst((loss, grads), r)
    print(f"{name}: PeftModel on the engine's adapter: loss {r['loss']:.17g} (engine {loss:.17g}), worst rel "
          f"{worst:.2e}; merge_and_unload() vs the export {r['merge_diff']:.2e}")
    assert worst <= TOLERANCE, f"{name}: PeftModel on the engine's adapter differs from the engine: rel {worst:.2e}"
    assert not r["merge_unmatched"] and r["merge_diff"] <= MERGE_AGREEMENT, (r["merge_unmatched"], r["merge_diff"])

    want = r["merged"]
    assert not any(want["loading_info"].values()), want["loading_info"]
    before, _, _ = ref.read_safetensors(os.path.join(model_dir, "model.safetensors"))
    after, _, _ = ref.read_safetensors(os.path.join(merged, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    adapted = {m + ".weight" for m in _adapted_modules(name)}
    for n in before:
        assert (n in adapted) != np.array_equal(after[n], before[n]), f"{n}: merged wrongly"
    assert abs(want["loss"] - r["loss"]) <= TOLERANCE * abs(r["loss"]), (want["loss"], r["loss"])
    mamba2.check_runs(f"{name} merged", merged, written()["batch"], want, [("full", 512, 16), ("seco", 50, 16)])


def test_out_proj_adapter_refused_on_mamba2():
    """An adapter file naming out_proj on mamba2 (PEFT refuses to make one) is refused by field and reason, before
    any work."""
    import shutil

    bad = _dir("mamba2", "out_proj_adapter")
    shutil.copytree(_dir("mamba2", "peft_adapter"), bad, dirs_exist_ok=True)
    with open(os.path.join(bad, "adapter_config.json")) as f:
        config = json.load(f)
    config["target_modules"] = ["in_proj", "out_proj"]
    with open(os.path.join(bad, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    out = _dir("mamba2", "unused.safetensors")
    proc = mamba2._ref().run([mamba2._ref().grad_dump_path(), f"--model_dir={_dir('mamba2', 'model')}",
                              f"--batch_jsonl={written()['batch']}", f"--out={out}", f"--lora_init={bad}"],
                             check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "adapter_config.json: target_modules: 'out_proj' is not supported on mamba2: PEFT refuses" in proc.stderr, \
        proc.stderr
    assert not os.path.exists(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"]:
        print(json.dumps(write(*sys.argv[2:])))
        sys.exit(0)
    if sys.argv[1:2] == ["load"]:
        print(json.dumps(load(*sys.argv[2:])))
        sys.exit(0)
    mamba2._ref().main(__file__)
