"""Mamba-2, Bamba, Nemotron-H and Falcon-H1 against transformers 5.23, in float64.

transformers makes tiny models with random weights (every parameter drawn, so that every gradient matters: the
norms' weights, A_log, dt_bias, D, the conv kernels and biases, the gated norm's weight):
  * mamba2 (Mamba2ForCausalLM): 2 layers, 4 heads of 8 in 2 groups (B and C shared by two heads), state 6, conv
    kernel 4, in/out_proj biases, time_step_limit (0.05, 1.5) (dt clamped on both sides for some tokens), untied head;
  * mamba2_tied: the same shapes, one group, tied embeddings, no projection biases, the default limit (0, inf);
  * bamba (BambaForCausalLM): Mamba-2, attention (GQA, RoPE on half of each head, q/k/v/o biases), Mamba-2, each
    layer with a SwiGLU MLP (biases); the pad token's embedding row gets no gradient from the lookup;
  * nemotron_h (NemotronHForCausalLM): Mamba-2, ReLU² MLP, attention without RoPE (head_dim 6 unlike hidden /
    heads), Mamba-2, ReLU² MLP; biases, dt clamped below at time_step_min; saved under backbone.* as published;
  * falcon_h1 (FalconH1ForCausalLM): 2 layers of attention (head_dim 6) beside Mamba-2 (mamba_d_ssm 24, 2 groups)
    on the same normed input, then a SwiGLU MLP, with every muP multiplier (embedding, lm_head, attention in/key/out,
    ssm in/out, ssm_multipliers over in_proj's z/x/B/C/dt, mlp gate/down) away from 1; the gated norm after the gate;
  * falcon_h1_ungated: the same without the gated norm (y silu(z), mamba_rms_norm false) and with a tied head.
Every model's SSD chunk (chunk_size) is 16 tokens. On a batch of 151 and 120 tokens (some labels masked), grad_dump
(the engine) runs full, ckpt, seco, spaco (a budget of every chunk: each is kept, the compensation is 1), streambp and
adjoint (its pairs and scan forms, no window) with chunks of 37 and 50 (neither a multiple of 16 nor dividing the
sequences, so seqgrad's chunks cut transformers' SSD chunks unevenly): the mean token loss and every parameter
gradient must match transformers' to 1e-10 relative. Packed documents (documents_hf_test's batch, each document run
alone by transformers) under full, seco, spaco, streambp and adjoint with chunks that cut documents and documents
shorter than the conv tail; adjoint's paper form (a pure scan stack's formula) is refused by name on the hybrids.
Finally //cli:train trains each model for two steps and saves it: transformers loads the
saved directory with no missing or unexpected keys, and its loss and gradients of the saved model are the engine's.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      mamba2_hf_test.py make ROOT BATCH [NAME...]
          makes the models (or those named) in ROOT/NAME/model and prints {NAME: reference} as JSON;
      mamba2_hf_test.py reference DIR BATCH
          prints the reference of the model in DIR: {"loss", "grads": {name: [...]}, "loading_info", "scan"}.
    transformers' float32 casts (residual_in_fp32, the norms, the SSD scan's .float()) are made float64
    (documents_hf_test's patch); the torch path of mamba2_chunk_scan is the one run (no hub kernels), and each call is
    recorded (its longest sequence, its chunk size).
  * the test, under the pinned /usr/bin/python3 (documents_hf_test's and torch_ref_test's runners and readers).
"""
import json
import os
import sys

TOLERANCE = 1e-10
VOCAB = 50
LENGTHS = [151, 120]
SSD_CHUNK = 16
# (strategy, chunk, KV page, grad_dump flags...): 150 and 119 positions make 3 chunks each of 50 (spaco needs equal
# counts), 5 and 4 of 37.
RUNS = [("full", 512, 16), ("ckpt", 512, 16), ("seco", 37, 16), ("seco", 50, 16), ("spaco", 50, 16, "--spaco_budget=3"),
        ("streambp", 37, 16), ("streambp", 50, 16), ("adjoint", 37, 16), ("adjoint", 50, 16, "--adjoint_form=scan")]
