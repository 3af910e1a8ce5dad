"""The Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next dense) against transformers 5.23, in float64.

transformers makes three tiny models with random weights (every parameter drawn, so that every gradient matters:
the zero-centred RMSNorm weights, A_log, dt_bias, the conv kernels, the q/k norms and the gated norm's weight):
  * qwen3_5_text (Qwen3_5ForCausalLM): layers [linear, linear, full, linear] as an explicit layer_types list, GQA
    (4 query heads, 2 kv heads, head_dim 8), RoPE on half of each head (partial_rotary_factor 0.5: 4 of 8 dims) with
    a text mrope_section, linear attention with 2 key heads of 4 and 4 value heads of 6 (two value heads per key
    head), conv kernel 4, untied head;
  * qwen3_next with num_experts 0 (a dense MLP in every layer), tied embeddings, the same shapes, its config.json
    with full_attention_interval 2 instead of layer_types (as the published Qwen3-Next configs: [linear, full] x 2);
  * qwen3_5 (Qwen3_5ForConditionalGeneration): the published layout, qwen3_5_text as text_config and a tiny vision
    tower, as transformers saves it (model.language_model.*, model.visual.*, lm_head.weight).
On a batch of 151 and 120 tokens (longer than transformers' delta-rule chunk of 64; some labels masked), grad_dump
(the engine) runs full, ckpt, seco, spaco (a budget of every chunk: each is kept, the compensation is 1) and
streambp with chunks of 48 and 50 (neither divides 64 nor the sequences), KV pages of 3 and 16 tokens and LM-head
chunks of 7 rows: the mean token loss and every parameter gradient must match transformers' to 1e-10 relative.
Packed documents on qwen3_5_text (documents_hf_test's batch, each document run alone by transformers) under full,
seco and streambp, chunks that cut documents and documents shorter than the conv tail; the adjoint strategy is
refused by name on every model. Finally //cli:train trains the published layout for two steps and saves it:
transformers loads the saved directory with no missing or unexpected keys, the vision tower is bit-identical to the
source's, and transformers' loss and gradients of the saved model are the engine's to 1e-10.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      qwen3_next_hf_test.py make ROOT BATCH [NAME...]
          makes the three models (or those named) in ROOT/NAME/model and prints {NAME: reference} as JSON;
      qwen3_next_hf_test.py reference DIR BATCH [bfloat16]
          prints the reference of the model in DIR: {"loss", "grads": {name: [...]}, "loading_info",
          "delta_rule": {"calls", "worst"}} (with bfloat16: transformers' own bf16 run, for bf16_accuracy_test).
    transformers' float32 casts (RoPE, RMSNorm, the gated norm, g, the chunked delta rule) are made float64
    (documents_hf_test's patch), and every call of the chunked delta rule is checked against transformers'
    token-by-token recurrent rule on the same inputs to DELTA_RULE_AGREEMENT.
  * the test, under the pinned /usr/bin/python3 (documents_hf_test's and torch_ref_test's runners and readers).
"""
import json
import os
import sys

TOLERANCE = 1e-10
DELTA_RULE_AGREEMENT = 1e-12  # transformers' chunked delta rule against its recurrent one, relative
VOCAB = 50
LENGTHS = [151, 120]  # 150 and 119 positions: 3 chunks each of 50 (spaco needs equal counts), 4 and 3 of 48
# (strategy, chunk, KV page, grad_dump flags...)
RUNS = [("full", 512, 16), ("ckpt", 512, 3), ("seco", 48, 3), ("seco", 50, 16), ("spaco", 50, 3, "--spaco_budget=3"),
        ("streambp", 48, 16), ("streambp", 50, 3)]
