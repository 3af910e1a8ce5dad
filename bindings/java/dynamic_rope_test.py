"""Dynamic NTK RoPE through the Java binding: Trainer.computeGradients' loss and gradients (rope/DynamicRope.java)
equal transformers' in float64 at T < M, T = M and T > M (tests/torch_ref/dynamic_rope_ref.py).
usage: dynamic_rope_test.py JAVA CLASSPATH PIP_VENV_SH DYNAMIC_ROPE_REF_PY"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[4])))
import dynamic_rope_ref as ref  # noqa: E402

if __name__ == "__main__":
    directory, want = ref.model_and_reference(sys.argv[3])
    classpath = ":".join(os.path.abspath(p) for p in sys.argv[2].split(":"))
    got = ref.per_sequence([os.path.abspath(sys.argv[1]), "-cp", classpath, "org.seqgrad.DynamicRope", directory])
    ref.check("Java", got, want)
