"""Tests of the seqgrad Python package (over the C ABI)."""
import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seqgrad  # noqa: E402

BATCH = [[(i * 7 + 3) % 50 for i in range(24)], [(i * 5 + 1) % 50 for i in range(16)]]


@pytest.fixture
def model():
    with seqgrad.Model.from_preset("tiny", seed=1) as m:
        yield m


def test_version_and_constants():
    assert seqgrad.version() == seqgrad.__version__
    assert seqgrad.MEMORY_CATEGORIES[0] == "weights" and len(seqgrad.MEMORY_CATEGORIES) == 9
    assert seqgrad.MEMORY_CATEGORIES[-1] == "master_weights"  # appended: the others keep their numbers
    assert "tiny" in seqgrad.PRESETS


def test_train_and_metrics(model):
    seen = []
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8, lr=3e-3, progress=seen.append) as tr:
        losses = [tr.step(BATCH)["loss"] for _ in range(4)]
        m = tr.step(np.array([BATCH[0]], dtype=np.int64))
    assert losses[-1] < losses[0]
    assert m["tokens"] == 23 and m["step"] == 5 and m["grad_norm"] > 0
    assert m["peak_bytes"] == sum(m["bytes_at_peak_by_category"].values())
    assert m["peak_bytes_by_category"]["optimizer"] > 0
    assert m["chunks"] == m["chunks_backpropagated"] == 3  # seco: one sequence of 24 tokens in chunks of 8
    assert [p["phase"] for p in seen[:2]] == ["gradients", "optimizer"]
    assert seen[-1]["step"] == 5 and seen[-1]["loss"] == m["loss"]


def widen_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("preset,matrix", [("tiny", "model.embed_tokens.weight"),
                                           ("tiny-ssm", "backbone.layers.0.mixer.in_proj.weight")])
def test_bf16_model_trains_and_saves(preset, matrix, tmp_path):
    """dtype="bf16": matrices are uint16 views of bf16 bits, vectors and gradients f32; training steps through fp32
    masters (master_weights); save() writes bf16 by default (bit exact on reload) or f32 on request."""
    with seqgrad.Model.from_preset(preset, dtype="bf16", seed=1) as m:
        assert m.dtype == "f32"  # the compute dtype
        params = m.parameters()
        assert params[matrix].dtype == np.uint16
        norm = [n for n in params if n.endswith("norm.weight") or n.endswith("norm_f.weight")][0]
        assert params[norm].dtype == np.float32
        before = params[matrix].copy()
        with seqgrad.Trainer(m, strategy="seco", chunk=8, page_size=8, lr=3e-3) as tr:
            losses = [tr.step(BATCH)["loss"] for _ in range(4)]
            metrics = tr.step(BATCH)
        assert losses[-1] < losses[0]
        assert m.gradients()[matrix].dtype == np.float32
        assert not np.array_equal(before, params[matrix])
        assert metrics["peak_bytes_by_category"]["master_weights"] > 0
        assert metrics["peak_bytes"] == sum(metrics["bytes_at_peak_by_category"].values())

        m.save(tmp_path / "bf16")
        with seqgrad.Model.load(tmp_path / "bf16", dtype="bf16") as back:
            assert np.array_equal(back.parameters()[matrix], params[matrix])
        with open(tmp_path / "bf16" / "config.json") as f:
            assert '"torch_dtype": "bfloat16"' in f.read()
        m.save(tmp_path / "f32", dtype="f32")
        with seqgrad.Model.load(tmp_path / "f32") as f32:
            assert np.array_equal(f32.parameters()[matrix], widen_bf16(params[matrix]))
        with seqgrad.Model.load(tmp_path / "f32", dtype="bf16") as back:
            assert np.array_equal(back.parameters()[matrix], params[matrix])
        with pytest.raises(seqgrad.InvalidArgumentError, match="'dtype'"):
            m.save(tmp_path / "x", dtype="f16")
    with seqgrad.Model.from_preset(preset, seed=1) as f32:
        with pytest.raises(seqgrad.InvalidArgumentError, match="'dtype' is bf16"):
            f32.save(tmp_path / "x", dtype="bf16")


def test_parameters_are_views(model):
    params = model.parameters()
    w = params["model.norm.weight"]
    assert w.dtype == np.float32 and w.shape == (32,)
    assert not w.flags["OWNDATA"]
    w[:] = 0.5
    assert np.all(model.parameters()["model.norm.weight"] == 0.5)  # same memory
    emb = params["model.embed_tokens.weight"]
    assert emb.shape == (model.vocab_size, model.hidden_size)
    with seqgrad.Trainer(model) as tr:
        tr.compute_gradients(BATCH)
        g = model.gradients()["model.norm.weight"]
        assert np.abs(g).sum() > 0
        before = emb.copy()
        tr.optimizer_step()
        assert not np.array_equal(before, emb)  # the view sees the optimizer's update


def test_devices_and_set_parameter(model, tmp_path):
    assert model.device == "cpu"
    # This library has no CUDA backend (or no GPU): the clear error of the C ABI.
    with pytest.raises(seqgrad.FailedPreconditionError, match="device 'cuda' cannot run"):
        seqgrad.Model.from_preset("tiny", device="cuda")
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->device is 'tpu'"):
        seqgrad.Model.from_preset("tiny", device="tpu")
    model.save(tmp_path / "m")
    with pytest.raises(seqgrad.FailedPreconditionError, match="device 'cuda' cannot run"):
        seqgrad.Model.load(tmp_path / "m", device="cuda")
    model.set_parameter("model.norm.weight", np.arange(32) * 0.25)
    assert np.array_equal(model.parameters()["model.norm.weight"], np.arange(32, dtype=np.float32) * 0.25)
    with pytest.raises(seqgrad.InvalidArgumentError, match=r"has shape \(32,\), got \(31,\)"):
        model.set_parameter("model.norm.weight", np.zeros(31))
    with pytest.raises(seqgrad.InvalidArgumentError, match="no parameter named 'nope'"):
        model.set_parameter("nope", np.zeros(1))


def test_views_keep_model_alive():
    m = seqgrad.Model.from_preset("tiny")
    w = m.parameters()["model.embed_tokens.weight"]
    expected = w.copy()
    m.close()
    del m
    import gc
    gc.collect()
    np.testing.assert_array_equal(w, expected)


def test_labels_and_save_load(model, tmp_path):
    ids = np.array(BATCH[0], dtype=np.int32)
    labels = np.full_like(ids, -100)
    labels[::3] = ids[::3]
    with seqgrad.Trainer(model) as tr:
        m = tr.compute_gradients([ids], [labels])
    assert m["tokens"] == 7  # labels[0] is never predicted (Hugging Face's shift): 8 labels, 7 targets
    model.save(tmp_path / "saved")
    with seqgrad.Model.load(tmp_path / "saved") as loaded:
        a, b = model.parameters(), loaded.parameters()
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_hugging_face_labels(model):
    """labels = ids is next-token training (the engine shifts); pre-0.7 shifted labels are another loss."""
    ids = np.array(BATCH[0], dtype=np.int32)

    def run(labels):
        with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
            m = tr.compute_gradients([ids], None if labels is None else [labels])
            return m, {k: g.copy() for k, g in model.gradients().items()}

    m_none, g_none = run(None)
    m_ids, g_ids = run(ids)
    assert m_none["loss"] == m_ids["loss"] and m_none["tokens"] == m_ids["tokens"] == len(ids) - 1
    for k in g_none:
        np.testing.assert_array_equal(g_none[k], g_ids[k])
    pre_shifted = np.append(ids[1:], -100).astype(np.int32)  # labels[t] = target of t, the 0.6 convention
    m_old, _ = run(pre_shifted)
    assert abs(m_old["loss"] - m_none["loss"]) > 1e-3


def test_score():
    """score(): log p(labels[t] | ids[:t]) per token, NaN where nothing is predicted, equal to evaluate()'s loss,
    causal (ids[k] moves only the entries after k), the same at any chunk size; what grpo's ref_logprobs take."""
    ids = np.array(BATCH[0], dtype=np.int32)
    labels = ids.copy()
    labels[5:9] = -100
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=3) as m64:
        with seqgrad.Trainer(m64, strategy="seco", chunk=5, page_size=5, lm_chunk=3) as tr:
            lp, lp_next = tr.score([ids, ids[:10]], [labels, ids[:10]])
            loss = tr.evaluate([ids], [labels])["loss"]
            changed = ids.copy()
            changed[12] = (changed[12] + 1) % 50
            lp_changed = tr.score([changed], [labels])[0]
        with seqgrad.Trainer(m64, strategy="full") as full:
            lp_full = full.score([ids], [labels])[0]
    assert lp.shape == ids.shape and lp_next.shape == (10,)
    valid = np.ones(len(ids), bool)
    valid[0] = False
    valid[5:9] = False
    assert np.all(np.isnan(lp[~valid])) and np.all(np.isfinite(lp[valid])) and np.all(lp[valid] < 0)
    assert abs(-lp[valid].mean() - loss) < 1e-12
    np.testing.assert_allclose(lp_full[valid], lp[valid], rtol=0, atol=1e-12)
    assert np.isnan(lp_next[0]) and np.all(np.isfinite(lp_next[1:]))
    np.testing.assert_allclose(lp_next[1:5], lp[1:5], rtol=0, atol=1e-12)  # a sequence's own prefix decides
    # Entry t depends on ids[:t] and labels[t] only: ids[12] changes the entries after 12 (labels stay as they were).
    np.testing.assert_array_equal(lp_changed[:13], lp[:13])
    assert np.all(lp_changed[13:][valid[13:]] != lp[13:][valid[13:]])


