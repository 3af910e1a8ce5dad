"""Dynamic NTK RoPE through the C API: sg_trainer_compute_gradients' loss and gradients (dynamic_rope.c) equal
transformers' in float64 at T < M, T = M and T > M (tests/torch_ref/dynamic_rope_ref.py).
usage: dynamic_rope_test.py DYNAMIC_ROPE_BINARY PIP_VENV_SH DYNAMIC_ROPE_REF_PY"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[3])))
import dynamic_rope_ref as ref  # noqa: E402

if __name__ == "__main__":
    directory, want = ref.model_and_reference(sys.argv[2])
    ref.check("C", ref.per_sequence([sys.argv[1], directory]), want)
