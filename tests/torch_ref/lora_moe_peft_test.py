"""LoRA on mixture-of-experts models against PEFT 0.21 and transformers 5.23, both ways, in float64.

moe_hf_test's tiny qwen3_moe (layer 1 dense), mixtral and qwen3_next (a shared expert, layer 2 dense), made by its
helpers (model/: the fused expert layout, no aux loss). PEFT adapts attention's q_proj and v_proj with
target_modules, and the fused expert weights
with target_parameters ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] (lora.ParamWrapper: for a parameter
[E, out, in], lora_A [E r, in] and lora_B [out, r E], expert e's delta (alpha / r) B[:, k E + e] A[e r + k] summed
over k; the two wrappers of one module nest, gate_up_proj's innermost, its tensors named
"mlp.experts.base_layer.lora_A.weight"). A and B random (init_lora_weights=False); PEFT's loss and adapter gradients
on moe_hf_test's batch are the reference.
  * PEFT -> engine: grad_dump --lora_init loads PEFT's adapter; under full, seco (chunks of 10 and 16, which cut both
    sequences) and streambp the loss and every adapter gradient match PEFT's to 1e-10 relative.
  * engine -> PEFT: the adapter the engine saves (--lora_save) has PEFT's tensor names and values bit for bit and
    records the expert weights as target_parameters; PeftModel.from_pretrained loads it with no missing or unexpected
    keys and gives the engine's loss and adapter gradients to 1e-10. The merged export (--merged_out) loads into
    transformers with nothing missing or unexpected; transformers' loss and gradients on it match the engine's on it
    to 1e-10, and PEFT's merge_and_unload() equals it to 1e-12.
  * PEFT 0.21 rewrites transformers 4's expert module targets (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2) as
    target_parameters, gate_up_proj at twice the rank and alpha (rank_pattern), and "all-linear" adds the routers
    (target_parameters "gate.weight"): recorded here; such an adapter is refused by name.

Two halves, as lora_hybrid_peft_test's:
  * the venv half (tests/e2e/pip_venv.sh: torch, transformers, peft):
      lora_moe_peft_test.py write ROOT BATCH   -> the models and PEFT's adapters; {NAME: PEFT's reference}
      lora_moe_peft_test.py load MODEL ADAPTER MERGED BATCH   -> PeftModel on ADAPTER; transformers on MERGED
  * the test, under the pinned /usr/bin/python3.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_hf_test as moe  # noqa: E402  (the models, the batch, the float64 transformers)

TOLERANCE = 1e-10
MERGE_AGREEMENT = 1e-12
RANK = 2
ALPHA = 5  # scale 5 / 2
MODELS = ["qwen3_moe", "mixtral", "qwen3_next"]
MODULES = ["q_proj", "v_proj"]
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ENGINE_PARAMETERS = ["experts.down_proj", "experts.gate_up_proj"]  # as the engine writes them, sorted
RUNS = [("full", 512, 16), ("seco", 10, 3), ("seco", 16, 16), ("streambp", 7, 16)]
PEFT_PREFIX = "base_model.model."


# ---- the venv half ----------------------------------------------------------------------------------------------

def _engine_name(peft_name):
    assert peft_name.startswith(PEFT_PREFIX), peft_name
    return peft_name[len(PEFT_PREFIX):].replace(".default.", ".")


def _base(directory):
    moe._docs()._float64_transformers()
    moe._hybrid()._check_delta_rule()
    return moe._load(directory)


def _transformers_loss_and_grads(model, batch):
    """The loss and gradients of the batch; qwen3_next's chunked delta rule checked against its recurrent one."""
    moe._hybrid().DELTA_RULE.update(calls=0, worst=0.0, longest=0)
    out = moe._docs().loss_and_grads(model, batch)
    rule = moe._hybrid().DELTA_RULE
    assert rule["worst"] <= moe._hybrid().DELTA_RULE_AGREEMENT, rule
    return out


def _loss_and_grads(model, batch):
    """The PeftModel's loss and adapter gradients (engine names)."""
    out = _transformers_loss_and_grads(model, batch)
    out["grads"] = {_engine_name(n): g for n, g in out["grads"].items()}
    return out