def test_score_gives_grpo_reference_logprobs():
    """grpo with ref_logprobs from score() of the reference model equals grpo with the reference model itself."""
    ids = np.array(BATCH[1], dtype=np.int32)
    labels = ids.copy()
    labels[:4] = -100
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=5) as ref:
        with seqgrad.Trainer(ref, strategy="seco", chunk=4, page_size=4) as scorer:
            ref_lp = scorer.score([ids], [labels])[0]
        losses = []
        for with_logprobs in (False, True):
            with seqgrad.Model.from_preset("tiny", dtype="f64", seed=6) as policy, \
                    seqgrad.Trainer(policy, objective="grpo", grpo_kl_beta=0.5, reference=ref) as tr:
                item = {"ids": ids, "labels": labels, "advantage": 1.0}
                if with_logprobs:
                    item["ref_logprobs"] = ref_lp
                    tr.set_reference(None)
                losses.append(tr.compute_gradients_grpo([[item]])["loss"])
    assert abs(losses[0] - losses[1]) < 1e-12, losses


def test_threads_and_wait_policy(model):
    import os
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # set by the import (the test environment leaves it unset)
    with seqgrad.Trainer(model, num_threads=1) as tr:
        assert np.isfinite(tr.step(BATCH)["loss"])
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(seqgrad.InvalidArgumentError, match="num_threads"):
            seqgrad.Trainer(model, num_threads=bad)


def test_errors(model):
    with pytest.raises(seqgrad.InvalidArgumentError) as e:
        seqgrad.Model.from_preset("tiny", dtype="f8")
    assert e.value.code == 3 and "dtype" in str(e.value) and e.value.code_name == "INVALID_ARGUMENT"
    with pytest.raises(seqgrad.InvalidArgumentError, match="known presets"):
        seqgrad.Model.from_preset("huge")
    with pytest.raises(seqgrad.NotFoundError):
        seqgrad.Model.load("/nonexistent/dir")
    with pytest.raises(seqgrad.InvalidArgumentError, match="magic"):
        seqgrad.Trainer(model, strategy="magic")
    with seqgrad.Trainer(model) as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"ids\[2\] = 97"):
            tr.step([[1, 2, 97, 3]])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"labels\[1\] = -5"):
            tr.step([[1, 2, 3]], [[1, -5, 3]])
        with pytest.raises(seqgrad.InvalidArgumentError, match="num_sequences"):
            tr.step([])
        with pytest.raises(seqgrad.InvalidArgumentError, match="integers"):
            tr.step([[1.5, 2.0]])
        with pytest.raises(seqgrad.InvalidArgumentError, match="same sequence lengths"):
            tr.step([[1, 2, 3]], [[1, 2]])
        with pytest.raises(seqgrad.InvalidArgumentError, match="lengths"):
            tr.step([[1, 2, 3], []])
        with pytest.raises(seqgrad.InvalidArgumentError, match="int32"):
            tr.step([[1, 2**40]])
        assert isinstance(tr.step([[1, 2, 3]])["loss"], float)  # still usable
    with pytest.raises(seqgrad.ClosedError):
        tr.step([[1, 2, 3]])
    tr.close()  # idempotent
    with pytest.raises(seqgrad.OutOfRangeError):
        model._get().param(10**6)


def _grads(model):
    return {k: v.copy() for k, v in model.gradients().items()}


def test_spaco(model):
    with seqgrad.Trainer(model, strategy="spaco", chunk=8, page_size=8, lr=3e-3, spaco_budget=1, seed=7) as tr:
        for step in range(1, 5):
            m = tr.step(BATCH)
            assert m["chunks"] == 3 + 2  # 24 and 16 tokens in chunks of 8
            assert 0 <= m["chunks_backpropagated"] <= m["chunks"]
            assert m["tokens"] == 23 + 15 and m["step"] == step and np.isfinite(m["loss"])
        assert tr.optimizer_step()["chunks"] == 5  # the last compute_gradients' counts


def test_spaco_with_every_chunk_is_seco(model):
    """spaco_budget = chunks per sequence keeps every chunk; with spaco_cap=0 the compensation is 1: seco."""
    batch = [BATCH[0], BATCH[0][:20]]  # 3 chunks of 8 each
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        ref = tr.compute_gradients(batch)
        ref_grads = _grads(model)
    with seqgrad.Trainer(model, strategy="spaco", chunk=8, page_size=8, spaco_budget=3, spaco_cap=0, seed=99) as tr:
        m = tr.compute_gradients(batch)
        grads = _grads(model)
    assert m["chunks"] == m["chunks_backpropagated"] == 6
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-8, err_msg=k)


def test_spaco_seed(model):
    def sample(seed):
        with seqgrad.Trainer(model, strategy="spaco", chunk=8, page_size=8, spaco_budget=1, seed=seed) as tr:
            tr.compute_gradients(BATCH)
            return np.concatenate([g.ravel() for g in _grads(model).values()])

    a = sample(5)
    np.testing.assert_array_equal(a, sample(5))
    assert any(not np.array_equal(a, sample(s)) for s in range(6, 14))


def test_spaco_errors(model):
    with pytest.raises(seqgrad.InvalidArgumentError, match="spaco_budget") as e:
        seqgrad.Trainer(model, strategy="spaco", spaco_budget=0)
    assert e.value.code == 3
    with pytest.raises(seqgrad.InvalidArgumentError, match="spaco_cap"):
        seqgrad.Trainer(model, strategy="spaco", spaco_cap=0.5)
    with seqgrad.Trainer(model, strategy="spaco", chunk=8, page_size=8, spaco_budget=3) as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match="spaco_budget = 3 exceeds the 2 chunks"):
            tr.step(BATCH)  # the 16-token sequence has 2 chunks
        assert tr.step_count == 0
        tr.step([BATCH[0]])


def test_sparse_pages_and_offload(model):
    """seco with offload gives the same gradient bits, dense or with sparse pages; one page changes them."""
    def grads(sparse_pages, offload):
        with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=2, sparse_pages=sparse_pages,
                             offload=offload) as tr:
            loss = tr.compute_gradients(BATCH)["loss"]
            return loss, np.concatenate([g.ravel() for g in _grads(model).values()])

    dense, dense_off = grads(0, False), grads(0, True)
    sparse, sparse_off = grads(1, False), grads(1, True)
    assert dense[0] == dense_off[0] and sparse[0] == sparse_off[0]
    np.testing.assert_array_equal(dense[1], dense_off[1])
    np.testing.assert_array_equal(sparse[1], sparse_off[1])
    assert not np.array_equal(dense[1], sparse[1])
    with pytest.raises(seqgrad.InvalidArgumentError, match="offload is implemented for options->strategy = seco"):
        seqgrad.Trainer(model, strategy="ckpt", offload=True)
    with pytest.raises(seqgrad.InvalidArgumentError, match="sparse_pages must be 0"):
        seqgrad.Trainer(model, strategy="seco", sparse_pages=-1)


def test_offload_experts(model):
    """offload_experts streams a mixture of experts' frozen expert weights through the device: the same loss and
    gradient bits; refused, naming the option, on a model without experts and on experts that train."""
    def grads(offload_experts, at_creation=False):  # at_creation: the experts made in host memory
        with seqgrad.Model.from_preset("tiny-qwen3-moe", dtype="f64", seed=1, frozen_base=at_creation,
                                       offload_experts=at_creation) as m:
            m.enable_lora(rank=2, targets=["q_proj", "experts.gate_up_proj", "experts.down_proj"], seed=3)
            with seqgrad.Trainer(m, strategy="seco", chunk=8, page_size=2, offload_experts=offload_experts) as tr:
                loss = tr.compute_gradients(BATCH)["loss"]
                return loss, np.concatenate([g.ravel() for g in _grads(m).values()])

    resident = grads(False)
    for offloaded in (grads(True), grads(True, at_creation=True)):
        assert resident[0] == offloaded[0]
        np.testing.assert_array_equal(resident[1], offloaded[1])
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->offload_experts keeps the expert weights"):
        seqgrad.Model.from_preset("tiny-qwen3-moe", offload_experts=True)  # without frozen_base
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->offload_experts keeps the expert weights"):
        with seqgrad.Model.from_preset("tiny-qwen3-moe", dtype="f64", seed=1) as m:
            seqgrad.Trainer(m, offload_experts=True)
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->offload_experts: this llama model has no"):
        seqgrad.Trainer(model, offload_experts=True)


