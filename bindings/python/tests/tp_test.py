"""Tensor parallelism from Python, run on each rank of mpirun -np 2 (bindings/python:tp_test): Trainer(tp=2) on
"demo" in fp64 gives one process's losses within 1e-12 relative, Model.parameters()/gradients() show the whole
model, Model.save() writes one process's model (rank 0), and bad tp values raise on every rank with the numbers.
Every rank also runs the one-process reference itself."""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seqgrad  # noqa: E402

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
BATCH = [[(i * 37 + 11) % 128 for i in range(40)], [(i * 13 + 5) % 128 for i in range(32)]]
OPTIONS = dict(strategy="seco", chunk=16, page_size=8, lr=1e-2)
TMP = os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp()


def relative(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-300)


def expect_error(kind, text, fn):
    try:
        fn()
    except kind as e:
        assert text in str(e), "rank %d: %r lacks %r" % (RANK, str(e), text)
        print("rank %d: refused as expected: %s" % (RANK, e))
        return
    raise AssertionError("rank %d: accepted, expected %s containing %r" % (RANK, kind.__name__, text))


def main():
    single = seqgrad.Model.from_preset("demo", dtype="f64", seed=7)
    split = seqgrad.Model.from_preset("demo", dtype="f64", seed=7)
    one = seqgrad.Trainer(single, **OPTIONS)
    tp = seqgrad.Trainer(split, tp=2, **OPTIONS)
    for step in range(3):
        a, b = one.step(BATCH), tp.step(BATCH)
        print("rank %d step %d: one process %.17g, tp=2 %.17g" % (RANK, step + 1, a["loss"], b["loss"]))
        assert abs(a["loss"] - b["loss"]) <= 1e-12 * abs(a["loss"])
    assert a["tp"] == 1 and a["tp_bytes_reduced"] == 0
    assert b["tp"] == 2 and b["tp_bytes_reduced"] > 0
    # This rank's memory: about half of one process's weights, exactly half its KV cache.
    assert b["peak_bytes_by_category"]["weights"] < 0.55 * a["peak_bytes_by_category"]["weights"]
    assert 2 * b["peak_bytes_by_category"]["kv_cache"] == a["peak_bytes_by_category"]["kv_cache"]
    one.compute_gradients(BATCH)
    tp.compute_gradients(BATCH)
    for what in ("parameters", "gradients"):
        x, y = getattr(single, what)(), getattr(split, what)()
        assert x.keys() == y.keys()
        worst = max(relative(x[k], y[k]) for k in x)
        print("rank %d: %s, worst relative difference %.3g" % (RANK, what, worst))
        assert worst <= 1e-12
    # Model.save is collective under tp: rank 0 writes the whole model.
    tp_dir, one_dir = os.path.join(TMP, "tp_model"), os.path.join(TMP, "one_model_%d" % RANK)
    split.save(tp_dir)
    single.save(one_dir)
    with seqgrad.Model.load(tp_dir, dtype="f64") as x, seqgrad.Model.load(one_dir, dtype="f64") as y:
        px, py = x.parameters(), y.parameters()
        assert px.keys() == py.keys() and max(relative(py[k], px[k]) for k in px) <= 1e-12

    other = seqgrad.Model.from_preset("demo", dtype="f64", seed=7)
    tiny = seqgrad.Model.from_preset("tiny", dtype="f64", seed=7)
    expect_error(seqgrad.InvalidArgumentError, "options->tp = 3: the job has 2 ranks, which is not tp (3)",
                 lambda: seqgrad.Trainer(other, tp=3, **OPTIONS))
    expect_error(seqgrad.InvalidArgumentError, "vocab_size=97 is not divisible by 2 (1 left over)",
                 lambda: seqgrad.Trainer(tiny, tp=2, **OPTIONS))
    expect_error(seqgrad.FailedPreconditionError, "options->tp differs across ranks (rank 0: 2, rank 1: 4)",
                 lambda: seqgrad.Trainer(other, tp=2 if RANK == 0 else 4, **OPTIONS))
    expect_error(seqgrad.InvalidArgumentError, "tp must be an integer >= 1", lambda: seqgrad.Trainer(other, tp=0))
    print("rank %d: PASS" % RANK)


if __name__ == "__main__":
    main()