# documents_hf_test's packed batch (documents of 2..12 tokens): chunks that cut documents, documents shorter than the
# conv tail (3 tokens).
DOCUMENT_RUNS = [("full", 512, 4), ("seco", 5, 4), ("seco", 4, 3), ("spaco", 15, 3, "--spaco_budget=2"),
                 ("streambp", 4, 3), ("adjoint", 5, 4), ("adjoint", 4, 3, "--adjoint_form=scan")]
MAMBA2 = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=4, head_dim=8, expand=2, state_size=6,
              conv_kernel=4, chunk_size=SSD_CHUNK, layer_norm_epsilon=1e-5)
BAMBA = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, mamba_n_heads=4, mamba_d_state=6, mamba_n_groups=2,
             mamba_chunk_size=SSD_CHUNK, mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
             time_step_limit=(0.05, 1.5), max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=6, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=SSD_CHUNK,
                  use_bias=True, mlp_bias=True, time_step_min=0.05, layer_norm_epsilon=1e-5,
                  max_position_embeddings=256,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"])
# Falcon-H1: attention (head_dim 6 unlike hidden / heads) beside Mamba-2 (a mixer mamba_d_ssm = 24 wide, not
# mamba_expand x hidden_size) in every layer, then a SwiGLU MLP; muP multipliers none of which is 1.
FALCON_H1 = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=6, intermediate_size=24, mamba_d_ssm=24, mamba_n_heads=4, mamba_d_head=6, mamba_d_state=6,
                 mamba_n_groups=2, mamba_chunk_size=SSD_CHUNK, time_step_limit=(0.05, 1.5), rms_norm_eps=1e-5,
                 max_position_embeddings=256, embedding_multiplier=2.5, lm_head_multiplier=0.6,
                 attention_in_multiplier=1.3, key_multiplier=0.7, attention_out_multiplier=0.8, ssm_in_multiplier=1.2,
                 ssm_out_multiplier=0.9, ssm_multipliers=[0.8, 1.25, 0.6, 1.4, 0.75], mlp_multipliers=[0.85, 1.3])
MODELS = ("mamba2", "mamba2_tied", "bamba", "nemotron_h", "falcon_h1", "falcon_h1_ungated")


# ---- the venv half ----------------------------------------------------------------------------------------------

def _docs():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import documents_hf_test

    return documents_hf_test


def _transformers_model(name):
    """(config, model class) of one of MODELS, made by transformers."""
    import transformers

    if name == "bamba":
        return transformers.BambaConfig(**BAMBA), transformers.BambaForCausalLM
    if name.startswith("falcon_h1"):  # with the gated norm (after the gate), or y silu(z) and a tied head
        gated = name == "falcon_h1"
        config = transformers.FalconH1Config(**FALCON_H1, mamba_rms_norm=gated, mamba_norm_before_gate=False,
                                             tie_word_embeddings=not gated)
        assert config.head_dim == 6, config  # FalconH1Attention reads head_dim where the config has one
        return config, transformers.FalconH1ForCausalLM
    if name == "nemotron_h":
        return transformers.NemotronHConfig(**NEMOTRON_H, tie_word_embeddings=False), transformers.NemotronHForCausalLM
    if name == "mamba2":
        config = transformers.Mamba2Config(**MAMBA2, n_groups=2, use_bias=True, time_step_limit=(0.05, 1.5),
                                           tie_word_embeddings=False)
    else:
        assert name == "mamba2_tied", name
        config = transformers.Mamba2Config(**MAMBA2, n_groups=1, use_bias=False, tie_word_embeddings=True)
    return config, transformers.Mamba2ForCausalLM