def test_cancel_from_another_thread(model):
    long_seq = [[(i * 13 + 5) % 97 for i in range(512)]]
    with seqgrad.Trainer(model, strategy="seco", chunk=32, page_size=32) as tr:
        tr.cancel()
        with pytest.raises(seqgrad.CancelledError):
            tr.step(BATCH)
        tr.step(BATCH)
        timer = threading.Timer(0.05, tr.cancel)
        timer.start()
        with pytest.raises(seqgrad.CancelledError) as e:
            for _ in range(100000):
                tr.step(long_seq)
        timer.join()
        assert e.value.code == 1
        tr.step(BATCH)


def test_busy_from_two_threads(model):
    """Thread A is inside its step (in the progress callback, GIL released around the C call) while B steps."""
    in_step, b_done = threading.Event(), threading.Event()
    results = {}

    def progress(p):
        if p["phase"] == "gradients" and not in_step.is_set():
            in_step.set()
            b_done.wait(10)

    with seqgrad.Trainer(model, progress=progress) as tr:
        def a():
            results["a"] = tr.compute_gradients(BATCH)["loss"]

        def b():
            in_step.wait(10)
            try:
                tr.step(BATCH)
            except seqgrad.BusyError as e:
                results["b"] = e
            finally:
                b_done.set()

        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start()
        tb.start()
        ta.join()
        tb.join()
        assert isinstance(results.get("b"), seqgrad.BusyError) and results["b"].code == 100
        assert results["a"] > 0


@pytest.mark.parametrize("phase", ["gradients", "optimizer"])
def test_callback_exception_says_the_step_was_applied(model, phase):
    """A callback that raises after the update: StepAppliedError, so that a caller does not apply the batch twice."""
    boom = RuntimeError("boom")

    def bad(p):
        if p["phase"] == phase:
            raise boom

    with seqgrad.Trainer(model, progress=bad) as tr:
        before = model.parameters()["model.norm.weight"].copy()
        with pytest.raises(seqgrad.StepAppliedError, match="do not retry") as e:
            tr.step(BATCH)
        assert e.value.__cause__ is boom and e.value.step == 1 and tr.step_count == 1
        assert not isinstance(e.value, seqgrad.SeqgradError)
        assert not np.array_equal(before, model.parameters()["model.norm.weight"])  # the weights moved
        tr.set_progress_callback(None)
        tr.step(BATCH)
        assert tr.step_count == 2


def test_progress_must_be_callable(model):
    """Refused when the trainer is made, not by the first step after its update."""
    for bad in (True, 1, "print"):
        with pytest.raises(seqgrad.InvalidArgumentError, match="progress must be a callable"):
            seqgrad.Trainer(model, progress=bad)
    with seqgrad.Trainer(model) as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match="fn must be a callable"):
            tr.set_progress_callback(True)
        tr.step(BATCH)
        assert tr.step_count == 1


def test_gil_released_during_step(model):
    """Another Python thread makes progress while a long step runs."""
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    with seqgrad.Trainer(model, strategy="seco", chunk=64, page_size=64) as tr:
        t = threading.Thread(target=ticker)
        t.start()
        n0 = len(ticks)
        tr.step([[(i * 13 + 5) % 97 for i in range(768)]])
        n1 = len(ticks)
        stop.set()
        t.join()
    assert n1 - n0 > 3


# ---- 0.3: streambp, evaluate, dpo, grpo, memory limit ----

def _f64(seed=1):
    return seqgrad.Model.from_preset("tiny", dtype="f64", seed=seed)


def _assert_grads_close(a, b, rtol):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=rtol * 1e-3, err_msg=k)


def test_streambp_matches_full_and_trains():
    with _f64() as model:
        with seqgrad.Trainer(model, strategy="full") as tr:
            ref = tr.compute_gradients(BATCH)
            ref_grads = _grads(model)
        with seqgrad.Trainer(model, strategy="streambp", chunk=8, page_size=8, lr=3e-3) as tr:
            m = tr.compute_gradients(BATCH)
            _assert_grads_close(_grads(model), ref_grads, 1e-9)
            assert m["loss"] == pytest.approx(ref["loss"], rel=1e-12) and m["tokens"] == ref["tokens"]
            losses = [tr.step(BATCH)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]


def test_evaluate_equals_compute_gradients_loss(model):
    labels = [[t if i % 2 else -100 for i, t in enumerate(s[1:] + [0])] for s in BATCH]
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        g = tr.compute_gradients(BATCH, labels)
        grads = _grads(model)
        e = tr.evaluate(BATCH, labels)
        assert e["loss"] == pytest.approx(g["loss"], rel=1e-6)
        assert e["tokens"] == g["tokens"] and e["chunks"] == 5 and e["chunks_backpropagated"] == 0
        assert e["step"] == 0 and e["grad_norm"] == 0
        for k, v in _grads(model).items():
            np.testing.assert_array_equal(v, grads[k])  # gradients untouched
        assert tr.evaluate(BATCH)["tokens"] == 23 + 15
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"ids\[2\] = 97"):
            tr.evaluate([[1, 2, 97]])


def _prompt_response(n, prompt, salt):
    ids = [(t * (5 + salt) + 3 * salt + 1) % 90 for t in range(n)]
    labels = [ids[t + 1] if prompt - 1 <= t < n - 1 else -100 for t in range(n)]
    return ids, labels


PAIRS = [{"chosen": _prompt_response(20, 5, 1), "rejected": _prompt_response(12, 5, 2)},
         {"chosen": _prompt_response(14, 5, 3), "rejected": _prompt_response(17, 5, 4)}]


def _sequence_logp(trainer, ids, labels):
    m = trainer.evaluate([ids], [labels])
    return -m["loss"] * m["tokens"]


def test_dpo_given_ref_logprobs_equal_reference_model():
    with _f64() as policy, _f64() as reference:  # same preset and seed: a frozen copy
        with seqgrad.Trainer(policy, lr=3e-3) as sft:  # move the policy away from the reference
            for _ in range(3):
                sft.step(BATCH)
        with seqgrad.Trainer(reference) as ev:
            given = [dict(p, ref_chosen_logp=_sequence_logp(ev, *p["chosen"]),
                          ref_rejected_logp=_sequence_logp(ev, *p["rejected"])) for p in PAIRS]
        with seqgrad.Trainer(policy, objective="dpo", dpo_beta=0.1) as tr:
            a = tr.compute_gradients_dpo(given)
            grads_given = _grads(policy)
            with pytest.raises(seqgrad.InvalidArgumentError, match="no reference model"):
                tr.compute_gradients_dpo(PAIRS)
            tr.set_reference(reference)
            assert tr.reference is reference
            b = tr.compute_gradients_dpo(PAIRS)
            _assert_grads_close(_grads(policy), grads_given, 1e-9)
            assert np.isfinite(a["loss"]) and abs(a["loss"] - np.log(2)) > 1e-4  # the policy moved
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-10) and b["tokens"] == a["tokens"]
            mixed = [dict(given[0], ref_chosen_logp=None), given[1]]  # None: that one from the reference model
            assert tr.compute_gradients_dpo(mixed)["loss"] == pytest.approx(a["loss"], rel=1e-10)
            m = tr.step_dpo(PAIRS)
            assert np.isfinite(m["loss"]) and m["step"] == 1 and m["grad_norm"] > 0
        with seqgrad.Trainer(policy, objective="dpo", reference=reference) as tr:  # reference at construction
            assert np.isfinite(tr.step_dpo([{"chosen": (PAIRS[0]["chosen"][0], None),
                                             "rejected": PAIRS[0]["rejected"]}])["loss"])


def _groups(kl=True):
    out = []
    for g, advantages in enumerate(([1.0, -0.5, 0.5], [2.0, 0.0])):
        group = []
        for i, a in enumerate(advantages):
            ids, labels = _prompt_response(18 - 3 * i + g, 4, 3 * g + i)
            c = {"ids": ids, "labels": labels, "advantage": a}
            if kl:
                c["old_logprobs"] = [-4.5 + 0.01 * t if l >= 0 else float("nan") for t, l in enumerate(labels)]
                c["ref_logprobs"] = np.where(np.array(labels) >= 0, -4.6, np.nan)
            group.append(c)
        out.append(group)
    return out


