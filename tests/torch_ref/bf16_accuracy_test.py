"""--dtype=bf16 accuracy, the flash-attention habit: the engine's bf16 error must be within 2x (plus a floor) of
PyTorch's own bf16 autograd error, both against the same float64 reference.

For the tiny Llama (GQA) and Qwen2 models of torch_ref_test.py, with weights rounded to bf16 so that the bf16 and
float64 models are the same function: the float64 reference is plain torch autograd in float64; PyTorch's bf16 run is
the same code with every parameter and activation in bfloat16 (torch's CPU kernels); the engine runs grad_dump
--dtype=bf16 with strategies full, seco and streambp. For the loss and every parameter gradient,
rel_err(engine) <= 2 * rel_err(torch bf16) + FLOOR, rel_err = max |x - ref| / max |ref| (torch_ref_test.rel_error).

The engine stores weights, KV / KV-gradient pages and logits in bf16 (other activations are still f32), so its error
is below torch's (about 2e-2 against torch's 4-8e-2 on these models).
"""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ref_test as ref  # noqa: E402  (the plain-torch models, safetensors helpers and grad_dump runner)

FLOOR = 1e-3  # absolute, on the relative error: below it differences are fp32 rounding, not bf16
STRATEGIES = [("full", 512), ("seco", 16), ("streambp", 16)]


def round_to_bf16(weights):
    return {k: torch.tensor(v).to(torch.bfloat16).double().numpy() for k, v in weights.items()}


@pytest.mark.parametrize("config", ["llama_gqa", "qwen2_tied"])
def test_bf16_error_within_twice_torch_bf16(config):
    spec = ref.CONFIGS[config]
    hf = spec["hf"]
    root = ref.scratch_dir(f"bf16_{config}_")
    weights = round_to_bf16(ref.make_weights(hf, spec["seed"]))
    batch = ref.make_batch(hf, spec["lengths"], spec["seed"])
    model_dir = os.path.join(root, "model")
    ref.write_model_dir(model_dir, hf, weights)
    jsonl = os.path.join(root, "batch.jsonl")
    ref.write_jsonl(jsonl, batch)
    exact = ref.reference(hf, weights, batch)
    torch_bf16 = ref.reference(hf, weights, batch, dtype=torch.bfloat16)

    def errors(run):
        loss, grads = run
        out = {"loss": abs(loss - exact[0]) / abs(exact[0])}
        out.update({name: ref.rel_error(grads[name], g) for name, g in exact[1].items()})
        return out

    torch_err = errors(torch_bf16)
    assert max(torch_err.values()) > 1e-3, "torch's bf16 run must show bf16 rounding (is it really bf16?)"
    summary = []
    for strategy, chunk in STRATEGIES:
        out = os.path.join(root, f"grads_{strategy}.safetensors")
        loss, grads, metadata = ref.grad_dump(model_dir, jsonl, out, strategy, page_size=16, lm_chunk=7, chunk=chunk,
                                              flags=["--dtype=bf16"])
        assert metadata.get("dtype") == "bf16", metadata
        engine_err = errors((loss, grads))
        bad = {k: (e, torch_err[k]) for k, e in engine_err.items() if not e <= 2 * torch_err[k] + FLOOR}
        worst = max(engine_err, key=engine_err.get)
        summary.append(f"{config}/{strategy}: engine worst {worst} {engine_err[worst]:.2e} "
                       f"(torch bf16 there {torch_err[worst]:.2e}, torch worst {max(torch_err.values()):.2e})")
        assert not bad, f"{config}/{strategy}: engine bf16 error above 2x torch's + {FLOOR}: " + ", ".join(
            f"{k}: {e:.2e} vs torch {t:.2e}" for k, (e, t) in sorted(bad.items()))
    print("\n".join(["SUMMARY"] + summary))


def test_grad_dump_refuses_other_dtypes():
    c = ref.case("llama_gqa")
    proc = ref.run([ref.grad_dump_path(), f"--model_dir={c['model_dir']}", f"--batch_jsonl={c['jsonl']}",
                    "--dtype=f16", f"--out={os.path.join(c['root'], 'x.safetensors')}"], check=False)
    assert proc.returncode != 0 and "--dtype" in proc.stderr, proc.stderr


if __name__ == "__main__":
    ref.main(__file__)
