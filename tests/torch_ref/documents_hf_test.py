"""Packed documents against transformers 5.23 run document by document, in float64.

For a tiny Llama (GQA), Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (per-head q/k norms, head_dim unlike
hidden_size / heads, o_proj bias) made by transformers, and a tiny Mamba-1 (MambaForCausalLM: conv kernel 4, tied
embeddings, in/out_proj biases; torch_ref_test.py's weights), a JSONL batch of two records packs documents: one by
"doc_lengths" (7, 3, 12, 9 tokens), one by Hugging Face's flattened "position_ids" (5, 11, 2). grad_dump (the engine)
trains the batch with every exact strategy: full, ckpt, seco, spaco (a budget of every chunk: each is kept, the
compensation is 1), streambp, and on Mamba adjoint (pairs, with and without a window that only pairs within one
document reach, and scan). Transformers use KV pages of 3 or 4 tokens (the 2- and 3-token documents are shorter than a
page); chunks of 4 or 5 tokens cut documents, and the 2- and 3-token ones are shorter than a chunk and no longer
than Mamba's conv tail (3 tokens). transformers runs each document as its own sequence; the mean token loss over all
of them and every parameter gradient must match to 1e-10 relative. The same batch unpacked (no documents, only the
labels across documents masked) must not match: the check sees what crosses a document boundary.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      documents_hf_test.py reference DIR BATCH [FAMILY]
          {"loss", "grads": {name: [...]}} of the documents alone, as JSON; with FAMILY (llama, qwen2, qwen3) it
          first makes the tiny model in DIR (config.json + model.safetensors, float64).
    transformers computes RoPE, RMSNorm, softmax and Mamba's scan parameters in float32 even in a float64 model; its
    float32 is made float64 here, so the comparison is exact to rounding.
  * the test, under the pinned /usr/bin/python3 (torch_ref_test's grad_dump and venv runners, safetensors reader
    and Mamba weights).
"""
import json
import os
import sys

TOLERANCE = 1e-10
DOC_LENGTHS = [7, 3, 12, 9]
POSITION_DOCS = [5, 11, 2]
# (strategy, chunk, KV page, grad_dump flags...). spaco: chunks of 15 make two of each record (30 and 17 positions)
# and cut a document in each; a budget of 2 keeps every chunk. adjoint's window: the tightest exact one, as no
# pair (t, i) reaches across a document and the last position of one has no label (the next document's first token).
SPACO_EXACT = ("spaco", 15, 3, "--spaco_budget=2")
RUNS = [("full", 512, 4), ("ckpt", 512, 3), ("seco", 5, 4), ("seco", 4, 3), SPACO_EXACT, ("streambp", 4, 3),
        ("streambp", 5, 4)]
MAMBA_RUNS = [("full", 512, 16), ("ckpt", 512, 16), ("seco", 4, 16), ("seco", 5, 16), SPACO_EXACT,
              ("streambp", 4, 16), ("adjoint", 5, 16, "--adjoint_form=pairs"),
              ("adjoint", 4, 16, "--adjoint_form=pairs", f"--adjoint_window={max(DOC_LENGTHS + POSITION_DOCS) - 1}"),
              ("adjoint", 4, 16, "--adjoint_form=scan"), ("adjoint", 5, 16, "--adjoint_form=scan")]
FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 50
UNPACKED_DIFFERS = 1e-6  # the batch without documents is at least this far from the documents alone


# ---- the venv half ----------------------------------------------------------------------------------------------

# transformers' modeling modules whose float32 is made float64 (the hybrids' and the mixtures of experts' too:
# qwen3_next_hf_test.py, moe_hf_test.py, mamba2_hf_test.py).
FLOAT64_MODULES = ("modeling_rope_utils", "models.llama.modeling_llama", "models.mamba.modeling_mamba",
                   "models.qwen2.modeling_qwen2", "models.qwen3.modeling_qwen3",
                   "models.qwen3_next.modeling_qwen3_next", "models.qwen3_5.modeling_qwen3_5",
                   "models.qwen3_moe.modeling_qwen3_moe", "models.mixtral.modeling_mixtral",
                   "models.qwen3_5_moe.modeling_qwen3_5_moe", "models.mamba2.modeling_mamba2",
                   "models.bamba.modeling_bamba", "models.nemotron_h.modeling_nemotron_h",
                   "models.falcon_h1.modeling_falcon_h1")


def _float64_transformers():
    """transformers' modeling code, with its float32 (and torch.float) meaning float64."""
    import importlib
    import types

    import torch

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.float32 = proxy.float = torch.float64
    for name in FLOAT64_MODULES:
        importlib.import_module("transformers." + name).torch = proxy
    torch.Tensor.float = torch.Tensor.double  # Mamba's mixer: A_log.float(), D.float(), B.float(), ...
    torch.set_default_dtype(torch.float64)


def make(directory, family):
    import torch
    import transformers

    torch.set_default_dtype(torch.float64)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if family == "llama":
        config, cls = transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(**common, head_dim=6, attention_bias=True, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():  # large enough that attention and positions matter to the loss
            p.copy_(torch.randn_like(p) * (1.0 if p.dim() == 1 else 0.4))
    model.save_pretrained(directory)


def reference(directory, batch, family=None):
    if family:
        make(directory, family)
    _float64_transformers()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="eager")
    print(json.dumps(loss_and_grads(model, batch)))