def test_grpo_kl_bias_correction():
    """The KL term is r k3 by default (TRL's use_bias_correction_kl), k3 with grpo_kl_bias_correction=False: each
    loss equals its formula over the log-probs score() gives, and the two differ."""
    groups = _groups()
    beta, eps = 0.5, 0.2
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=1) as model:
        with seqgrad.Trainer(model) as scorer:
            logprobs = [[scorer.score([c["ids"]], [c["labels"]])[0] for c in g] for g in groups]

        def expected(corrected):
            per_group = []
            for g, group in enumerate(groups):
                total = 0.0
                for c, lp in zip(group, logprobs[g]):
                    on = np.array(c["labels"]) >= 0
                    lp, old, ref = lp[on], np.array(c["old_logprobs"])[on], np.array(c["ref_logprobs"])[on]
                    r, x, a = np.exp(lp - old), ref - lp, c["advantage"]
                    k3 = np.exp(x) - x - 1
                    term = -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a) + beta * (r * k3 if corrected else k3)
                    total += term.sum() / on.sum()
                per_group.append(total / len(group))
            return np.mean(per_group)

        losses = {}
        for kw in ({}, {"grpo_kl_bias_correction": True}, {"grpo_kl_bias_correction": False}):
            with seqgrad.Trainer(model, objective="grpo", grpo_clip_eps=eps, grpo_kl_beta=beta, **kw) as tr:
                losses[kw.get("grpo_kl_bias_correction", "default")] = tr.compute_gradients_grpo(groups)["loss"]
    assert losses["default"] == losses[True] == pytest.approx(expected(True), rel=1e-12)
    assert losses[False] == pytest.approx(expected(False), rel=1e-12)
    assert abs(losses[True] - losses[False]) > 1e-6


def test_grpo_steps(model):
    with seqgrad.Model.from_preset("tiny", seed=1) as reference:
        # Ratio 1 (no old log-probs), no KL: the loss is -(mean over groups of the mean advantage).
        with seqgrad.Trainer(model, objective="grpo", grpo_kl_beta=0.0) as tr:
            m = tr.compute_gradients_grpo(_groups(kl=False))
            assert m["loss"] == pytest.approx(-(1.0 / 3 + 1.0) / 2, abs=1e-6)
            assert tr.step_grpo(_groups(kl=False))["step"] == 1
        with seqgrad.Trainer(model, objective="grpo", grpo_clip_eps=0.2, grpo_kl_beta=0.04) as tr:
            m = tr.step_grpo(_groups())
            assert np.isfinite(m["loss"]) and m["step"] == 1 and m["grad_norm"] > 0
            without_ref = _groups()
            for group in without_ref:
                for c in group:
                    del c["ref_logprobs"]
            with pytest.raises(seqgrad.InvalidArgumentError, match="no reference model"):
                tr.step_grpo(without_ref)
            tr.set_reference(reference)
            m = tr.compute_gradients_grpo(without_ref)
            assert np.isfinite(m["loss"]) and m["step"] == 1


def test_objective_errors(model):
    with seqgrad.Trainer(model, objective="grpo") as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"groups\[1\] is empty \(G = 0\)") as e:
            tr.step_grpo([_groups()[0], []])
        assert e.value.code == 3
        bad = _groups()
        bad[0][1]["old_logprobs"] = bad[0][1]["old_logprobs"][:3]
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"groups\[0\]\[1\]\['old_logprobs'\] has 3 entries"):
            tr.step_grpo(bad)
        bad = _groups()
        bad[1][0]["old_logprobs"][5] = float("nan")  # a labelled position: checked by the C API
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"old_logprobs\[3\]\[5\] is nan \(group 1\)"):
            tr.step_grpo(bad)
        bad = _groups()
        bad[0][0]["advantages"] = 1.0
        with pytest.raises(seqgrad.InvalidArgumentError, match="unknown key"):
            tr.step_grpo(bad)
        with pytest.raises(seqgrad.InvalidArgumentError, match="groups is empty"):
            tr.step_grpo([])
        with pytest.raises(seqgrad.FailedPreconditionError, match="objective is 'grpo'"):
            tr.step(BATCH)
        with pytest.raises(seqgrad.FailedPreconditionError, match="objective is 'grpo'"):
            tr.step_dpo(PAIRS)
        with pytest.raises(seqgrad.InvalidArgumentError, match="own model"):
            tr.set_reference(model)
        assert tr.step_count == 0
    with seqgrad.Trainer(model) as tr:
        with pytest.raises(seqgrad.FailedPreconditionError, match="objective is 'sft'"):
            tr.step_dpo(PAIRS)
    with seqgrad.Trainer(model, objective="dpo") as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"pairs\[0\]\['chosen'\] must be a pair"):
            tr.step_dpo([{"chosen": [1, 2, 3], "rejected": PAIRS[0]["rejected"]}])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"pairs\[1\]: missing key\(s\) rejected"):
            tr.step_dpo([PAIRS[0], {"chosen": PAIRS[0]["chosen"]}])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"chosen_ids\[0\]\[2\] = 97"):
            tr.step_dpo([{"chosen": ([1, 2, 97], None), "rejected": PAIRS[0]["rejected"]}])
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->objective is 'ppo'"):
        seqgrad.Trainer(model, objective="ppo")
    with pytest.raises(seqgrad.InvalidArgumentError, match="dpo_beta"):
        seqgrad.Trainer(model, objective="dpo", dpo_beta=0)
    with pytest.raises(seqgrad.InvalidArgumentError, match="grpo_clip_eps"):
        seqgrad.Trainer(model, objective="grpo", grpo_clip_eps=1.0)
    with seqgrad.Model.from_preset("demo") as other:
        with pytest.raises(seqgrad.InvalidArgumentError, match="vocabulary of 128"):
            seqgrad.Trainer(model, objective="dpo", reference=other)


def test_memory_limit(model):
    assert model.memory_limit == 0
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        model.set_memory_limit(1024)
        assert model.memory_limit == 1024
        with pytest.raises(seqgrad.ResourceExhaustedError, match="memory limit of 1024 bytes exceeded") as e:
            tr.step(BATCH)
        assert e.value.code == 8 and e.value.code_name == "RESOURCE_EXHAUSTED" and isinstance(e.value, MemoryError)
        with pytest.raises(seqgrad.ResourceExhaustedError):
            tr.evaluate(BATCH)
        assert tr.step_count == 0
        model.set_memory_limit(0)
        m = tr.step(BATCH)
        assert m["step"] == 1 and np.isfinite(m["loss"])
    with pytest.raises(seqgrad.InvalidArgumentError, match="'bytes' is -1"):
        model.set_memory_limit(-1)


def test_ssm_presets_strategies_and_save_load(tmp_path):
    assert "tiny-ssm" in seqgrad.PRESETS and "bench-ssm" in seqgrad.PRESETS
    with seqgrad.Model.from_preset("tiny-ssm", dtype="f64", seed=3) as model:
        assert model.family == "ssm" and model.dtype == "f64"
        assert model.vocab_size == 97 and model.num_layers == 3 and model.hidden_size == 16
        with seqgrad.Trainer(model, strategy="full") as tr:
            ref = tr.compute_gradients(BATCH)
            ref_grads = _grads(model)
        assert np.isfinite(ref["loss"]) and ref_grads
        for strategy in ("ckpt", "seco", "streambp"):
            with seqgrad.Trainer(model, strategy=strategy, chunk=8, page_size=8) as tr:
                m = tr.compute_gradients(BATCH)
                _assert_grads_close(_grads(model), ref_grads, 1e-9)
                assert m["loss"] == pytest.approx(ref["loss"], rel=1e-12) and m["tokens"] == ref["tokens"]
        with seqgrad.Trainer(model, strategy="spaco", chunk=8, page_size=8, spaco_budget=1, seed=7) as tr:
            m = tr.compute_gradients(BATCH)
            assert np.isfinite(m["loss"]) and m["chunks"] == 5
        # save -> load through an HF (MambaForCausalLM) directory -> identical loss
        model.save(tmp_path / "ssm")
        with seqgrad.Model.load(tmp_path / "ssm", dtype="f64") as loaded:
            assert loaded.family == "ssm"
            a, b = model.parameters(), loaded.parameters()
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            with seqgrad.Trainer(model) as t1, seqgrad.Trainer(loaded) as t2:
                assert t1.evaluate(BATCH)["loss"] == t2.evaluate(BATCH)["loss"]


