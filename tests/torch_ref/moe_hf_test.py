"""Mixtures of experts against transformers 5.23, in float64.

transformers makes five tiny models with random weights (every parameter drawn; vocabulary 50, hidden 16, 4 experts
of moe_intermediate_size 8):
  * qwen3_moe (Qwen3MoeForCausalLM): 3 layers, top-2, norm_topk_prob false, mlp_only_layers [1] (layer 1 dense);
  * qwen3_moe_top3: 4 layers, top-3, norm_topk_prob true, decoder_sparse_step 2 (layers 1 and 3 sparse), tied
    embeddings;
  * mixtral (MixtralForCausalLM): 2 layers, top-2 (always renormalised), every layer sparse;
  * qwen3_next (Qwen3NextForCausalLM): layers [linear, full, linear] attention, top-2, a shared expert of 8 with its
    sigmoid gate, mlp_only_layers [2] (layer 2 dense);
  * qwen3_5_moe_text (Qwen3_5MoeForCausalLM, whose config is Qwen3_5MoeTextConfig, model_type "qwen3_5_moe_text"):
    the same layers, every layer sparse with a shared expert.
In every router, expert 2's row is expert 1's plus 1e-9 N(0, 1): on every token their probabilities differ by ~1e-9,
and on some tokens that pair straddles the top-k boundary (a near-tie). The float64 top-k must resolve each of them
the same way in the engine as in transformers; the venv half checks that no boundary gap is below RESOLVED (so
rounding cannot flip a choice) and that transformers' choice is the rule the engine implements: the k largest
probabilities, the lower expert index first on an exact tie. (transformers itself has no such rule: torch.topk on the
CPU breaks exact ties by its selection algorithm, e.g. topk([.1, .3, .3, .3], 1) is index 2, so no test can use
exact ties.)

Each model is written three times: model/ (fused experts under transformers 5's module names, mlp.experts.gate_up_proj
[E, 2I, H] and mlp.experts.down_proj [E, H, I]; output_router_logits false), model_aux/ (the same tensors,
output_router_logits true, router_aux_loss_coef AUX_COEF) and published/ (model_aux saved by transformers'
save_pretrained, which in 5.23 writes the published per-expert layout: mlp.experts.{i}.gate_proj/up_proj/down_proj
.weight, and Mixtral's block_sparse_moe.gate.weight and block_sparse_moe.experts.{i}.w1/w2/w3.weight (w1 gate, w3 up,
w2 down); its from_pretrained reads both layouts: the references load model/ and published/).

The references, on a batch of 53 and 38 tokens (some labels masked):
  * plain: the mean token loss over both sequences (each run alone) and every gradient;
  * aux: the loss transformers trains on for the padded batch with its attention mask: the mean token loss plus
    AUX_COEF x load_balancing_loss_func. That aux loss is E * sum_e f_e P_e, pooled over every sparse layer and every
    row that is not padding: f_e = (top-k assignments to e) / (L N), P_e = (router probabilities of e summed) / (L N),
    N = the rows of the batch, L = the sparse layers; only P carries a gradient. Its rows are the model's input rows:
    all n tokens of each sequence, the last one too, although for the loss that one is only a label (the engine's
    n-1 positions do not include it; it must route the last token through every layer for the aux loss). For two
    sequences of n1 and n2 tokens transformers counts, per call:
      - fed one by one: n1 rows, then n2 rows: two aux losses, whose mean is not the pooled one (a sum of products
        of means);
      - padded to n1 with an attention mask: n1 + n2 rows (the padding excluded), pooled: the reference;
      - padded without a mask: 2 n1 rows, the padding's rows among them.
    The reference is the masked padded batch's (the per-batch definition a Hugging Face trainer with a padding
    collator optimises): the venv half checks that transformers' aux loss is this formula over those n1 + n2 rows, that
    its token loss is the one-by-one mean, and reports the other three (one by one, unmasked, the engine's n1 + n2 - 2
    positions only), which the test requires to differ from it so that the engine cannot match by accident.

grad_dump (the engine) runs full, ckpt, seco with chunks of 10 and 16 (52 and 37 positions: uneven), spaco with chunks
of 18 (3 per sequence) and a budget of 3 (every chunk kept) and streambp with chunks of 7, on model/ and on
model_aux/ (the engine reads output_router_logits and router_aux_loss_coef from config.json); the loss and every
gradient must match the reference to 1e-10 relative (documents_hf_test's norm). On published/ the engine's gradients,
still named as transformers' modules, must equal those on model_aux/ (SAME_LAYOUT) and the reference.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      moe_hf_test.py make ROOT BATCH
          makes the models in ROOT/NAME/{model,model_aux,published} and prints {NAME: {"plain", "aux", ...}} as JSON.
    transformers' float32 casts (RoPE, RMSNorm, the routers' softmax(dtype=torch.float) and .float(),
    load_balancing_loss_func's float32 sums) are made float64 (documents_hf_test's patch); experts run eagerly.
  * the test, under the pinned /usr/bin/python3 (qwen3_next_hf_test's, documents_hf_test's and torch_ref_test's
    runners and readers).
"""
import json
import os
import shutil
import sys