def loss_and_grads(model, batch):
    """{"loss": the mean token loss of the JSONL batch, "grads": {name: flat gradient}} (parameters the loss uses).
    A packed record's documents are each a sequence of their own; a record with "labels" is one sequence with its
    labels (Hugging Face's: unshifted, -100 ignored)."""
    import torch
    import torch.nn.functional as F

    total, count = torch.zeros(()), 0
    for line in open(batch):
        record = json.loads(line)
        for ids, labels in sequences(record):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            total = total + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            count += int((targets != -100).sum())
    loss = total / count
    loss.backward()
    return {"loss": loss.item(),
            "grads": {_saved_name(model, n): p.grad.flatten().tolist() for n, p in model.named_parameters()
                      if p.grad is not None}}


def _saved_name(model, name):
    """A parameter's name in the checkpoint: transformers 5.23 saves Nemotron-H's model.* as the published
    backbone.*."""
    if model.config.model_type == "nemotron_h" and name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name


def sequences(record):
    """(tokens, labels) of each sequence of a record: the record with its labels, or each document alone."""
    if "labels" in record:
        return [(record["input_ids"], record["labels"])]
    return [(doc, doc) for doc in documents(record)]


def documents(record):
    """The token lists of a packed record's documents (by doc_lengths, or where position_ids restart at 0)."""
    ids = record["input_ids"]
    if "doc_lengths" in record:
        lengths = record["doc_lengths"]
    else:
        starts = [i for i, p in enumerate(record["position_ids"]) if p == 0] + [len(ids)]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n
    return out


# ---- the test half ----------------------------------------------------------------------------------------------

def batch_records():
    packed = [(3 * i + 7) % VOCAB for i in range(sum(DOC_LENGTHS))]
    by_positions = [(5 * i + 2) % VOCAB for i in range(sum(POSITION_DOCS))]
    return [{"input_ids": packed, "doc_lengths": DOC_LENGTHS},
            {"input_ids": by_positions, "position_ids": [p for n in POSITION_DOCS for p in range(n)]}]


def unpacked_records():
    """The batch as plain sequences: no documents, and the labels of documents' first tokens masked, as packing
    masks them, so that only what crosses a document boundary differs."""
    out = []
    for record in batch_records():
        labels, start = list(record["input_ids"]), 0
        for doc in documents(record):
            labels[start] = -100
            start += len(doc)
        out.append({"input_ids": record["input_ids"], "labels": labels})
    return out


def _rel(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def _write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _ref():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_ref_test

    return torch_ref_test


def _scratch():
    import tempfile

    return tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))


def _reference(model_dir, batch, *family):
    """transformers' loss and gradients of the batch's documents alone (the venv half)."""
    return _ref().venv_json(__file__, "reference", model_dir, batch, *family)


def _worst(engine, want):
    loss, grads = engine
    assert set(grads) == set(want["grads"]), sorted(set(grads) ^ set(want["grads"]))
    return max([abs(loss - want["loss"]) / abs(want["loss"])] + [_rel(grads[n], want["grads"][n]) for n in grads])


def check_documents(label, model_dir, runs, family=None):
    """Every run of the packed batch matches transformers' documents to TOLERANCE; the unpacked batch does not.
    family: transformers makes the model in model_dir first."""
    ref = _ref()
    tmp = os.path.dirname(model_dir)
    batch = _write_jsonl(os.path.join(tmp, "batch.jsonl"), batch_records())
    want = _reference(model_dir, batch, *([family] if family else []))
    out = os.path.join(tmp, "g.safetensors")
    failures = []
    for strategy, chunk, page, *flags in runs:
        loss, grads, _ = ref.grad_dump(model_dir, batch, out, strategy, page, lm_chunk=7, chunk=chunk, flags=flags)
        worst = _worst((loss, grads), want)
        name = " ".join([label, strategy, f"chunk={chunk}", f"page={page}"] + flags)
        print(f"{name}: loss {loss:.17g}, worst rel {worst:.2e}")
        if not worst <= TOLERANCE:
            failures.append(f"{name}: rel {worst:.2e}")
    unpacked = _write_jsonl(os.path.join(tmp, "unpacked.jsonl"), unpacked_records())
    apart = _worst(ref.run_grad_dump(model_dir, unpacked, out, "full", 4, lm_chunk=7), want)
    print(f"{label} unpacked: worst rel {apart:.2e}")
    assert apart > UNPACKED_DIFFERS, f"{label}: the unpacked batch matches the documents too (rel {apart:.2e})"
    assert not failures, "packed documents differ from transformers: " + "; ".join(failures)


def pytest_generate_tests(metafunc):  # the venv half has no pytest to import
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", FAMILIES)


def test_transformer_documents_match_transformers_document_by_document(family):
    check_documents(family, os.path.join(_scratch(), "model"), RUNS, family)


def test_mamba_documents_match_transformers_document_by_document():
    ref = _ref()
    hf = dict(ref.MAMBA_CONFIGS["mamba_tied"], use_bias=True)
    model_dir = os.path.join(_scratch(), "model")
    ref.write_model_dir(model_dir, hf, ref.make_mamba_weights(hf, 7))
    check_documents("mamba", model_dir, MAMBA_RUNS)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reference"]:
        reference(*sys.argv[2:])
        sys.exit(0)
    _ref().main(__file__)