def write(root, batch):
    import peft
    import torch

    out = {}
    for seed, name in enumerate(MODELS):
        dirs = moe.make(root, name, seed)
        model, _ = _base(dirs["model"])
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES,
                                 target_parameters=PARAMETERS, task_type="CAUSAL_LM", init_lora_weights=False)
        torch.manual_seed(200 + seed)
        model = peft.get_peft_model(model, config).to(torch.float64)
        adapter = os.path.join(root, name, "peft_adapter")
        model.save_pretrained(adapter)
        out[name] = _loss_and_grads(model, batch)
        wrappers = {n: (m.parameter_name, m.num_experts, tuple(m.lora_A["default"].weight.shape),
                        tuple(m.lora_B["default"].weight.shape))
                    for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.ParamWrapper)}
        out[name]["wrappers"] = {_engine_name(n + "."): w for n, w in wrappers.items()}
        # PEFT's delta of the first expert weight, against the rule the engine implements.
        inner = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.ParamWrapper)
                     and m.parameter_name == "gate_up_proj")
        a, b = inner.lora_A["default"].weight, inner.lora_B["default"].weight
        E = inner.num_experts
        rule = torch.stack([sum(torch.outer(b[:, k * E + e], a[e * RANK + k]) for k in range(RANK))
                            for e in range(E)]) * ALPHA / RANK
        out[name]["delta_rule"] = float((inner.get_delta_weight("default") - rule).abs().max())
        # "all-linear" (and transformers 4's expert module names) become target_parameters, the routers among them.
        all_linear = peft.get_peft_model(_base(dirs["model"])[0], peft.LoraConfig(r=RANK, target_modules="all-linear"))
        all_linear.save_pretrained(os.path.join(root, name, "all_linear_adapter"))
        v4 = ["w1", "w3", "w2"] if name == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
        converted = peft.get_peft_model(_base(dirs["model"])[0],
                                        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"] + v4))
        c = converted.peft_config["default"]
        out[name]["v4_targets"] = {"target_modules": sorted(c.target_modules),
                                   "target_parameters": sorted(c.target_parameters),
                                   "rank_pattern": c.rank_pattern, "alpha_pattern": c.alpha_pattern,
                                   "all_linear_parameters": sorted(all_linear.peft_config["default"].target_parameters)}
    return out


def _per_expert(name, tensors):
    """Fused expert tensors in the published per-expert layout, which the engine's export (as transformers'
    save_pretrained of a published checkpoint) writes: moe_hf_test's test_transformers_saves_the_published_..."""
    gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for n, t in tensors.items():
        t = t.detach()
        head, sep, tail = n.partition(".mlp.")
        if not sep or tail not in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
            out[n] = t
            continue
        prefix = moe._published_prefix(name, int(head.rsplit(".", 1)[1]))
        if tail == "gate.weight":
            out[prefix + tail] = t
        for e in range(t.shape[0] if tail != "gate.weight" else 0):
            if tail == "experts.down_proj":
                out[f"{prefix}experts.{e}.{down}.weight"] = t[e]
            else:
                out[f"{prefix}experts.{e}.{gate}.weight"], out[f"{prefix}experts.{e}.{up}.weight"] = t[e].chunk(2)
    return out


def load(model_dir, adapter_dir, merged_dir, batch):
    import peft
    import safetensors.torch

    base, _ = _base(model_dir)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    result = peft.set_peft_model_state_dict(model, peft.load_peft_weights(adapter_dir))
    out = _loss_and_grads(model, batch)
    out["adapter_loading"] = {"unexpected": sorted(result.unexpected_keys),
                              "missing": sorted(k for k in result.missing_keys if "lora_" in k)}
    merged_model, info = _base(merged_dir)
    out["merged"] = dict(_transformers_loss_and_grads(merged_model, batch),
                         loading_info={k: v for k, v in info.items() if v})
    merged = _per_expert(os.path.basename(os.path.dirname(model_dir)),
                         dict(model.merge_and_unload().named_parameters()))
    exported = safetensors.torch.load_file(os.path.join(merged_dir, "model.safetensors"))
    out["merge_unmatched"] = sorted(set(exported) ^ set(merged))
    out["merge_diff"] = max(float((merged[k] - v).abs().max()) for k, v in exported.items() if k in merged)
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

_WRITTEN = {}


def written():
    if not _WRITTEN:
        root = moe._docs()._scratch()
        batch = os.path.join(root, "batch.jsonl")
        moe._ref().write_jsonl(batch, moe._ref().make_batch({"vocab_size": moe.VOCAB}, moe.LENGTHS, seed=41))
        _WRITTEN.update(root=root, batch=batch, peft=moe._ref().venv_json(__file__, "write", root, batch))
    return _WRITTEN


def _dir(name, leaf):
    return os.path.join(written()["root"], name, leaf)


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", MODELS)


def test_peft_target_parameters_layout(name):
    """PEFT's ParamWrapper on the fused experts: A [E r, in], B [out, r E] per expert weight, gate_up_proj's wrapper
    inside down_proj's (base_layer), the delta the rule the engine implements; the saved names are these."""
    want = written()["peft"][name]
    E, I, d = moe.EXPERTS["num_experts"], moe.EXPERTS["moe_intermediate_size"], moe.ATTENTION["hidden_size"]
    if name == "mixtral":
        I = moe.MODELS["mixtral"][2]["intermediate_size"]
    expected = {}
    for layer in moe.MODELS[name][3]:
        prefix = f"model.layers.{layer}.mlp.experts."
        expected[prefix + "base_layer."] = ["gate_up_proj", E, [E * RANK, d], [2 * I, RANK * E]]
        expected[prefix] = ["down_proj", E, [E * RANK, I], [d, RANK * E]]
    assert want["wrappers"] == expected, want["wrappers"]
    assert want["delta_rule"] <= 1e-15, want["delta_rule"]
    tensors, _, _ = moe._ref().read_safetensors(os.path.join(_dir(name, "peft_adapter"), "adapter_model.safetensors"))
    for path in expected:
        for ab in "AB":
            assert f"{PEFT_PREFIX}{path}lora_{ab}.weight" in tensors, sorted(tensors)


def test_peft_adapter_gradients_match_engine(name):
    """PEFT's adapter (attention + experts) in the engine: the loss and every adapter gradient are PEFT's."""
    want = written()["peft"][name]
    assert want["grads"] and all(any(g) for g in want["grads"].values()), name
    assert any(".experts.base_layer.lora_B" in n for n in want["grads"]), sorted(want["grads"])
    out = _dir(name, "grads.safetensors")
    failures = []
    for strategy, chunk, page in RUNS:
        loss, grads, _ = moe._ref().grad_dump(_dir(name, "model"), written()["batch"], out, strategy, page,
                                              lm_chunk=7, chunk=chunk,
                                              flags=[f"--lora_init={_dir(name, 'peft_adapter')}"])
        worst = moe._docs()._worst((loss, grads), want)
        label = f"{name} PEFT adapter {strategy} chunk={chunk} page={page}"
        print(f"{label}: loss {loss:.17g} (PEFT {want['loss']:.17g}), worst rel {worst:.2e}")
        if not worst <= TOLERANCE:
            failures.append(f"{label}: rel {worst:.2e}")
    assert not failures, "the engine differs from PEFT: " + "; ".join(failures)


def test_engine_adapter_and_merged_export_load_in_peft_and_transformers(name):
    """The engine's saved adapter is PEFT's file back (target_parameters recorded); PeftModel loads it with the
    engine's loss and gradients; transformers loads the merged export whole, with the engine's loss and gradients."""
    import numpy as np

    ref = moe._ref()
    model_dir, peft_adapter = _dir(name, "model"), _dir(name, "peft_adapter")
    saved, merged = _dir(name, "engine_adapter"), _dir(name, "merged")
    loss, grads, _ = ref.grad_dump(model_dir, written()["batch"], _dir(name, "g.safetensors"), "seco", 16,
                                   lm_chunk=7, chunk=10,
                                   flags=[f"--lora_init={peft_adapter}", f"--lora_save={saved}",
                                          f"--merged_out={merged}"])
    theirs, _, _ = ref.read_safetensors(os.path.join(peft_adapter, "adapter_model.safetensors"))
    ours, _, _ = ref.read_safetensors(os.path.join(saved, "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for n in theirs:
        assert ours[n].tobytes() == theirs[n].tobytes(), f"{n} changed in the engine's round trip"
    with open(os.path.join(saved, "adapter_config.json")) as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == sorted(MODULES), config
    assert sorted(config["target_parameters"]) == ENGINE_PARAMETERS and config["lora_dropout"] == 0, config

    r = ref.venv_json(__file__, "load", model_dir, saved, merged, written()["batch"])
    assert r["adapter_loading"] == {"unexpected": [], "missing": []}, r["adapter_loading"]
    worst = moe._docs()._worst((loss, grads), r)
    print(f"{name}: PeftModel on the engine's adapter: loss {r['loss']:.17g} (engine {loss:.17g}), worst rel "
          f"{worst:.2e}; merge_and_unload() vs the export {r['merge_diff']:.2e}")
    assert worst <= TOLERANCE, f"{name}: PeftModel on the engine's adapter differs from the engine: rel {worst:.2e}"
    assert not r["merge_unmatched"] and r["merge_diff"] <= MERGE_AGREEMENT, (r["merge_unmatched"], r["merge_diff"])

    want = r["merged"]
    assert not want["loading_info"], want["loading_info"]
    # Against the base in the same (published, per-expert) layout: the adapted weights changed, nothing else.
    before, _, _ = ref.read_safetensors(os.path.join(_dir(name, "published"), "model.safetensors"))
    after, _, _ = ref.read_safetensors(os.path.join(merged, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    changed = sorted(n for n in before if not np.array_equal(after[n], before[n]))
    experts = ("w1.weight", "w2.weight", "w3.weight") if name == "mixtral" else \
        ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    expert_weights = [n for n in before if ".experts." in n and n.endswith(experts)]
    assert expert_weights and set(expert_weights) <= set(changed), (expert_weights, changed)
    assert all(n in expert_weights or n.rsplit(".", 2)[-2] in MODULES for n in changed), changed
    assert abs(want["loss"] - r["loss"]) <= TOLERANCE * abs(r["loss"]), (want["loss"], r["loss"])
    moe._hybrid().check_runs(f"{name} merged", merged, written()["batch"], want, [("full", 512, 16), ("seco", 10, 3)])


def test_peft_retargets_transformers_4_expert_modules(name):
    """PEFT 0.21 turns the expert module names of transformers 4 (gate_proj/up_proj/down_proj; Mixtral's w1/w3/w2)
    into target_parameters of the fused experts, gate_up_proj with twice the rank and alpha (the reason the engine
    refuses those module targets on qwen3_moe and qwen3_next); "all-linear" adds the routers ("gate.weight")."""
    got = written()["peft"][name]["v4_targets"]
    assert got["target_modules"] == ["q_proj"], got
    assert got["target_parameters"] == ["down_proj", "gate_up_proj"], got
    assert got["rank_pattern"] == {r".*\.gate_up_proj": 2 * RANK}, got
    assert got["alpha_pattern"] == {r".*\.gate_up_proj": 2 * ALPHA}, got
    assert "gate.weight" in got["all_linear_parameters"], got


def test_all_linear_adapter_refused(name):
    """PEFT's "all-linear" adapter on a MoE model (routers adapted, gate_up_proj at twice the rank) is refused before
    any work, naming the file and the field."""
    out = _dir(name, "unused.safetensors")
    proc = moe._ref().run([moe._ref().grad_dump_path(), f"--model_dir={_dir(name, 'model')}",
                           f"--batch_jsonl={written()['batch']}", f"--out={out}",
                           f"--lora_init={_dir(name, 'all_linear_adapter')}"], check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "all_linear_adapter/adapter_config.json: field 'rank_pattern'" in proc.stderr, proc.stderr
    assert not os.path.exists(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"]:
        print(json.dumps(write(*sys.argv[2:])))
        sys.exit(0)
    if sys.argv[1:2] == ["load"]:
        print(json.dumps(load(*sys.argv[2:])))
        sys.exit(0)
    moe._ref().main(__file__)