@pytest.mark.parametrize("strategy", ["seco", "streambp"])
def test_ssm_trains(strategy):
    with seqgrad.Model.from_preset("tiny-ssm", seed=5) as model:
        with seqgrad.Trainer(model, strategy=strategy, chunk=8, page_size=8, lr=3e-3) as tr:
            losses = [tr.step(BATCH)["loss"] for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


# ---- 0.4: adjoint (adjoint sharding for SSMs) ----

def _adjoint_pairs(lengths, layers, window=None):
    """(t, i) pairs per channel summed over layers: w*T - w*(w-1)/2 per layer and sequence (window w <= T) of T =
    length - 1 positions (its last token is only a label)."""
    total = 0
    for T in (n - 1 for n in lengths):
        w = T if window is None else min(window, T)
        total += layers * (w * T - w * (w - 1) // 2)
    return total


def test_adjoint_matches_full_on_ssm():
    lengths = [len(s) for s in BATCH]
    with seqgrad.Model.from_preset("tiny-ssm", dtype="f64", seed=3) as model:
        with seqgrad.Trainer(model, strategy="full") as tr:
            ref = tr.compute_gradients(BATCH)
            ref_grads = _grads(model)
        assert ref["adjoint_pairs"] == 0
        no_window = _adjoint_pairs(lengths, model.num_layers)
        assert no_window == 3 * (23 * 24 // 2 + 15 * 16 // 2)
        cases = [dict(chunk=8), dict(chunk=5, adjoint_form="pairs", adjoint_window=None),
                 dict(chunk=8, adjoint_window=24), dict(chunk=8, adjoint_window=1000),
                 dict(chunk=8, adjoint_form="scan")]
        for kw in cases:  # exact whatever the chunking; a window >= the sequence is no truncation
            with seqgrad.Trainer(model, strategy="adjoint", page_size=8, **kw) as tr:
                m = tr.compute_gradients(BATCH)
                _assert_grads_close(_grads(model), ref_grads, 1e-10)
                assert m["loss"] == pytest.approx(ref["loss"], rel=1e-12) and m["tokens"] == ref["tokens"], kw
                assert m["adjoint_pairs"] == (0 if kw.get("adjoint_form") == "scan" else no_window), kw
                assert m["chunks"] == m["chunks_backpropagated"] == sum(-(-(T - 1) // kw["chunk"]) for T in lengths)
                assert tr.evaluate(BATCH)["adjoint_pairs"] == 0
        with seqgrad.Trainer(model, strategy="adjoint", chunk=8, page_size=8) as tr:
            tr.compute_gradients(BATCH)
            m = tr.optimizer_step()  # reports the last compute_gradients' count
            assert m["adjoint_pairs"] == no_window and m["step"] == 1


def test_adjoint_truncated_window_and_training():
    lengths = [len(s) for s in BATCH]
    with seqgrad.Model.from_preset("tiny-ssm", dtype="f64", seed=3) as model:
        with seqgrad.Trainer(model, strategy="full") as tr:
            ref = tr.compute_gradients(BATCH)
            ref_grads = _grads(model)
        errors = []
        for w in (1, 4, 12):
            with seqgrad.Trainer(model, strategy="adjoint", chunk=8, page_size=8, adjoint_window=w) as tr:
                m = tr.compute_gradients(BATCH)
                grads = _grads(model)
            assert m["adjoint_pairs"] == _adjoint_pairs(lengths, model.num_layers, w) == \
                model.num_layers * sum(w * (T - 1) - w * (w - 1) // 2 for T in lengths)
            assert m["loss"] == pytest.approx(ref["loss"], rel=1e-12)  # the forward pass is not truncated
            err = max(np.max(np.abs(grads[k] - ref_grads[k])) / (np.max(np.abs(ref_grads[k])) + 1e-30)
                      for k in ref_grads)
            assert err > 1e-8, w  # truncation changes the gradient
            errors.append(err)
        assert errors[-1] < errors[0]  # less as the window grows
        with seqgrad.Trainer(model, strategy="adjoint", adjoint_form="paper", chunk=8, page_size=8,
                             adjoint_window=4) as tr:
            assert tr.compute_gradients(BATCH)["adjoint_pairs"] == _adjoint_pairs(lengths, model.num_layers, 4)
    with seqgrad.Model.from_preset("tiny-ssm", seed=5) as model:
        with seqgrad.Trainer(model, strategy="adjoint", chunk=8, page_size=8, lr=3e-3, adjoint_window=8) as tr:
            losses = [tr.step(BATCH)["loss"] for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_adjoint_errors(model):
    with seqgrad.Model.from_preset("tiny-ssm", seed=3) as ssm:
        for w in (0, -3):
            with pytest.raises(seqgrad.InvalidArgumentError, match="adjoint_window is %d" % w) as e:
                seqgrad.Trainer(ssm, strategy="adjoint", adjoint_window=w)
            assert e.value.code == 3
        with pytest.raises(seqgrad.InvalidArgumentError, match="adjoint_window"):
            seqgrad.Trainer(ssm, strategy="full", adjoint_window=0)  # checked whatever the strategy
        with pytest.raises(seqgrad.InvalidArgumentError, match="adjoint_window"):
            seqgrad.Trainer(ssm, strategy="adjoint", adjoint_window=2.5)
        with pytest.raises(seqgrad.InvalidArgumentError, match="adjoint_window"):
            seqgrad.Trainer(ssm, strategy="adjoint", adjoint_window=2**63)
        with pytest.raises(seqgrad.InvalidArgumentError, match="adjoint_form is 'reverse'"):
            seqgrad.Trainer(ssm, strategy="adjoint", adjoint_form="reverse")
        with pytest.raises(seqgrad.InvalidArgumentError, match="scan is exact and has no window"):
            seqgrad.Trainer(ssm, strategy="adjoint", adjoint_form="scan", adjoint_window=8)
        with seqgrad.Trainer(ssm, strategy="adjoint", adjoint_form=None, adjoint_window=2**63 - 1) as tr:
            assert tr.compute_gradients(BATCH)["adjoint_pairs"] > 0  # None = "pairs"; INT64_MAX = no window
    with pytest.raises(seqgrad.InvalidArgumentError, match="needs a state-space model") as e:
        seqgrad.Trainer(model, strategy="adjoint")  # `model` is the "tiny" transformer
    assert e.value.code == 3 and "transformer" in str(e.value)


# ---- 0.5: LR schedule, gradient accumulation, LoRA, checkpoints, detailed evaluation ----

def _retrieval_batch(rng, vocab, seq_len=48, num_pairs=4):
    """Sequences of the retrieval task (examples/python/train_retrieval.py) with their key-query distances."""
    ids, labels, distances = [], [], []
    for _ in range(2):
        a = rng.integers(20, vocab, size=seq_len).astype(np.int32)
        lab = np.full(seq_len, -100, dtype=np.int32)
        dist = np.zeros(seq_len, dtype=np.int64)
        q0 = seq_len - 3 * num_pairs
        slots = rng.choice(np.arange(0, q0 - 3, 3), size=num_pairs, replace=False)
        for j, s in enumerate(slots):
            key, value = 3 + j, 11 + j
            a[s:s + 3] = (1, key, value)
            p = q0 + 3 * j
            a[p:p + 3] = (2, key, value)
            lab[p + 1] = value
            dist[p + 1] = p + 1 - (s + 1)
        ids.append(a)
        labels.append(lab)
        distances.append(dist)
    return ids, labels, distances


def test_lr_schedule_and_metrics(model):
    with seqgrad.Trainer(model, lr=1e-2, lr_schedule="linear", warmup_steps=2, min_lr=2e-3, total_steps=6) as tr:
        assert tr.compute_gradients(BATCH)["lr"] == 0 and tr.compute_gradients(BATCH)["micro_batches"] == 0
        lrs = [tr.step(BATCH) for _ in range(7)]
    assert [m["micro_batches"] for m in lrs] == [1] * 7
    want = [5e-3, 1e-2, 8e-3, 6e-3, 4e-3, 2e-3, 2e-3]
    assert [m["lr"] for m in lrs] == pytest.approx(want, rel=1e-12)
    with seqgrad.Trainer(model, lr=1e-2) as tr:
        assert tr.step(BATCH)["lr"] == 1e-2  # constant by default
    for kw, match in [(dict(lr_schedule="step"), "lr_schedule 'step'"),
                      (dict(lr_schedule="cosine", total_steps=0), "total_steps must be larger"),
                      (dict(min_lr=1.0), "min_lr is 1"), (dict(warmup_steps=-1), "warmup_steps is -1"),
                      (dict(grad_accum=0), "grad_accum is 0")]:
        with pytest.raises(seqgrad.InvalidArgumentError, match=match):
            seqgrad.Trainer(model, **kw)


def test_accumulate_equals_one_batch():
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=2) as a, \
            seqgrad.Model.from_preset("tiny", dtype="f64", seed=2) as b:
        kw = dict(strategy="seco", chunk=8, page_size=8, lr=1e-2, lr_schedule="cosine", warmup_steps=1,
                  total_steps=5, grad_accum=2)
        with seqgrad.Trainer(a, **kw) as one, seqgrad.Trainer(b, **kw) as acc:
            for _ in range(3):
                m1 = one.step(BATCH)
                micro = acc.accumulate_gradients([BATCH[0]])
                assert micro["micro_batches"] == 0 and micro["tokens"] == len(BATCH[0]) - 1
                acc.accumulate_gradients(np.array([BATCH[1]]))
                m2 = acc.optimizer_step()
                assert m2["micro_batches"] == 2 and m2["tokens"] == m1["tokens"] and m2["lr"] == m1["lr"]
                assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-12)
                assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-10)
            pa, pb = a.parameters(), b.parameters()
            for k in pa:
                np.testing.assert_allclose(pb[k], pa[k], rtol=0, atol=1e-12)
        with seqgrad.Trainer(a, objective="dpo") as dpo:
            with pytest.raises(seqgrad.FailedPreconditionError, match="objective is 'dpo'"):
                dpo.accumulate_gradients(BATCH)
            pair = {"chosen": (BATCH[0], None), "rejected": (BATCH[1], None), "ref_chosen_logp": -60.0,
                    "ref_rejected_logp": -50.0}
            assert dpo.accumulate_gradients_dpo([pair])["tokens"] > 0
            assert dpo.optimizer_step()["micro_batches"] == 1


def test_dpo_reference_base_model_equals_base_copy():
    """With LoRA, the reference "this model with its adapters off" gives every digit of a separate base copy."""
    with _f64() as one, _f64() as two, _f64() as base:
        for m in (one, two):
            m.enable_lora(rank=2, seed=3)
        with seqgrad.Trainer(one, objective="dpo", lr=0.05) as a, \
                seqgrad.Trainer(two, objective="dpo", lr=0.05, reference=base) as b:
            a.set_reference_base_model()
            for step in range(2):
                la, lb = a.step_dpo(PAIRS)["loss"], b.step_dpo(PAIRS)["loss"]
                assert la == lb, (step, la, lb)
            assert abs(la - np.log(2)) > 1e-4  # the adapters moved away from the reference
    with _f64() as plain, seqgrad.Trainer(plain, objective="dpo") as t:
        with pytest.raises(seqgrad.FailedPreconditionError, match="has no LoRA adapters"):
            t.set_reference_base_model()


def test_lora_train_save_load(model, tmp_path):
    base_names = set(model.parameters())
    assert model.lora is None
    model.enable_lora(rank=4, alpha=8, dropout=0.1, targets=["q_proj", "v_proj"], seed=3)
    assert model.lora == {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q_proj", "v_proj"], "seed": 3}
    names = set(model.parameters())
    adapters = names - base_names
    assert len(adapters) == 2 * 2 * model.num_layers
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in adapters
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8, lr=1e-2) as tr:
        losses = [tr.step(BATCH)["loss"] for _ in range(6)]
        assert set(model.gradients()) == adapters  # the base is frozen
        ev = tr.evaluate(BATCH)["loss"]
    assert losses[-1] < losses[0]
    with pytest.raises(seqgrad.FailedPreconditionError, match="already enabled"):
        model.enable_lora()
    model.save_lora_adapter(tmp_path / "adapter", base_model_name_or_path="seqgrad/tiny")
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    model.save(tmp_path / "merged")  # a plain model: the merged weights, no adapters
    # Round trip: a fresh base with the adapter gives the same outputs (the same loss) as the trained model.
    with seqgrad.Model.from_preset("tiny", seed=1) as fresh:
        fresh.load_lora_adapter(tmp_path / "adapter")
        assert fresh.lora["rank"] == 4 and fresh.lora["targets"] == ["q_proj", "v_proj"]
        for k in adapters:
            np.testing.assert_array_equal(fresh.parameters()[k], model.parameters()[k])
        with seqgrad.Trainer(fresh, strategy="seco", chunk=8, page_size=8) as tr:
            assert tr.evaluate(BATCH)["loss"] == ev
    with seqgrad.Model.load(tmp_path / "merged") as merged:
        assert merged.lora is None and set(merged.parameters()) == base_names
        with seqgrad.Trainer(merged, strategy="seco", chunk=8, page_size=8) as tr:
            assert tr.evaluate(BATCH)["loss"] == pytest.approx(ev, rel=1e-5)  # f32 merge rounding


def test_frozen_base_allocates_no_gradients_and_trains_lora_alike():
    with seqgrad.Model.from_preset("tiny", "f64", seed=2, frozen_base=True) as frozen, \
            seqgrad.Model.from_preset("tiny", "f64", seed=2) as whole:
        assert frozen.gradients() == {} and len(whole.gradients()) == len(whole.parameters())
        with seqgrad.Trainer(frozen, strategy="seco", chunk=8, page_size=8) as tr:
            with pytest.raises(seqgrad.FailedPreconditionError, match="frozen_base"):
                tr.step(BATCH)
        for m in (frozen, whole):
            m.enable_lora(rank=4, targets=["q_proj", "v_proj"], seed=3)
        with seqgrad.Trainer(frozen, strategy="seco", chunk=8, page_size=8, lr=1e-2) as a, \
                seqgrad.Trainer(whole, strategy="seco", chunk=8, page_size=8, lr=1e-2) as b:
            for _ in range(3):
                assert a.step(BATCH)["loss"] == b.step(BATCH)["loss"]


def test_lora_errors(model, tmp_path):
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->targets: 'x_proj'"):
        model.enable_lora(targets="x_proj")
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->rank is 0"):
        model.enable_lora(rank=0)
    with pytest.raises(seqgrad.InvalidArgumentError, match="options->dropout"):
        model.enable_lora(dropout=1.5)
    with pytest.raises(seqgrad.InvalidArgumentError, match="alpha"):
        model.enable_lora(alpha=0)
    with pytest.raises(seqgrad.InvalidArgumentError, match="targets"):
        model.enable_lora(targets=3)
    with pytest.raises(seqgrad.FailedPreconditionError, match="not enabled"):
        model.save_lora_adapter(tmp_path / "x")
    grads = model.gradients()  # views of the base gradients: LoRA would release their memory
    with pytest.raises(seqgrad.FailedPreconditionError, match="numpy view"):
        model.enable_lora()
    del grads
    with seqgrad.Trainer(model) as tr:
        with pytest.raises(seqgrad.FailedPreconditionError, match="before creating trainers"):
            model.enable_lora()
    model.enable_lora(targets="all")
    assert model.lora["targets"] == list(seqgrad.LORA_TARGETS["transformer"])
    model.save_lora_adapter(tmp_path / "adapter")
    with seqgrad.Model.from_preset("demo") as other:  # another base model: shapes named
        with pytest.raises(seqgrad.InvalidArgumentError, match="different base model") as e:
            other.load_lora_adapter(tmp_path / "adapter")
        assert "shape" in str(e.value) and other.lora is None
        with pytest.raises(seqgrad.NotFoundError):
            other.load_lora_adapter(tmp_path / "missing")
    st = tmp_path / "adapter" / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[:-64])  # truncated
    with seqgrad.Model.from_preset("tiny", seed=1) as fresh:
        with pytest.raises(seqgrad.InvalidArgumentError, match="adapter_model.safetensors"):
            fresh.load_lora_adapter(tmp_path / "adapter")
        assert fresh.lora is None


def _lora_run(out_dir, steps, stop_at=None, resume=False):
    """A small LoRA training loop (f64, fixed seed, cosine schedule, dropout): losses of the steps it ran, and the
    data position it started from. Checkpoints into out_dir every 2 steps."""
    rng_seed = 11
    losses = []
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=4) as model:
        model.enable_lora(rank=4, dropout=0.1, targets="q_proj,k_proj,v_proj,o_proj", seed=4)
        with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8, lr=2e-2, lr_schedule="cosine",
                             warmup_steps=2, min_lr=1e-3, total_steps=steps, grad_accum=2) as tr:
            state = tr.resume(out_dir, missing_ok=True) if resume else None
            position = state["data_position"] if state else 0
            start = position
            rng = np.random.default_rng(rng_seed)
            batches = [_retrieval_batch(rng, model.vocab_size) for _ in range(2 * steps)]  # the "dataset"
            while tr.step_count < (stop_at or steps):
                for _ in range(2):  # grad_accum micro-batches
                    ids, labels, _ = batches[position]
                    tr.accumulate_gradients(ids, labels)
                    position += 1
                losses.append(tr.optimizer_step()["loss"])
                if tr.step_count % 2 == 0:
                    tr.save_checkpoint(out_dir, data_position=position, keep=2)
    return losses, start


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    full, _ = _lora_run(tmp_path / "a", 6)
    first, _ = _lora_run(tmp_path / "b", 6, stop_at=3)  # "killed" after step 3: the newest checkpoint is step 2
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-2"]
    rest, start = _lora_run(tmp_path / "b", 6, resume=True)
    assert start == 4  # 2 steps x 2 micro-batches
    assert first == full[:3]
    assert rest == full[2:]  # bit-identical from step 3 on
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-4", "checkpoint-6"]  # keep=2


def test_checkpoint_errors(model, tmp_path):
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        assert tr.resume(tmp_path / "none", missing_ok=True) is None
        with pytest.raises(seqgrad.NotFoundError, match="no complete checkpoint"):
            tr.resume(tmp_path / "none")
        tr.step(BATCH)
        path = tr.save_checkpoint(tmp_path / "run", data_position=7)
        assert path == os.path.join(str(tmp_path / "run"), "checkpoint-1")
        tr.step(BATCH)
        assert tr.load_checkpoint(path) == {"step": 1, "data_position": 7} and tr.step_count == 1
        with pytest.raises(seqgrad.InvalidArgumentError, match="data_position"):
            tr.save_checkpoint(tmp_path / "run", data_position=-1)
    with seqgrad.Trainer(model, strategy="seco", chunk=16, page_size=8) as tr:
        with pytest.raises(seqgrad.FailedPreconditionError, match="strategy.chunk: checkpoint '8', now '16'"):
            tr.resume(tmp_path / "run")
        assert tr.step_count == 0
    weights = os.path.join(path, "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[300] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        with pytest.raises(seqgrad.DataLossError, match="CRC-32 mismatch") as e:
            tr.load_checkpoint(path)
        assert e.value.code == 15 and e.value.code_name == "DATA_LOSS" and "model.safetensors" in str(e.value)
        with pytest.raises(seqgrad.NotFoundError, match="skipped damaged"):
            tr.resume(tmp_path / "run")
        open(weights, "wb").write(bytes(data[:1000]))
        with pytest.raises(seqgrad.DataLossError, match="truncated"):
            tr.load_checkpoint(path)
        assert tr.step_count == 0


def test_evaluate_detailed(model):
    rng = np.random.default_rng(0)
    ids, labels, distances = _retrieval_batch(rng, model.vocab_size)
    with seqgrad.Trainer(model, strategy="seco", chunk=8, page_size=8) as tr:
        r = tr.evaluate_detailed(ids, labels, distances)
        plain = tr.evaluate(ids, labels)
        assert r["tokens"] == plain["tokens"] == 8 and r["sequences"] == 2
        assert r["loss"] == pytest.approx(plain["loss"], rel=1e-12)
        assert r["perplexity"] == pytest.approx(np.exp(r["loss"]), rel=1e-12)
        assert r["accuracy"] == r["correct"] / r["tokens"]
        b = r["by_distance"]
        assert [x["lo"] for x in b] == [2**k for k in range(len(b))] and b[-1]["hi"] == 2 * b[-1]["lo"]
        assert sum(x["count"] for x in b) == 8 and b[-1]["count"] > 0
        top = max(int(d.max()) for d in distances)
        assert b[-1]["lo"] <= top < b[-1]["hi"]
        assert tr.evaluate_detailed(ids, labels)["by_distance"] == []
        distances[0][labels[0] >= 0] = 0
        with pytest.raises(seqgrad.InvalidArgumentError, match="distance >= 1"):
            tr.evaluate_detailed(ids, labels, distances)
        with pytest.raises(seqgrad.InvalidArgumentError, match="distances"):
            tr.evaluate_detailed(ids, labels, distances[:1])
        assert tr.step_count == 0


def test_nonfinite_weights_raise_internal_error(model):
    with seqgrad.Trainer(model) as tr:
        tr.step(BATCH)
        model.parameters()["model.norm.weight"][3] = np.nan
        with pytest.raises(seqgrad.InternalError, match="at step 2") as e:
            tr.step(BATCH)
        assert "model.norm.weight" in str(e.value)



# ---- views under NumPy 1 and 2 (this file also runs under PyPI's NumPy 2: //bindings/python:seqgrad_numpy2_test) ----

def _safetensors(path):
    """name -> array of a .safetensors file, read without seqgrad: 8-byte header length, JSON header, raw data."""
    import json
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    data = raw[8 + n:]
    out = {}
    for name, t in json.loads(raw[8:8 + n]).items():
        if name != "__metadata__":
            lo, hi = t["data_offsets"]
            dtype = {"F32": "<f4", "F64": "<f8"}[t["dtype"]]
            out[name] = np.frombuffer(data[lo:hi], dtype=dtype).reshape(t["shape"])
    return out


def _c_strides(a):
    strides, step = [], a.itemsize
    for n in reversed(a.shape):
        strides.insert(0, step)
        step *= n
    return tuple(strides)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_views_have_c_strides_and_the_engines_values(tmp_path, dtype):
    with seqgrad.Model.from_preset("tiny", dtype=dtype, seed=3) as model:
        with seqgrad.Trainer(model) as tr:
            tr.compute_gradients(BATCH)
        params, grads = model.parameters(), model.gradients()
        assert grads.keys() == params.keys()
        for name, a in list(params.items()) + list(grads.items()):
            assert a.dtype == (np.float32 if dtype == "f32" else np.float64), name
            assert a.strides == _c_strides(a) and 0 not in a.strides, (name, a.strides)
            assert a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"] and not a.flags["OWNDATA"], name
        model.save(tmp_path)
        saved = _safetensors(tmp_path / "model.safetensors")
        assert "model.embed_tokens.weight" in saved and len(saved) >= len(params) - 1  # lm_head may be tied
        for name, expected in saved.items():
            np.testing.assert_array_equal(params[name], expected, err_msg=name)
        assert len(np.unique(params["model.embed_tokens.weight"])) > 100  # not one element repeated


def test_writes_through_views_reach_the_engine(model):
    params = model.parameters()
    norm = params["model.norm.weight"]
    norm[:] = np.arange(norm.size, dtype=np.float32)
    np.testing.assert_array_equal(model.parameters()["model.norm.weight"], np.arange(norm.size))
    norm[5] = -1.0  # one element: exactly that one changes
    again = model.parameters()["model.norm.weight"]
    assert again[5] == -1.0 and again[4] == 4.0 and again[6] == 6.0
    norm[:] = 0  # final norm zero: every logit is 0, so the loss is exactly log(vocab_size)
    with seqgrad.Trainer(model, lr=1e-3) as tr:
        assert tr.evaluate(BATCH)["loss"] == pytest.approx(np.log(model.vocab_size), rel=1e-6)
        assert tr.step(BATCH)["loss"] == pytest.approx(np.log(model.vocab_size), rel=1e-6)
        norm[:] = 1
        assert tr.evaluate(BATCH)["loss"] != pytest.approx(np.log(model.vocab_size), rel=1e-3)


def test_gradient_views_read_and_write_the_engines_gradients(model):
    with seqgrad.Trainer(model, clip_grad_norm=0.0) as tr:
        tr.compute_gradients(BATCH)
        norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in model.gradients().values()))
        assert norm > 0 and tr.optimizer_step()["grad_norm"] == pytest.approx(norm, rel=1e-5)
    with seqgrad.Trainer(model, lr=1e-2, weight_decay=0.0, clip_grad_norm=0.0) as tr:  # fresh AdamW moments
        tr.compute_gradients(BATCH)
        grads = model.gradients()
        for g in grads.values():
            g[...] = 0
        emb, q = grads["model.embed_tokens.weight"], grads["model.layers.0.self_attn.q_proj.weight"]
        emb[-1, -1] = 3.0
        q[1, 2] = -4.0
        before = {k: v.copy() for k, v in model.parameters().items()}
        assert tr.optimizer_step()["grad_norm"] == pytest.approx(5.0, rel=1e-6)  # the norm of what was written
    for name, value in model.parameters().items():
        changed = np.argwhere(value != before[name]).tolist()
        expected = {"model.embed_tokens.weight": [list(np.array(value.shape) - 1)],
                    "model.layers.0.self_attn.q_proj.weight": [[1, 2]]}.get(name, [])
        assert changed == expected, name  # AdamW without decay moves exactly the weights with a gradient