TOLERANCE = 1e-10
SAME_LAYOUT = 1e-12  # the engine on published/ against model_aux/: the same numbers, loaded from other names
VOCAB = 50
LENGTHS = [53, 38]  # 52 and 37 positions
AUX_COEF = 0.05
NEAR_TIE_STEP = 1e-9  # router row 2 = row 1 + NEAR_TIE_STEP * N(0, 1)
NEAR_TIE = 1e-7  # a token whose k-th and (k+1)-th largest probabilities are closer than this is a near-tie
RESOLVED = 1e-13  # no k-th and (k+1)-th probabilities are closer: 100x float64 rounding, so both order them alike
DISTINCT = 1e-6  # the other aux-loss definitions differ from the reference's by at least this, relative
# (strategy, chunk, KV page, grad_dump flags...)
RUNS = [("full", 512, 16), ("ckpt", 512, 3), ("seco", 10, 3), ("seco", 16, 16), ("spaco", 18, 3, "--spaco_budget=3"),
        ("streambp", 7, 16)]
PUBLISHED_RUNS = [("full", 512, 16), ("seco", 10, 3)]
ATTENTION = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention"]
EXPERTS = dict(num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2)
# name: (config class, model class, config arguments, the sparse layers)
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(ATTENTION, **EXPERTS, intermediate_size=24, num_hidden_layers=3, norm_topk_prob=False,
                       mlp_only_layers=[1]), [0, 2]),
    "qwen3_moe_top3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(ATTENTION, **dict(EXPERTS, num_experts_per_tok=3), intermediate_size=24,
                            num_hidden_layers=4, norm_topk_prob=True, decoder_sparse_step=2,
                            tie_word_embeddings=True), [1, 3]),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(ATTENTION, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8, num_hidden_layers=2),
                [0, 1]),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "hybrid", [0, 1]),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "hybrid", [0, 1, 2]),
}
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe_text")  # RMSNorm scales by 1 + w: w drawn around 0, else around 1


# ---- the venv half ----------------------------------------------------------------------------------------------

def _docs():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import documents_hf_test

    return documents_hf_test


def _hybrid():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import qwen3_next_hf_test

    return qwen3_next_hf_test


def _config(name):
    import transformers

    config_class, _, arguments, _ = MODELS[name]
    if arguments == "hybrid":
        hybrid = _hybrid()
        text = {k: v for k, v in hybrid.TEXT.items() if k != "num_hidden_layers"}
        arguments = dict(text, **EXPERTS, num_hidden_layers=len(HYBRID_LAYERS), layer_types=HYBRID_LAYERS,
                         shared_expert_intermediate_size=8, tie_word_embeddings=False)
        if name == "qwen3_next":
            arguments.update(mlp_only_layers=[2], norm_topk_prob=True, rope_parameters=dict(hybrid.ROPE))
        else:
            del arguments["intermediate_size"]  # no dense layers
            arguments.update(rope_parameters=dict(hybrid.ROPE, **hybrid.MROPE))
    return getattr(transformers, config_class)(**arguments, output_router_logits=True,
                                               router_aux_loss_coef=AUX_COEF)


