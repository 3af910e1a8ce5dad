"""Dynamic NTK RoPE through the Python binding: compute_gradients' loss and gradients and score's log-probs equal
transformers' in float64 at T < M, T = M and T > M (tests/torch_ref/dynamic_rope_ref.py). The RoPE length is the
sequence's token count, transformers' len(input_ids), whatever the chunking.
usage: dynamic_rope_test.py PIP_VENV_SH DYNAMIC_ROPE_REF_PY"""
import os
import sys

import numpy as np

import seqgrad

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[2])))
import dynamic_rope_ref as ref  # noqa: E402


def main():
    directory, want = ref.model_and_reference(sys.argv[1])
    got = {}
    with seqgrad.Model.load(directory, dtype="f64") as model, \
            seqgrad.Trainer(model, strategy="seco", chunk=7) as trainer:
        for T, ids in ref.sequences().items():
            loss = trainer.compute_gradients([ids])["loss"]
            grads = {name: np.asarray(g).ravel().tolist() for name, g in model.gradients().items()}
            logprobs = trainer.score([ids])[0]
            assert np.isnan(logprobs[0]) and len(logprobs) == T
            got[T] = {"loss": loss, "grads": grads, "logprobs": logprobs[1:].tolist()}
    ref.check("python", got, want, keys=("loss", "grads", "logprobs"))


if __name__ == "__main__":
    main()