def test_dlpack_zero_copy():
    """Parameters and gradients leave through NumPy's __dlpack__ without a copy (torch.from_dlpack takes them too)."""
    with seqgrad.Model.from_preset("tiny", seed=2) as model:
        w = model.parameters()["model.layers.0.mlp.up_proj.weight"]
        assert w.__dlpack_device__() == (1, 0)  # kDLCPU
        other = np.from_dlpack(w)
        assert other.ctypes.data == w.ctypes.data and other.shape == w.shape and other.strides == w.strides
        w[0, 1] = 7.0
        assert other[0, 1] == 7.0


def test_torch_from_dlpack_shares_memory():
    if int(np.__version__.split(".")[0]) >= 2:
        pytest.skip("Debian's torch 1.13 is built against NumPy 1")
    torch = pytest.importorskip("torch")
    model = seqgrad.Model.from_preset("tiny", seed=2)
    params = model.parameters()
    norm = torch.from_dlpack(params["model.norm.weight"])
    emb = torch.from_dlpack(params["model.embed_tokens.weight"])
    assert norm.data_ptr() == params["model.norm.weight"].ctypes.data and norm.dtype == torch.float32
    assert emb.shape == (model.vocab_size, model.hidden_size) and emb.stride() == (model.hidden_size, 1)
    np.testing.assert_array_equal(emb.numpy(), params["model.embed_tokens.weight"])
    with seqgrad.Trainer(model) as tr:
        tr.compute_gradients(BATCH)
        g = torch.from_dlpack(model.gradients()["model.norm.weight"])
        assert g.data_ptr() == model.gradients()["model.norm.weight"].ctypes.data and float(g.abs().sum()) > 0
        norm.zero_()  # a write through torch: the engine computes with it
        assert tr.evaluate(BATCH)["loss"] == pytest.approx(np.log(model.vocab_size), rel=1e-6)
    expected = emb.clone()
    del params, g
    model.close()
    import gc
    gc.collect()
    assert torch.equal(emb, expected)  # the tensor keeps the model's memory alive