# documents_hf_test's packed batch (documents of 2..12 tokens): chunks that cut documents, pages longer than some of
# them, documents shorter than the conv tail (3 tokens).
DOCUMENT_RUNS = [("full", 512, 4), ("seco", 5, 4), ("seco", 4, 3), ("streambp", 4, 3), ("streambp", 5, 4)]
MODELS = ("qwen3_5_text", "qwen3_next", "qwen3_5")
TEXT = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=4, linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=256,
            rms_norm_eps=1e-6)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Rotary dim 4 = 2 frequencies in mrope's temporal, height and width sections (text: the same positions in each).
MROPE = {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
VISION = dict(depth=1, hidden_size=8, intermediate_size=16, num_heads=2, patch_size=2, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=16, num_position_embeddings=16)
VISUAL = "model.visual."


# ---- the venv half ----------------------------------------------------------------------------------------------

def _docs():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import documents_hf_test

    return documents_hf_test


def _transformers_model(name):
    """(config, model class) of one of MODELS, made by transformers."""
    import transformers

    text = dict(TEXT, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                rope_parameters=dict(ROPE, **MROPE), tie_word_embeddings=False)
    if name == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig(**text), transformers.Qwen3_5ForCausalLM
    if name == "qwen3_next":
        config = transformers.Qwen3NextConfig(**TEXT, full_attention_interval=2, rope_parameters=dict(ROPE),
                                              num_experts=0, tie_word_embeddings=True)
        return config, transformers.Qwen3NextForCausalLM
    assert name == "qwen3_5", name
    config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    return config, transformers.Qwen3_5ForConditionalGeneration


def _randomise(model, seed):
    """Every parameter drawn: matrices and conv kernels ~ N(0, 0.4^2), the zero-centred norms' w of (1 + w) and the
    other vectors ~ N(0, 0.3^2), the gated norm's weight ~ 1 + N(0, 0.2^2), dt_bias ~ N(0, 0.5^2), A_log = log a
    with a ~ U(0.02, 1) (slow and fast decays over the 151 tokens)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(p, std):
        return torch.randn(p.shape, generator=generator, dtype=p.dtype) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.98 * torch.rand(p.shape, generator=generator, dtype=p.dtype)))
            elif name.endswith("dt_bias"):
                p.copy_(normal(p, 0.5))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + normal(p, 0.2))
            else:
                p.copy_(normal(p, 0.4 if p.dim() > 1 else 0.3))


def make(root, name, seed):
    """The model NAME in root/NAME/model, saved by transformers (qwen3_next's config.json then given
    full_attention_interval in place of layer_types)."""
    import torch

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    config, cls = _transformers_model(name)
    model = cls(config)
    _randomise(model, seed)
    directory = model_dir_in(root, name)
    model.save_pretrained(directory)
    if name == "qwen3_next":
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            saved = json.load(f)
        assert saved.pop("layer_types") == ["linear_attention", "full_attention"] * 2, saved
        saved["full_attention_interval"] = 2
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)
    return directory


DELTA_RULE = {}  # the checks of the chunked delta rule since reference() began: calls, worst, longest


def _check_delta_rule():
    """transformers' chunked delta rule, each call compared with its recurrent rule on the same inputs."""
    import torch

    for module in _delta_rule_modules():
        chunked, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
        if getattr(chunked, "checked", False):
            continue

        def rule(query, key, value, g, beta, chunk_size=64, chunked=chunked, recurrent=recurrent, **kwargs):
            out = chunked(query, key, value, g=g, beta=beta, chunk_size=chunk_size, **kwargs)
            assert out[0].dtype == torch.float64, out[0].dtype
            with torch.no_grad():
                want = recurrent(query, key, value, g=g, beta=beta, **kwargs)[0]
            worst = float((out[0].detach() - want).abs().max() / want.abs().max())
            DELTA_RULE.update(calls=DELTA_RULE["calls"] + 1, worst=max(DELTA_RULE["worst"], worst),
                              longest=max(DELTA_RULE["longest"], query.shape[1]))
            return out

        rule.checked = True
        module.torch_chunk_gated_delta_rule = rule


def _delta_rule_modules():
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    return qwen3_5, qwen3_next


def reference(directory, batch, dtype="float64"):
    """transformers' loss and gradients of the batch on the model in directory (its config's class), in float64; or
    with dtype "bfloat16" as transformers runs the model in bf16 (its own float32 casts kept), for
    bf16_accuracy_test."""
    import torch
    import transformers

    exact = dtype == "float64"
    if exact:
        _docs()._float64_transformers()
        _check_delta_rule()
    DELTA_RULE.update(calls=0, worst=0.0, longest=0)
    with open(os.path.join(directory, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    model, info = cls.from_pretrained(directory, dtype=getattr(torch, dtype), attn_implementation="eager",
                                      output_loading_info=True)
    out = _docs().loss_and_grads(model, batch)
    out["loading_info"] = {key: sorted(map(str, value)) for key, value in info.items()}
    out["delta_rule"] = dict(DELTA_RULE)
    assert not exact or (DELTA_RULE["calls"] and DELTA_RULE["worst"] <= DELTA_RULE_AGREEMENT), DELTA_RULE
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

def _ref():
    return _docs()._ref()


def _write_batch(path):
    """LENGTHS tokens of [0, VOCAB) with labels as torch_ref_test makes them (some swapped, some masked, a run of
    15 masked in the longest)."""
    _ref().write_jsonl(path, _ref().make_batch({"vocab_size": VOCAB}, LENGTHS, seed=35))
    return path


_MODELS = {}


def models():
    """{"root", "batch", "refs": {NAME: reference}}: the three models and their references, made once."""
    if not _MODELS:
        root = _docs()._scratch()
        batch = _write_batch(os.path.join(root, "batch.jsonl"))
        refs = _ref().venv_json(__file__, "make", root, batch)
        _MODELS.update(root=root, batch=batch, refs=refs)
    return _MODELS


def model_dir(name):
    return model_dir_in(models()["root"], name)


def model_dir_in(root, name):
    return os.path.join(root, name, "model")


def check_runs(label, directory, batch, want, runs):
    """Every run's loss and gradients match want (documents_hf_test's relative norm) to TOLERANCE."""
    out = os.path.join(os.path.dirname(directory), "grads.safetensors")
    failures = []
    for strategy, chunk, page, *flags in runs:
        loss, grads, metadata = _ref().grad_dump(directory, batch, out, strategy, page, lm_chunk=7, chunk=chunk,
                                                 flags=flags)
        name = " ".join([label, strategy, f"chunk={chunk}", f"page={page}"] + flags)
        if strategy == "spaco":
            assert metadata["chunks_backpropagated"] == metadata["chunks"], (name, metadata)
        worst = _docs()._worst((loss, grads), want)
        print(f"{name}: loss {loss:.17g} (transformers {want['loss']:.17g}), worst rel {worst:.2e}")
        if not worst <= TOLERANCE:
            failures.append(f"{name}: rel {worst:.2e}")
    assert not failures, f"{label} differs from transformers: " + "; ".join(failures)


def test_references_are_sane():
    """The venv half: losses near log(VOCAB), every gradient finite and nonzero, the names the checkpoint's, the
    chunked delta rule run on the 151-token sequence and equal to the recurrent one."""
    import numpy as np

    for name, ref in models()["refs"].items():
        tensors, _, _ = _ref().read_safetensors(os.path.join(model_dir(name), "model.safetensors"))
        trained = {n for n in tensors if not n.startswith(VISUAL)}
        assert set(ref["grads"]) == trained, (name, sorted(set(ref["grads"]) ^ trained))
        assert not any(ref["loading_info"].values()), (name, ref["loading_info"])
        assert 2.0 < ref["loss"] < 10.0, (name, ref["loss"])
        for n, g in ref["grads"].items():
            g = np.asarray(g)
            assert np.all(np.isfinite(g)) and np.any(g != 0), (name, n)
        stats = ref["delta_rule"]
        assert stats["longest"] == max(LENGTHS) and stats["worst"] <= DELTA_RULE_AGREEMENT, (name, stats)
        print(f"{name}: loss {ref['loss']:.6f}, {len(ref['grads'])} gradients, delta rule {stats}")
    with open(os.path.join(model_dir("qwen3_next"), "config.json")) as f:
        config = json.load(f)
    assert config["full_attention_interval"] == 2 and "layer_types" not in config, config


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", MODELS)


def test_gradients_match_transformers(name):
    check_runs(name, model_dir(name), models()["batch"], models()["refs"][name], RUNS)


def test_packed_documents_match_transformers_document_by_document():
    _docs().check_documents("qwen3_5_text documents", model_dir("qwen3_5_text"), DOCUMENT_RUNS)


def test_adjoint_refused_by_name(name):
    """adjoint (the SSM strategy) does not apply to the hybrids: refused, naming it, before any work."""
    out = os.path.join(models()["root"], name, "unused.safetensors")
    proc = _ref().run([_ref().grad_dump_path(), f"--model_dir={model_dir(name)}",
                       f"--batch_jsonl={models()['batch']}", "--strategy=adjoint", "--chunk=48", f"--out={out}"],
                      check=False)
    assert proc.returncode == 1 and "adjoint" in proc.stderr, \
        f"{name}: --strategy=adjoint must be refused by name (exit 1); exit {proc.returncode}: {proc.stderr}"
    assert not os.path.exists(out)


def test_trained_conditional_layout_loads_into_transformers():
    """//cli:train on the published layout, saved: transformers loads it whole, the vision tower is the source's
    bit for bit, and transformers' loss and gradients of the saved model are the engine's."""
    import numpy as np
    import pytest

    train = _ref().train_path()
    if train is None:
        pytest.fail("//cli:train not found (pass --train=PATH)")
    source, batch = model_dir("qwen3_5"), models()["batch"]
    saved = os.path.join(os.path.dirname(source), "saved")
    _ref().run([train, f"--model={source}", f"--data={batch}", "--steps=2", "--seq_len=64", "--overlong=truncate",
                "--dtype=f64", "--strategy=seco", "--chunk=24", "--page_size=16", "--lr=0.01", f"--save={saved}"])

    before, before_dtypes, _ = _ref().read_safetensors(os.path.join(source, "model.safetensors"))
    after, after_dtypes, _ = _ref().read_safetensors(os.path.join(saved, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    visual = [n for n in before if n.startswith(VISUAL)]
    assert visual
    for n in visual:
        assert after_dtypes[n] == before_dtypes[n] and after[n].tobytes() == before[n].tobytes(), n
    assert any(not np.array_equal(after[n], before[n]) for n in before if n not in visual), "training changed nothing"
    with open(os.path.join(source, "config.json")) as f:
        source_config = json.load(f)
    with open(os.path.join(saved, "config.json")) as f:
        saved_config = json.load(f)
    for key in ("model_type", "architectures", "vision_config"):
        assert saved_config.get(key) == source_config[key], (key, saved_config.get(key), source_config[key])

    want = _ref().venv_json(__file__, "reference", saved, batch)
    assert not any(want["loading_info"].values()), want["loading_info"]
    check_runs("qwen3_5 saved", saved, batch, want, [("full", 512, 16)])


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:  # make ROOT BATCH [NAME...]: all MODELS by default
        root, batch, *names = sys.argv[2:]
        print(json.dumps({name: reference(make(root, name, seed), batch) for seed, name in enumerate(MODELS)
                          if name in (names or MODELS)}))
        sys.exit(0)
    if sys.argv[1:2] == ["reference"]:
        print(json.dumps(reference(*sys.argv[2:])))
        sys.exit(0)
    _ref().main(__file__)
