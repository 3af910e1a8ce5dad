"""Dynamic NTK RoPE through every entry point against transformers 5.23 in float64.

transformers rescales the base from the length of the input ids, T = len(input_ids) (max(position_ids) + 1), once
T > max_position_embeddings = M. The tiny Llama here has M = 16 and is run on single sequences of T = 10 (< M),
16 (= M) and 24 (> M) tokens; each entry point's loss and gradients (the CLI: per-token log-probs) must equal
transformers' to 1e-10 relative.

Two halves:
  * run in the venv of tests/e2e/pip_venv.sh (torch, transformers from PyPI) as a script:
      dynamic_rope_ref.py make DIR        a tiny dynamic-RoPE Llama (config.json + model.safetensors, float32)
      dynamic_rope_ref.py reference DIR   {"T": {"loss", "grads": {name: [...]}, "logprobs": [...]}} as JSON
    transformers computes RoPE, RMSNorm and softmax in float32 even in a float64 model (a 1e-7 floor); its modules'
    float32 is made float64 here, so the comparison is exact to rounding.
  * imported by each entry point's test (under the pinned /usr/bin/python3): sequences(), model_and_reference(),
    per_sequence() and check().
"""
import json
import os
import subprocess
import sys

MAX_POSITIONS = 16
LENGTHS = (10, 16, 24)  # T < M, T = M, T > M
VOCAB = 40
TOLERANCE = 1e-10


def sequences():
    """{T: token ids} of the sequences every entry point runs."""
    return {T: [(7 * i + 3 * T + 1) % VOCAB for i in range(T)] for T in LENGTHS}


# ---- the venv half ----------------------------------------------------------------------------------------------

def _float64_transformers():
    """transformers' modeling code, with its float32 (and torch.float) meaning float64."""
    import types

    import torch
    import transformers.modeling_rope_utils as rope_utils
    import transformers.models.llama.modeling_llama as llama

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.float32 = proxy.float = torch.float64
    for module in (rope_utils, llama):
        module.torch = proxy
    torch.set_default_dtype(torch.float64)


def make(directory):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # large enough that positions matter to the loss
            p.copy_(torch.randn_like(p) * (1.0 if p.dim() == 1 else 0.4))
    model.save_pretrained(directory)


def reference(directory):
    _float64_transformers()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="eager")
    out = {}
    for T, ids in sequences().items():
        model.zero_grad()
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0]
        logprobs = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]
        loss = -logprobs.mean()
        loss.backward()
        out[T] = {"loss": loss.item(), "logprobs": logprobs.tolist(),
                  "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}}
    print(json.dumps(out))


# ---- the test half ----------------------------------------------------------------------------------------------

def model_and_reference(pip_venv):
    """(the model's directory, {T: {"loss", "grads", "logprobs"}} of transformers), made in the venv of
    tests/e2e/pip_venv.sh (torch and transformers from PyPI, made once)."""
    import tempfile

    python = os.path.join(subprocess.check_output(["bash", pip_venv], text=True).strip(), "bin", "python")
    directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    subprocess.run([python, os.path.abspath(__file__), "make", directory], check=True)
    out = subprocess.run([python, os.path.abspath(__file__), "reference", directory], check=True,
                         capture_output=True, text=True).stdout
    return directory, {int(T): r for T, r in json.loads(out).items()}


def per_sequence(command):
    """{T: JSON object} from a program run as command + [the model's sequences, each comma-separated], which prints
    one JSON line per sequence."""
    seqs = sequences()
    out = subprocess.run(command + [",".join(map(str, ids)) for ids in seqs.values()], check=True,
                         capture_output=True, text=True).stdout
    return dict(zip(seqs, (json.loads(line) for line in out.splitlines())))


def _rel(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max()), float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def check(entry, got, ref, keys=("loss", "grads")):
    """Asserts that got[T] equals ref[T] for every T (loss, every gradient and/or log-probs); prints the worst."""
    failures = []
    for T in LENGTHS:
        worst = {}
        for key in keys:
            if key == "grads":
                assert set(got[T]["grads"]) == set(ref[T]["grads"]), (entry, T, sorted(got[T]["grads"]))
                pairs = [(got[T]["grads"][n], ref[T]["grads"][n]) for n in ref[T]["grads"]]
            else:
                pairs = [(got[T][key], ref[T][key])]
            diffs = [_rel(a, b) for a, b in pairs]
            worst[key] = (max(d[0] for d in diffs), max(d[1] for d in diffs))
        print(f"{entry} T={T} (M={MAX_POSITIONS}): " +
              ", ".join(f"{k} max abs {a:.2e} rel {r:.2e}" for k, (a, r) in worst.items()))
        failures += [f"T={T} {k}: rel {r:.2e}" for k, (_, r) in worst.items() if not r <= TOLERANCE]
    assert not failures, f"{entry} differs from transformers: " + "; ".join(failures)


if __name__ == "__main__":
    {"make": make, "reference": reference}[sys.argv[1]](*sys.argv[2:])