def test_wrong_arrays_raise_typed_errors(model):
    with seqgrad.Trainer(model) as tr:
        for bad, match in [(np.array([[1.0, 2.0]]), r"ids\[0\] must hold integers, got dtype float64"),
                           (np.array([[True, False]]), "integers, got dtype bool"),
                           (np.zeros((1, 2, 3), dtype=np.int32), "2-D array, got 3-D"),
                           ([np.array([[1, 2]])], r"ids\[0\] must be a 1-D sequence of token ids, got shape \(1, 2\)"),
                           ([["1", "2"]], "integers, got dtype <U1")]:
            with pytest.raises(seqgrad.InvalidArgumentError, match=match):
                tr.step(bad)
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"labels\[0\] must hold integers"):
            tr.step([[1, 2, 3]], [[1.0, 2.0, 3.0]])
        # A non-contiguous view is read as its values (copied once), the same as the contiguous array.
        wide = np.array([[t, -1] for t in BATCH[0]], dtype=np.int64)
        assert not wide[:, 0].flags["C_CONTIGUOUS"]
        assert tr.evaluate([wide[:, 0]])["loss"] == tr.evaluate([BATCH[0]])["loss"]
        unaligned = np.frombuffer(b"\0" + np.array(BATCH[0], dtype=np.int32).tobytes(), np.int32, len(BATCH[0]), 1)
        assert not unaligned.flags["ALIGNED"]
        assert tr.evaluate([unaligned])["loss"] == tr.evaluate([BATCH[0]])["loss"]
        with seqgrad.Trainer(model, objective="grpo", grpo_kl_beta=0.0) as grpo:  # the per-sequence path
            assert grpo.evaluate([unaligned])["loss"] == tr.evaluate([BATCH[0]])["loss"]
            assert np.isfinite(grpo.compute_gradients_grpo([[{"ids": unaligned, "advantage": 1.0}]])["loss"])
        # The native layer takes only the exact arrays the C ABI reads: anything else names the argument.
        native, ids, lengths = tr._get(), np.array([1, 2, 3], dtype=np.int32), np.array([3], dtype=np.int64)
        for args, match in [((ids.astype(np.int64), None, lengths),
                             "ids must be a 1-D C-contiguous aligned numpy array of int32, got dtype int64"),
                            ((np.arange(6, dtype=np.int32)[::2], None, lengths), "ids .* not C-contiguous"),
                            ((ids.reshape(1, 3), None, lengths), r"ids .* shape \(1, 3\)"),
                            ((unaligned[:3], None, lengths), "ids .* unaligned"),
                            (([1, 2, 3], None, lengths), "ids .* got list"),
                            ((ids, ids.astype(np.float32), lengths), "labels .* dtype float32"),
                            ((ids, None, lengths.astype(np.int32)), "lengths .* of int64, got dtype int32"),
                            ((ids, None, lengths.astype(">i8")), "lengths .* of int64, got dtype >i8")]:
            with pytest.raises(seqgrad.InvalidArgumentError, match=match):
                native.evaluate(*args, None, None)
        assert tr.step_count == 0
    with seqgrad.Trainer(model, objective="grpo", grpo_kl_beta=0.0) as tr:
        groups = _groups()
        groups[0][0]["old_logprobs"] = np.array(groups[0][0]["old_logprobs"], dtype=np.complex128)
        with pytest.raises(seqgrad.InvalidArgumentError,
                           match=r"groups\[0\]\[0\]\['old_logprobs'\] must hold real numbers.*got dtype complex128"):
            tr.step_grpo(groups)
        groups = _groups()
        groups[0][1]["ref_logprobs"] = [None] * len(groups[0][1]["ids"])
        with pytest.raises(seqgrad.InvalidArgumentError,
                           match=r"\['ref_logprobs'\] must hold real numbers.*got dtype object"):
            tr.step_grpo(groups)
        groups = _groups()
        groups[1][0]["advantage"] = "1.5"
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"groups\[1\]\[0\]\['advantage'\] must be a number"):
            tr.step_grpo(groups)
        groups = _groups()
        groups[1][0]["advantage"] = np.array([1.0, 2.0])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"\['advantage'\] must be a number"):
            tr.step_grpo(groups)
        native = tr._get()
        with pytest.raises(seqgrad.InvalidArgumentError, match="advantages .* of float64, got dtype float32"):
            native.grpo([np.array([1, 2], dtype=np.int32)], [None], np.array([1.0], dtype=np.float32), [None], [None],
                        np.array([0, 1], dtype=np.int64), 0)
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"completions\[0\] ids .* of int32"):
            native.grpo([np.array([1, 2])], [None], np.array([1.0]), [None], [None], np.array([0, 1]), 0)
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"old_logprobs\[0\] .* of float64"):
            native.grpo([np.array([1, 2], dtype=np.int32)], [None], np.array([1.0]), [np.array([1, 2])], [None],
                        np.array([0, 1]), 0)
    with seqgrad.Trainer(model, objective="dpo") as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"pairs\[0\]\['ref_chosen_logp'\] must be a number"):
            tr.step_dpo([dict(PAIRS[0], ref_chosen_logp="0.5", ref_rejected_logp=0.1)])
        with pytest.raises(seqgrad.InvalidArgumentError, match="ref_chosen_logp .* of float64, got dtype int64"):
            tr._get().dpo([np.array([1, 2], dtype=np.int32)], [None], [np.array([1, 2], dtype=np.int32)], [None],
                          np.array([1]), np.array([1.0]), 0)
    with seqgrad.Trainer(model) as tr:
        with pytest.raises(seqgrad.InvalidArgumentError, match="distances .* of int64, got dtype float64"):
            tr._get().evaluate_detailed(np.array([1, 2], dtype=np.int32), None, np.array([2]), np.array([1.0, 1.0]),
                                        None, None)
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"distances\[0\] must be 2 integers"):
            tr.evaluate_detailed([[1, 2]], [[2, -100]], [[1.0, 1.0]])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))