def _randomise(model, seed):
    """Every parameter drawn: matrices and conv kernels ~ N(0, 0.4^2), norms' weights ~ 1 + N(0, 0.2^2), the other
    vectors (biases, D) ~ N(0, 0.3^2), dt_bias ~ N(0, 0.7^2) (some dt below and above the clamp's limits), A_log =
    log a with a ~ U(0.05, 2) (slow and fast decays over the 151 tokens)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(p, std):
        return torch.randn(p.shape, generator=generator, dtype=p.dtype) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.05 + 1.95 * torch.rand(p.shape, generator=generator, dtype=p.dtype)))
            elif name.endswith("dt_bias"):
                p.copy_(normal(p, 0.7))
            elif "norm" in name:
                p.copy_(1.0 + normal(p, 0.2))
            else:
                p.copy_(normal(p, 0.4 if p.dim() > 1 else 0.3))


def make(root, name, seed):
    """The model NAME in root/NAME/model, saved by transformers."""
    import torch

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    config, cls = _transformers_model(name)
    model = cls(config)
    _randomise(model, seed)
    directory = model_dir_in(root, name)
    model.save_pretrained(directory)
    return directory


SCAN = {}  # the calls of transformers' SSD scan since reference() began: calls, longest, chunk sizes


def _record_scan():
    """Each call of transformers' torch SSD scan (mamba2_chunk_scan) recorded: float64 throughout, its length."""
    import torch

    for module in _scan_modules():
        scan = module.mamba2_chunk_scan
        if getattr(scan, "recorded", False):
            continue

        def recorded(hidden_states, dt, A, B, C, chunk_size, *args, scan=scan, **kwargs):
            assert hidden_states.dtype == torch.float64 and dt.dtype == torch.float64, (hidden_states.dtype, dt.dtype)
            SCAN.update(calls=SCAN["calls"] + 1, longest=max(SCAN["longest"], hidden_states.shape[1]),
                        chunk_sizes=sorted(set(SCAN["chunk_sizes"]) | {chunk_size}))
            out = scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
            assert not isinstance(out, tuple) and out.dtype == torch.float64, out
            return out

        recorded.recorded = True
        module.mamba2_chunk_scan = recorded


def _scan_modules():
    import transformers.models.bamba.modeling_bamba as bamba
    import transformers.models.falcon_h1.modeling_falcon_h1 as falcon_h1
    import transformers.models.mamba2.modeling_mamba2 as mamba2
    import transformers.models.nemotron_h.modeling_nemotron_h as nemotron_h

    return mamba2, bamba, nemotron_h, falcon_h1


