"""Packed documents against transformers 5.23 run document by document, in float64.

For a tiny Llama (GQA), Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (per-head q/k norms, head_dim unlike
hidden_size / heads, o_proj bias) made by transformers, a JSONL batch of two records packs documents: one by
"doc_lengths" (7, 3, 12, 9 tokens), one by Hugging Face's flattened "position_ids" (5, 11, 2). grad_dump (the engine)
trains the batch with full, seco and streambp, with KV pages of 3 or 4 tokens (the 2- and 3-token documents are
shorter than a page) and chunks of 4 or 5 tokens that cut documents. transformers runs each document as its own
sequence; the mean token loss over all of them and every parameter gradient must match to 1e-10 relative.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      documents_hf_test.py make DIR FAMILY        the tiny model (config.json + model.safetensors, float64)
      documents_hf_test.py reference DIR BATCH    {"loss", "grads": {name: [...]}} of the documents alone, as JSON
    transformers computes RoPE, RMSNorm and softmax in float32 even in a float64 model; its float32 is made float64
    here, so the comparison is exact to rounding.
  * the test, under the pinned /usr/bin/python3 (torch_ref_test's grad_dump runner and safetensors reader).
"""
import json
import os
import subprocess
import sys

TOLERANCE = 1e-10
DOC_LENGTHS = [7, 3, 12, 9]
POSITION_DOCS = [5, 11, 2]
RUNS = [("full", 512, 4), ("seco", 5, 4), ("seco", 4, 3), ("streambp", 4, 3), ("streambp", 5, 4)]
FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 50


# ---- the venv half ----------------------------------------------------------------------------------------------

def _float64_transformers():
    """transformers' modeling code, with its float32 (and torch.float) meaning float64."""
    import types

    import torch
    import transformers.modeling_rope_utils as rope_utils
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.float32 = proxy.float = torch.float64
    for module in (rope_utils, llama, qwen2, qwen3):
        module.torch = proxy
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


def reference(directory, batch):
    _float64_transformers()
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="eager")
    total, count = torch.zeros(()), 0
    for line in open(batch):
        for doc in documents(json.loads(line)):
            x = torch.tensor([doc])
            total = total + F.cross_entropy(model(input_ids=x).logits[0, :-1], x[0, 1:], reduction="sum")
            count += len(doc) - 1
    loss = total / count
    loss.backward()
    print(json.dumps({"loss": loss.item(), "grads": {n: p.grad.flatten().tolist()
                                                     for n, p in model.named_parameters()}}))


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


def _rel(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def test_packed_documents_match_transformers_document_by_document():
    import tempfile

    import pytest

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_ref_test as ref

    pip_venv = os.environ.get("SG_PIP_VENV") or ref._runfile("tests/e2e/pip_venv.sh")
    if not pip_venv:
        pytest.fail("tests/e2e/pip_venv.sh not found (pass --pip_venv=PATH)")
    python = os.path.join(subprocess.check_output(["bash", pip_venv], text=True).strip(), "bin", "python")
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    batch = os.path.join(tmp, "batch.jsonl")
    with open(batch, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in batch_records())
    failures = []
    for family in FAMILIES:
        model_dir = os.path.join(tmp, family)
        subprocess.run([python, os.path.abspath(__file__), "make", model_dir, family], check=True)
        want = json.loads(subprocess.run([python, os.path.abspath(__file__), "reference", model_dir, batch],
                                         check=True, capture_output=True, text=True).stdout)
        for strategy, chunk, page in RUNS:
            loss, grads = ref.run_grad_dump(model_dir, batch, os.path.join(tmp, "g.safetensors"), strategy, page,
                                            lm_chunk=7, chunk=chunk)
            assert set(grads) == set(want["grads"]), (family, sorted(grads))
            worst = max([abs(loss - want["loss"]) / abs(want["loss"])] +
                        [_rel(grads[n], want["grads"][n]) for n in want["grads"]])
            print(f"{family} {strategy} chunk={chunk} page={page}: loss {loss:.17g}, worst rel {worst:.2e}")
            if not worst <= TOLERANCE:
                failures.append(f"{family} {strategy} chunk={chunk} page={page}: rel {worst:.2e}")
    assert not failures, "packed documents differ from transformers: " + "; ".join(failures)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("make", "reference"):
        {"make": make, "reference": reference}[sys.argv[1]](*sys.argv[2:])
        sys.exit(0)
    import pytest

    args = []
    for a in sys.argv[1:]:
        if a.startswith("--grad_dump="):
            os.environ["SG_GRAD_DUMP"] = os.path.abspath(a.split("=", 1)[1])
        elif a.startswith("--pip_venv="):
            os.environ["SG_PIP_VENV"] = os.path.abspath(a.split("=", 1)[1])
        else:
            args.append(a)
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-s", "-p", "no:cacheprovider"] + args))