def test_doc_lengths_train_each_document_alone():
    """A sequence packing documents (doc_lengths) gives the gradients, loss and log-probs of its documents as
    separate sequences, in every sft call, under a chunked strategy that cuts documents; bad lengths are named."""
    docs = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 83]]
    packed = [sum(docs, [])]
    with _f64() as m:
        t = seqgrad.Trainer(m, strategy="seco", chunk=4, page_size=2)
        alone = t.compute_gradients(docs)
        alone_grads = _grads(m)
        together = t.compute_gradients(packed, doc_lengths=[[5, 3, 6]])
        assert together["tokens"] == alone["tokens"] == 11
        assert abs(together["loss"] - alone["loss"]) <= 1e-13 * alone["loss"]
        _assert_grads_close(_grads(m), alone_grads, 1e-11)
        assert abs(t.evaluate(packed, doc_lengths=[[5, 3, 6]])["loss"] - alone["loss"]) <= 1e-13 * alone["loss"]
        detailed = t.evaluate_detailed(packed, doc_lengths=[[5, 3, 6]])
        assert detailed["tokens"] == 11 and abs(detailed["loss"] - alone["loss"]) <= 1e-13 * alone["loss"]
        np.testing.assert_allclose(t.score(packed, doc_lengths=[[5, 3, 6]])[0], np.concatenate(t.score(docs)),
                                   rtol=1e-12)
        assert t.evaluate(packed, doc_lengths=[None])["tokens"] == 13  # None: one document, attending across
        acc = t.accumulate_gradients(packed, doc_lengths=[[5, 3, 6]])
        assert abs(acc["loss"] - alone["loss"]) <= 1e-13 * alone["loss"]
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"doc_lengths\[0\]\[1\] = 0"):
            t.step(packed, doc_lengths=[[5, 0, 9]])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"doc_lengths\[0\] sums to 13 but lengths\[0\] is 14"):
            t.step(packed, doc_lengths=[[5, 8]])
        with pytest.raises(seqgrad.InvalidArgumentError, match="one entry per sequence"):
            t.step(packed, doc_lengths=[[5, 9], [1]])
        with pytest.raises(seqgrad.InvalidArgumentError, match=r"doc_lengths\[0\] must be None or a list"):
            t.step(packed, doc_lengths=[[5.0, 9.0]])
        assert t.step_count == 0