def reference(directory, batch):
    """transformers' loss and gradients of the batch on the model in directory (its config's class), in float64."""
    import torch
    import transformers

    _docs()._float64_transformers()
    for module in _scan_modules():  # their float32 casts (the gated norms, the scans) are float64
        assert module.torch.float32 is torch.float64, module
    _record_scan()
    SCAN.update(calls=0, longest=0, chunk_sizes=[])
    with open(os.path.join(directory, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    model, info = cls.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager",
                                      output_loading_info=True)
    model.config.use_cache = False  # the whole sequence at once, no recurrent cache
    out = _docs().loss_and_grads(model, batch)
    out["loading_info"] = {key: sorted(map(str, value)) for key, value in info.items()}
    out["scan"] = dict(SCAN)
    assert SCAN["calls"], SCAN
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

def _ref():
    return _docs()._ref()


def _write_batch(path):
    """LENGTHS tokens of [0, VOCAB) with labels as torch_ref_test makes them (some swapped, some masked, a run of
    15 masked in the longest)."""
    _ref().write_jsonl(path, _ref().make_batch({"vocab_size": VOCAB}, LENGTHS, seed=36))
    return path


_MODELS = {}


def models():
    """{"root", "batch", "refs": {NAME: reference}}: the models and their references, made once."""
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
    _docs()  # on the path
    import qwen3_next_hf_test

    qwen3_next_hf_test.check_runs(label, directory, batch, want, runs)


def test_references_are_sane():
    """The venv half: losses near log(VOCAB), every gradient finite and nonzero, the names the checkpoint's, the
    torch SSD scan run in float64 on the 151-token sequence in chunks of 16."""
    import numpy as np

    for name, ref in models()["refs"].items():
        tensors, _, _ = _ref().read_safetensors(os.path.join(model_dir(name), "model.safetensors"))
        assert set(ref["grads"]) == set(tensors), (name, sorted(set(ref["grads"]) ^ set(tensors)))
        assert not any(ref["loading_info"].values()), (name, ref["loading_info"])
        assert 2.0 < ref["loss"] < 10.0, (name, ref["loss"])
        for n, g in ref["grads"].items():
            g = np.asarray(g)
            assert np.all(np.isfinite(g)) and np.any(g != 0), (name, n)
        scan = ref["scan"]
        assert scan["longest"] == max(LENGTHS) and scan["chunk_sizes"] == [SSD_CHUNK], (name, scan)
        print(f"{name}: loss {ref['loss']:.6f}, {len(ref['grads'])} gradients, scan {scan}")


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", MODELS)


def test_gradients_match_transformers(name):
    check_runs(name, model_dir(name), models()["batch"], models()["refs"][name], RUNS)


def test_packed_documents_match_transformers_document_by_document(name):
    _docs().check_documents(f"{name} documents", model_dir(name), DOCUMENT_RUNS)


def test_adjoint_paper_form_refused_on_hybrids():
    """adjoint's paper form (the paper's formula for a stack of scan layers) is refused on the models with attention
    and MLP layers, naming it, before any work."""
    for name in ("bamba", "nemotron_h", "falcon_h1"):
        out = os.path.join(models()["root"], name, "unused.safetensors")
        proc = _ref().run([_ref().grad_dump_path(), f"--model_dir={model_dir(name)}",
                           f"--batch_jsonl={models()['batch']}", "--strategy=adjoint", "--adjoint_form=paper",
                           "--chunk=48", f"--out={out}"], check=False)
        assert proc.returncode == 1 and "--adjoint_form=paper" in proc.stderr, \
            f"{name}: --adjoint_form=paper must be refused by name (exit 1); exit {proc.returncode}: {proc.stderr}"
        assert not os.path.exists(out)


def test_trained_model_loads_into_transformers(name):
    """//cli:train on the model, saved: transformers loads it whole (the config's fields and every tensor), and
    transformers' loss and gradients of the saved model are the engine's."""
    import numpy as np
    import pytest

    train = _ref().train_path()
    if train is None:
        pytest.fail("//cli:train not found (pass --train=PATH)")
    source, batch = model_dir(name), models()["batch"]
    saved = os.path.join(os.path.dirname(source), "saved")
    _ref().run([train, f"--model={source}", f"--data={batch}", "--steps=2", "--seq_len=64", "--overlong=truncate",
                "--dtype=f64", "--strategy=seco", "--chunk=24", "--page_size=16", "--lr=0.01", f"--save={saved}"])
    before, _, _ = _ref().read_safetensors(os.path.join(source, "model.safetensors"))
    after, _, _ = _ref().read_safetensors(os.path.join(saved, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert any(not np.array_equal(after[n], before[n]) for n in before), "training changed nothing"
    with open(os.path.join(source, "config.json")) as f:
        source_config = json.load(f)
    with open(os.path.join(saved, "config.json")) as f:
        saved_config = json.load(f)
    for key, value in source_config.items():
        if key not in ("dtype", "transformers_version", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                       "initializer_range", "rescale_prenorm_residual", "residual_in_fp32", "time_step_floor",
                       "time_step_max", "time_step_min", "time_step_rank", "use_cache"):
            assert saved_config.get(key) == value, (key, saved_config.get(key), value)
    want = _ref().venv_json(__file__, "reference", saved, batch)
    assert not any(want["loading_info"].values()), want["loading_info"]
    check_runs(f"{name} saved", saved, batch, want, [("full", 512, 16)])


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