def _routers(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


def _randomise(model, name, seed):
    """qwen3_next_hf_test's draw; multiplicative norms around 1; router row 2 = row 1 + NEAR_TIE_STEP N(0, 1)."""
    import torch

    _hybrid()._randomise(model, seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        if name not in ZERO_CENTRED:
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(1.0)
        for router in _routers(model):
            w = router.weight
            w[2] = w[1] + NEAR_TIE_STEP * torch.randn(w.shape[1], generator=generator, dtype=w.dtype)


def make(root, name, seed):
    """NAME's three directories (the module docstring); returns their paths."""
    import torch
    from safetensors.torch import save_file

    _docs()._float64_transformers()
    torch.manual_seed(seed)
    model = getattr(__import__("transformers"), MODELS[name][1])(_config(name))
    _randomise(model, name, seed)
    dirs = {kind: os.path.join(root, name, kind) for kind in ("model", "model_aux", "published")}
    model.save_pretrained(dirs["published"])
    with open(os.path.join(dirs["published"], "config.json")) as f:
        config = json.load(f)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    for kind, router_logits in (("model", False), ("model_aux", True)):
        os.makedirs(dirs[kind])
        save_file(tensors, os.path.join(dirs[kind], "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(dirs[kind], "config.json"), "w") as f:
            json.dump(dict(config, output_router_logits=router_logits), f, indent=2)
    return dirs


def _load(directory):
    import torch
    import transformers

    with open(os.path.join(directory, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    model, info = cls.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager",
                                      experts_implementation="eager", output_loading_info=True)
    return model, {key: sorted(map(str, value)) for key, value in info.items()}


def _recording(model):
    """A list that every router call appends (logits [rows, E], chosen experts [rows, k]) to."""
    calls = []
    for router in _routers(model):
        router.register_forward_hook(lambda module, args, out: calls.append((out[0].detach(), out[2].detach())))
    return calls


def _aux(logits, top_k):
    """load_balancing_loss_func written out: E * sum_e f_e P_e over the rows of every layer's logits, pooled."""
    import torch

    rows = torch.cat(logits)
    probs = torch.softmax(rows, dim=-1)
    chosen = torch.zeros_like(probs).scatter_(1, torch.topk(probs, top_k, dim=-1).indices, 1.0)
    return float(probs.shape[1] * (chosen.mean(0) * probs.mean(0)).sum())


def _routing(calls, top_k):
    """The top-k of every recorded row against the engine's rule (the k largest probabilities, the lower index on an
    exact tie): whether they agree, the near-ties and the smallest gap at the top-k boundary."""
    import torch

    probs = torch.softmax(torch.cat([logits for logits, _ in calls]), dim=-1)
    chosen = torch.cat([experts for _, experts in calls])
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    gap = ordered[:, top_k - 1] - ordered[:, top_k]
    agree = torch.equal(order[:, :top_k].sort(-1).values, chosen.sort(-1).values)
    return {"rows": probs.shape[0], "agree": agree, "near_ties": int((gap < NEAR_TIE).sum()),
            "min_gap": float(gap.min()), "calls": len(calls)}


def _padded(batch):
    """The JSONL batch padded on the right to its longest sequence: (input_ids, attention_mask, labels, lengths)."""
    import torch

    records = [json.loads(line) for line in open(batch)]
    lengths = [len(r["input_ids"]) for r in records]
    width = max(lengths)
    ids = torch.tensor([r["input_ids"] + [0] * (width - n) for r, n in zip(records, lengths)])
    labels = torch.tensor([r["labels"] + [-100] * (width - n) for r, n in zip(records, lengths)])
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return ids, mask, labels, lengths


def _grads(model):
    return {n: p.grad.flatten().tolist() for n, p in model.named_parameters() if p.grad is not None}


def plain_reference(directory, batch, top_k):
    """The mean token loss of the sequences one by one and its gradients; the routing of every row."""
    model, info = _load(directory)
    calls = _recording(model)
    out = _docs().loss_and_grads(model, batch)
    routing = _routing(calls, top_k)
    assert routing["agree"] and routing["near_ties"] > 0 and routing["min_gap"] > RESOLVED, (directory, routing)
    return dict(out, loading_info=info, routing=routing)


def aux_reference(directory, batch, top_k, plain_loss):
    """transformers' training loss of the padded batch with its attention mask (token loss + AUX_COEF x aux loss) and
    its gradients, checked against the formula; the aux loss under the other row sets, for the record."""
    import torch

    model, info = _load(directory)
    calls = _recording(model)
    ids, mask, labels, lengths = _padded(batch)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    aux = float(out.aux_loss)
    layers = [logits.view(len(lengths), -1, logits.shape[-1]) for logits, _ in calls]

    def pooled(rows_of):  # the aux loss over rows_of(sequence, its length) of every sequence, every layer
        return _aux([torch.cat([layer[s, rows_of(n)] for s, n in enumerate(lengths)]) for layer in layers], top_k)

    formula = pooled(lambda n: slice(0, n))
    assert abs(formula - aux) <= 1e-13 * aux, (formula, aux)
    token_loss = float(out.loss) - AUX_COEF * aux
    assert abs(token_loss - plain_loss) <= 1e-12 * plain_loss, (token_loss, plain_loss)
    with torch.no_grad():
        unmasked = float(model(input_ids=ids, output_router_logits=True).aux_loss)
        one_by_one = [float(model(input_ids=ids[s:s + 1, :n], output_router_logits=True).aux_loss)
                      for s, n in enumerate(lengths)]
    return {"loss": float(out.loss), "grads": _grads(model), "loading_info": info, "aux_loss": aux,
            "token_loss": token_loss, "moe_layers": len(layers),
            "other_aux": {"mean_one_by_one": sum(one_by_one) / len(one_by_one), "padded_unmasked": unmasked,
                          "engine_positions_only": pooled(lambda n: slice(0, n - 1))}}


def saved_reference(directory, batch):
    """transformers' training loss and gradients of a saved model on the padded batch with its attention mask (the
    load-balancing loss as its config.json says), and what loading it reported."""
    _docs()._float64_transformers()
    model, info = _load(directory)
    ids, mask, labels, _ = _padded(batch)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return {"loss": float(out.loss), "grads": _grads(model), "loading_info": info}


def references(root, batch):
    out = {}
    for seed, name in enumerate(MODELS):
        dirs = make(root, name, seed)
        top_k = _config(name).num_experts_per_tok
        plain = plain_reference(dirs["model"], batch, top_k)
        out[name] = {"plain": plain, "aux": aux_reference(dirs["published"], batch, top_k, plain["loss"])}
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

def _ref():
    return _docs()._ref()


_MODELS = {}


def models():
    """{"root", "batch", "refs": {NAME: {"plain", "aux"}}}: the models and their references, made once."""
    if not _MODELS:
        root = _docs()._scratch()
        batch = os.path.join(root, "batch.jsonl")
        _ref().write_jsonl(batch, _ref().make_batch({"vocab_size": VOCAB}, LENGTHS, seed=41))
        _MODELS.update(root=root, batch=batch, refs=_ref().venv_json(__file__, "make", root, batch))
    return _MODELS


def model_dir(name, kind):
    return os.path.join(models()["root"], name, kind)


def _tensors(name, kind):
    return _ref().read_safetensors(os.path.join(model_dir(name, kind), "model.safetensors"))[0]


def _rel(a, b):
    return _docs()._rel(a, b)


def test_references_are_sane():
    """The venv half: losses near log(VOCAB), every gradient finite and nonzero under the fused names, both layouts
    loaded whole, the aux loss positive and changing the routers' gradients, every sparse layer routed (the venv half
    checked the near-ties), and the other aux-loss definitions apart from the reference's."""
    import numpy as np

    for name, refs in models()["refs"].items():
        fused = set(_tensors(name, "model"))
        for kind, ref in refs.items():
            assert set(ref["grads"]) == fused, (name, kind, sorted(set(ref["grads"]) ^ fused))
            assert not any(ref["loading_info"].values()), (name, kind, ref["loading_info"])
            assert 2.0 < ref["loss"] < 10.0, (name, kind, ref["loss"])
            for n, g in ref["grads"].items():
                g = np.asarray(g)
                assert np.all(np.isfinite(g)) and np.any(g != 0), (name, kind, n)
        plain, aux = refs["plain"], refs["aux"]
        routing, layers = plain["routing"], len(MODELS[name][3])
        print(f"{name}: loss {plain['loss']:.6f}, with aux {aux['loss']:.6f} (aux {aux['aux_loss']:.6f}), "
              f"routing {routing}, other aux {aux['other_aux']}")
        assert aux["moe_layers"] == layers and routing["calls"] == layers * len(LENGTHS), (name, aux, routing)
        assert routing["rows"] == layers * sum(LENGTHS), (name, routing)
        assert aux["aux_loss"] > 0 and abs(aux["token_loss"] - plain["loss"]) <= 1e-12 * plain["loss"], (name, aux)
        routers = [n for n in fused if n.endswith("mlp.gate.weight")]
        assert len(routers) == layers, (name, routers)
        for n in routers:
            assert _rel(aux["grads"][n], plain["grads"][n]) > DISTINCT, (name, n)
        for other, value in aux["other_aux"].items():
            assert abs(value - aux["aux_loss"]) > DISTINCT * aux["aux_loss"], (name, other, value, aux["aux_loss"])


def _published_prefix(name, layer):
    return f"model.layers.{layer}." + ("block_sparse_moe." if name == "mixtral" else "mlp.")


def test_transformers_saves_the_published_per_expert_layout(name):
    """save_pretrained (published/) writes every expert by itself, as the published checkpoints, with the fused
    directory's numbers: gate_up_proj[e] = [gate_e; up_e] (Mixtral: [w1; w3]), down_proj[e] = down_e (w2)."""
    import numpy as np

    fused, published = _tensors(name, "model_aux"), _tensors(name, "published")
    gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    want = dict(fused)
    for layer in MODELS[name][3]:
        fused_prefix, prefix = f"model.layers.{layer}.mlp.", _published_prefix(name, layer)
        want[prefix + "gate.weight"] = want.pop(fused_prefix + "gate.weight")
        gate_up = want.pop(fused_prefix + "experts.gate_up_proj")
        down_proj = want.pop(fused_prefix + "experts.down_proj")
        for e, (gate_up_e, down_e) in enumerate(zip(gate_up, down_proj)):
            want[f"{prefix}experts.{e}.{gate}.weight"], want[f"{prefix}experts.{e}.{up}.weight"] = \
                np.split(gate_up_e, 2)
            want[f"{prefix}experts.{e}.{down}.weight"] = down_e
    assert set(published) == set(want), (name, sorted(set(published) ^ set(want)))
    for n, w in want.items():
        assert np.array_equal(published[n], w), (name, n)


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", list(MODELS))


def test_gradients_match_transformers(name):
    _hybrid().check_runs(name, model_dir(name, "model"), models()["batch"], models()["refs"][name]["plain"], RUNS)


def test_gradients_with_aux_loss_match_transformers(name):
    _hybrid().check_runs(f"{name} aux", model_dir(name, "model_aux"), models()["batch"],
                         models()["refs"][name]["aux"], RUNS)


def test_published_layout_trains_as_the_fused_one(name):
    """The engine on published/ (per-expert names): the gradients of the fused module names, those of model_aux/ to
    SAME_LAYOUT and transformers' to TOLERANCE."""
    want, batch = models()["refs"][name]["aux"], models()["batch"]
    for strategy, chunk, page in PUBLISHED_RUNS:
        runs = {}
        for kind in ("model_aux", "published"):
            out = os.path.join(models()["root"], name, f"{kind}.grads.safetensors")
            loss, grads, _ = _ref().grad_dump(model_dir(name, kind), batch, out, strategy, page, lm_chunk=7,
                                              chunk=chunk)
            runs[kind] = (loss, grads)
        apart = _docs()._worst(runs["published"], {"loss": runs["model_aux"][0], "grads": runs["model_aux"][1]})
        worst = _docs()._worst(runs["published"], want)
        print(f"{name} published {strategy} chunk={chunk}: against fused {apart:.2e}, against transformers "
              f"{worst:.2e}")
        assert apart <= SAME_LAYOUT and worst <= TOLERANCE, (name, strategy, apart, worst)


def test_trained_published_layout_loads_into_transformers(name):
    """//cli:train (seco, with the load-balancing loss) on published/, saved: the experts one by one under the
    published names, which transformers loads with nothing missing or unexpected, and its loss and gradients of the
    saved model are the engine's."""
    import numpy as np
    import pytest

    train = _ref().train_path()
    if train is None:
        pytest.fail("//cli:train not found (pass --train=PATH)")
    source, batch = model_dir(name, "published"), models()["batch"]
    saved = os.path.join(models()["root"], name, "saved")
    _ref().run([train, f"--model={source}", f"--data={batch}", "--steps=2", "--seq_len=64", "--overlong=truncate",
                "--dtype=f64", "--strategy=seco", "--chunk=12", "--page_size=16", "--lr=0.01", f"--save={saved}"])
    before, _, _ = _ref().read_safetensors(os.path.join(source, "model.safetensors"))
    after, _, _ = _ref().read_safetensors(os.path.join(saved, "model.safetensors"))
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert any(not np.array_equal(after[n], before[n]) for n in before if ".experts." in n), "experts unchanged"
    want = _ref().venv_json(__file__, "saved", saved, batch)
    assert not any(want["loading_info"].values()), want["loading_info"]
    loss, grads, _ = _ref().grad_dump(saved, batch, os.path.join(saved, "grads.safetensors"), "full", 16, lm_chunk=7,
                                      chunk=512)
    worst = _docs()._worst((loss, grads), want)
    print(f"{name} trained and saved: loss {loss:.17g} (transformers {want['loss']:.17g}), worst rel {worst:.2e}")
    assert worst <= TOLERANCE, (name, worst)


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        print(json.dumps(references(*sys.argv[2:])))
        sys.exit(0)
    if sys.argv[1:2] == ["saved"]:
        print(json.dumps(saved_reference(*sys.argv[2:])))
        sys.exit(0)
    _ref().main(__file__)
