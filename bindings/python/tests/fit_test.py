"""seqgrad.fit: the strategy it picks against the plan and the budget, its result against a hand-written Trainer
loop (bit for bit, f64), resuming, and its errors. Tokenized records only: fit_data_test tokenizes text."""
import json
import math
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seqgrad  # noqa: E402
from seqgrad import _cli, data  # noqa: E402

SEED = 3
CHUNK = 16


def records(n=7, lo=8, hi=40, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(1, 90, size=int(rng.integers(lo, hi))).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]} if labels else {"input_ids": ids})
    return out


def plan(strategy, seq_len, dtype="f64"):
    out = subprocess.run([_cli.tool_path("plan"), "--json", "--model=tiny", "--dtype=" + dtype,
                          "--strategy=" + strategy, "--chunk=%d" % CHUNK, "--seq_len=%d" % seq_len],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)["device_total_peak"]


def longest(recs):
    return max(len(r["input_ids"]) for r in recs)


def fit(recs, **kw):
    args = dict(dtype="f64", chunk=CHUNK, seed=SEED, progress=False, learning_rate=1e-2, max_steps=3,
                per_device_train_batch_size=2)
    args.update(kw)
    return seqgrad.fit(kw.pop("model", "tiny"), recs, **{k: v for k, v in args.items() if k != "model"})


# ---- strategy="auto" ----

def test_auto_takes_the_fastest_strategy_that_fits():
    recs = records()
    full = plan("full", longest(recs))
    budget = full - 1
    r = fit(recs, memory_budget=budget)
    # full is ruled out; seco, next in the order, fits (the plan tool says so, independently of fit).
    assert plan("seco", longest(recs)) <= budget
    assert r.strategy == "seco" and r.rejected == [("full", full)]
    assert r.planned_peak_bytes == plan("seco", longest(recs)) and r.memory_budget == budget
    assert "seco" in r.strategy_reason and "full plans" in r.strategy_reason and "memory_budget" in r.strategy_reason
    assert all(h["peak_bytes"] <= budget for h in r.history)  # the run really fits
    assert max(h["peak_bytes"] for h in r.history) <= r.planned_peak_bytes
    # With room for full it takes full.
    assert fit(recs, memory_budget=full).strategy == "full"


def test_the_default_budget_is_the_devices_memory(monkeypatch, tmp_path):
    r = fit(records(), max_steps=1)  # the host's MemAvailable: plenty for tiny
    assert r.strategy == "full" and "MemAvailable" in r.strategy_reason and r.memory_budget > 2 ** 20
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=SEED) as model:
        model.set_memory_limit(plan("full", longest(records())) - 1)
        r = fit(records(), model=model, dtype=None, max_steps=1)
        assert r.strategy == "seco" and r.memory_budget == model.memory_limit
        assert "the model's memory limit" in r.strategy_reason
    # A GPU: its total memory from nvidia-smi (of the first visible device), less 256 MiB.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"$@\" > %s/args\necho 81559\n" % tmp_path)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    gpu = types.SimpleNamespace(memory_limit=0, device="cuda")
    device_budget = sys.modules["seqgrad.fit"]._device_budget  # the module; seqgrad.fit is the function
    assert device_budget(gpu)[0] == (81559 - 256) * 2 ** 20
    assert (tmp_path / "args").read_text().split() == ["--query-gpu=memory.total", "--format=csv,noheader,nounits",
                                                       "--id=3"]
    smi.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(seqgrad.InvalidArgumentError, match="cannot read the GPU's memory .*give memory_budget"):
        device_budget(gpu)


def test_auto_refuses_before_any_step_when_nothing_fits(tmp_path):
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=SEED) as model:
        before = {k: v.copy() for k, v in model.parameters().items()}
        with pytest.raises(seqgrad.ResourceExhaustedError, match=r"no exact strategy fits .*full .*seco .*streambp "
                                                                 r".*ckpt .*; shorten max_length"):
            fit(records(), model=model, dtype=None, memory_budget=100000, output_dir=str(tmp_path / "out"),
                lora={"r": 2})
        assert all(np.array_equal(v, before[k]) for k, v in model.parameters().items()) and model.lora is None
    assert not os.path.exists(tmp_path / "out")  # nothing written either


# ---- fit equals the same run written by hand ----

def hand_written(recs, kind, strategy, epochs, batch_size, grad_accum, shuffle, lora=None, **options):
    """The run fit's docstring describes, with the Trainer's calls."""
    n = len(recs)
    total = epochs * math.ceil(math.ceil(n / batch_size) / grad_accum)
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=SEED) as model:
        if lora:
            model.enable_lora(seed=SEED, **lora)
        with seqgrad.Trainer(model, strategy=strategy, chunk=CHUNK, seed=SEED, objective=kind, total_steps=total,
                             grad_accum=grad_accum, betas=(0.9, 0.999), eps=1e-8, clip_grad_norm=1.0,
                             **options) as tr:
            if kind == "dpo" and lora:
                tr.set_reference_base_model()
            elif kind == "dpo":  # a copy of the initial model, created whole (fit's is frozen: the same values)
                reference = seqgrad.Model.from_preset("tiny", dtype="f64", seed=SEED)
                tr.set_reference(reference)
            step, accumulate = {"sft": (tr.step, tr.accumulate_gradients),
                                "dpo": (tr.step_dpo, tr.accumulate_gradients_dpo)}[kind]
            for epoch in range(epochs):
                order = np.random.default_rng([SEED, epoch]).permutation(n) if shuffle else np.arange(n)
                micro = [[recs[i] for i in order[b:b + batch_size]] for b in range(0, n, batch_size)]
                for s in range(0, len(micro), grad_accum):
                    args = [batch_args(kind, mb) for mb in micro[s:s + grad_accum]]
                    if len(args) == 1:
                        step(*args[0])
                    else:
                        for a in args:
                            accumulate(*a)
                        tr.optimizer_step()
            assert tr.step_count == total
        return {k: v.copy() for k, v in model.parameters().items()}


def initial_parameters(lora):
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=SEED) as model:
        if lora:
            model.enable_lora(seed=SEED, **lora)
        return {k: v.copy() for k, v in model.parameters().items()}


def batch_args(kind, recs):
    if kind == "sft":
        return [r["input_ids"] for r in recs], [r.get("labels", r["input_ids"]) for r in recs]
    return ([{k: (r["prompt"] + r[k], [-100] * len(r["prompt"]) + r[k]) for k in ("chosen", "rejected")}
             for r in recs],)


def same_parameters(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", [
    dict(kind="sft", epochs=2, batch_size=2, grad_accum=2, shuffle=True, lora=None),
    dict(kind="sft", epochs=1, batch_size=3, grad_accum=1, shuffle=True, lora=dict(rank=4, alpha=8.0, dropout=0.0,
                                                                                    targets=["q_proj", "v_proj"])),
    dict(kind="sft", epochs=2, batch_size=1, grad_accum=3, shuffle=False, lora=None),
])
def test_fit_equals_the_hand_written_loop_bit_for_bit(case, monkeypatch):
    created = []  # fit makes a LoRA model frozen_base: the base's gradients are never allocated
    from_preset = seqgrad.Model.from_preset.__func__

    def recording(cls, name, dtype="f32", seed=0, device="cpu", frozen_base=False):
        created.append(frozen_base)
        return from_preset(cls, name, dtype, seed, device, frozen_base)
    monkeypatch.setattr(seqgrad.Model, "from_preset", classmethod(recording))
    recs = records(labels=True)
    lora = case["lora"] and {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    r = fit(recs, max_steps=None, num_train_epochs=case["epochs"], per_device_train_batch_size=case["batch_size"],
            gradient_accumulation_steps=case["grad_accum"], shuffle=case["shuffle"], lora=lora,
            lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01)
    expected = hand_written(recs, case["kind"], r.strategy, case["epochs"], case["batch_size"], case["grad_accum"],
                            case["shuffle"], case["lora"], lr=1e-2, lr_schedule="linear", warmup_steps=1,
                            weight_decay=0.01)
    got = r.model.parameters()
    assert same_parameters(got, expected)
    assert not same_parameters(got, initial_parameters(case["lora"]))  # it trained: the comparison can fail
    assert created[0] == bool(case["lora"])
    r.model.close()


def dpo_records(n=5):
    rng = np.random.default_rng(1)
    ids = lambda k: rng.integers(1, 90, size=k).tolist()  # noqa: E731
    return [{"prompt": ids(6), "chosen": ids(5), "rejected": ids(7)} for _ in range(n)]


def test_dpo_with_lora_equals_the_hand_written_loop():
    recs = dpo_records()
    lora = dict(rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "v_proj"])
    r = fit(recs, max_steps=None, num_train_epochs=1, per_device_train_batch_size=2, strategy="seco",
            lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, lr_scheduler_type="constant")
    assert r.objective == "dpo" and len(r.history) == 3
    expected = hand_written(recs, "dpo", "seco", 1, 2, 1, True, lora, lr=1e-2, lr_schedule="constant",
                            dpo_beta=0.1)
    assert same_parameters(r.model.parameters(), expected)


def test_dpo_without_lora_equals_the_hand_written_loop():
    recs = dpo_records()
    r = fit(recs, max_steps=None, num_train_epochs=1, per_device_train_batch_size=2, strategy="seco",
            lr_scheduler_type="constant")
    expected = hand_written(recs, "dpo", "seco", 1, 2, 1, True, lr=1e-2, lr_schedule="constant", dpo_beta=0.1)
    assert same_parameters(r.model.parameters(), expected)
    assert not same_parameters(r.model.parameters(), initial_parameters(None))


def test_grpo_groups_without_kl_need_no_reference():
    recs = [{"prompt": [1, 2, 3], "completions": [[4, 5], [6, 7, 8]], "advantages": [1.0, -1.0]}] * 2
    r = fit(recs, max_steps=2, per_device_train_batch_size=1)
    assert r.objective == "grpo" and all(math.isfinite(h["loss"]) for h in r.history)


# ---- checkpoints ----

def test_resume_gives_the_uninterrupted_run(tmp_path):
    recs = records(labels=True)
    options = dict(max_steps=5, save_steps=2, gradient_accumulation_steps=2, lr_scheduler_type="cosine",
                   warmup_steps=1)
    whole = fit(recs, output_dir=str(tmp_path / "whole"), **options)
    assert [os.path.basename(p) for p in whole.paths["checkpoints"]] == ["checkpoint-2", "checkpoint-4",
                                                                         "checkpoint-5"]
    # What an interrupted run leaves: its checkpoint at step 2.
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", cut / "checkpoint-2")
    shutil.copy(tmp_path / "whole" / "fit_config.json", cut)
    with pytest.raises(seqgrad.FailedPreconditionError, match="already holds checkpoint-2: pass "
                                                               "resume_from_checkpoint=True"):
        fit(recs, output_dir=str(cut), **options)
    with pytest.raises(seqgrad.FailedPreconditionError, match="other per_device_train_batch_size"):
        fit(recs, output_dir=str(cut), resume_from_checkpoint=True, **dict(options, per_device_train_batch_size=3))
    resumed = fit(recs, output_dir=str(cut), resume_from_checkpoint=True, **options)
    assert same_parameters(resumed.model.parameters(), whole.model.parameters())
    with open(cut / "report.json") as f:
        report = json.load(f)
    with open(tmp_path / "whole" / "report.json") as f:
        uninterrupted = json.load(f)
    assert report["resumed_from_step"] == 2 and report["losses"] == uninterrupted["losses"]
    assert len(report["losses"]) == 5
    # A checkpoint alone (no fit_config.json beside it) read with other batches: its data position differs.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", alone / "checkpoint-2")
    with pytest.raises(seqgrad.FailedPreconditionError, match="the checkpoint of step 2 had read 7 records, this "
                                                               "run's step 3 starts at record 4"):
        fit(recs, output_dir=str(alone), resume_from_checkpoint=True, **dict(options, per_device_train_batch_size=1))
    # A checkpoint directory named explicitly.
    again = fit(recs, resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-4"), **dict(options,
                                                                                            save_steps=None))
    assert same_parameters(again.model.parameters(), whole.model.parameters())


def test_outputs_and_report(tmp_path):
    recs = records()
    lora = types.SimpleNamespace(r=2, lora_alpha=4, lora_dropout=0.0, target_modules={"v_proj", "q_proj"},
                                 bias="none")  # a peft.LoraConfig, duck-typed
    r = fit(recs, output_dir=str(tmp_path), lora=lora, eval_dataset=records(2, seed=5), eval_steps=2, max_steps=3)
    assert r.model.lora["rank"] == 2 and r.model.lora["alpha"] == 4 and sorted(r.model.lora["targets"]) == [
        "q_proj", "v_proj"]
    assert os.path.exists(tmp_path / "adapter_config.json") and r.paths["adapter"] == str(tmp_path)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    for key in ("model", "objective", "strategy", "seq_len", "chunk", "steps", "resumed_from_step", "loss_first",
                "loss_last", "tokens_per_s", "peak_bytes", "peak_bytes_by_category", "lora", "losses", "metrics",
                "evals", "strategy_choice"):
        assert key in report, key
    assert report["steps"] == 3 and report["seq_len"] == longest(recs) and report["lora"]["rank"] == 2
    assert [e["step"] for e in report["evals"]] == [2, 3] and r.metrics["eval"] == {
        k: v for k, v in report["evals"][-1].items() if k != "step"}
    assert report["strategy_choice"]["strategy"] == r.strategy and report["losses"] == [h["loss"] for h in r.history]
    assert r.history[0]["tokens"] == sum(len(recs[i]["input_ids"]) for i in
                                         np.random.default_rng([SEED, 0]).permutation(len(recs))[:2])


def test_plain_progress_lines_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    fit(records(), progress=True, logging_steps=2, max_steps=3, strategy="full")
    err = capsys.readouterr().err
    assert "seqgrad.fit: strategy full: given" in err
    assert "step 2/3  loss" in err and "step 3/3" in err and "step 1/3" not in err and "tok/s" in err


def test_tqdm_bar_shows_loss_speed_and_memory(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.postfix, self.updates, self.closed = kw, [], 0, False
            bars.append(self)

        def set_postfix(self, values, refresh):
            self.postfix.append(values)

        def update(self, n):
            self.updates += n

        def write(self, line, file):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
    monkeypatch.setitem(sys.modules, "tqdm.auto", types.SimpleNamespace(tqdm=Bar))
    r = fit(records(), progress=True, max_steps=3, strategy="full")
    (bar,) = bars
    assert bar.kw["total"] == 3 and bar.updates == 3 and bar.closed
    assert [p["loss"] for p in bar.postfix] == ["%.4f" % h["loss"] for h in r.history]
    assert set(bar.postfix[0]) == {"loss", "tok/s", "peak"} and bar.postfix[0]["peak"].endswith(" MiB")


def test_packing_and_max_length_use_seqgrad_data():
    recs = records(6, lo=5, hi=12)
    r = fit(recs, packing=True, max_length=24, per_device_train_batch_size=100, max_steps=1, strategy="full")
    packed = data._pack([{"input_ids": x["input_ids"], "labels": x["input_ids"]} for x in recs], 24, True)
    assert all("doc_lengths" in p for p in packed)
    assert r.history[0]["tokens"] == sum(len(p["input_ids"]) for p in packed)
    # Packed documents train as the records alone: one batch of all of them, packed or not, has the same loss.
    alone = fit(recs, max_length=24, per_device_train_batch_size=100, max_steps=1, strategy="full")
    assert abs(r.history[0]["loss"] - alone.history[0]["loss"]) <= 1e-5 * alone.history[0]["loss"]
    with pytest.raises(seqgrad.InvalidArgumentError, match=r"7 of 7 records are longer than seq_len 4 tokens"):
        fit(records(), max_length=4)
    cut = fit(records(), max_length=4, overlong="truncate", per_device_train_batch_size=100, max_steps=1)
    assert cut.history[0]["tokens"] == 7 * 4


# ---- bad arguments ----

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(per_device_train_batch_size=0), seqgrad.InvalidArgumentError, "per_device_train_batch_size must be"),
    (dict(max_steps=1.5), seqgrad.InvalidArgumentError, "max_steps must be an integer >= 1 or None"),
    (dict(lr_scheduler_type="cosine_with_restarts"), seqgrad.InvalidArgumentError, "lr_scheduler_type must be"),
    (dict(strategy="fast"), seqgrad.InvalidArgumentError, "strategy must be 'auto' or one of"),
    (dict(strategy="seco", memory_budget=10 ** 9), seqgrad.InvalidArgumentError, "memory_budget is what"),
    (dict(learning_rate=-1), seqgrad.InvalidArgumentError, "learning_rate must be a number in"),
    (dict(adam_beta2=1.5), seqgrad.InvalidArgumentError, "adam_beta2 must be a number in"),
    (dict(lora={"rank": 4}), seqgrad.InvalidArgumentError, r"lora: unknown key\(s\) rank"),
    (dict(lora=object()), seqgrad.InvalidArgumentError, "lora must be a peft.LoraConfig or a dict"),
    (dict(lora=types.SimpleNamespace(r=4, use_dora=True)), seqgrad.InvalidArgumentError, "lora.use_dora=True"),
    (dict(model="no-such-model"), seqgrad.InvalidArgumentError, "model: 'no-such-model' is neither"),
    (dict(packing=True), seqgrad.InvalidArgumentError, "packing needs max_length"),
    (dict(resume_from_checkpoint=True), seqgrad.InvalidArgumentError, "resume_from_checkpoint=True needs output_dir"),
    (dict(eval_steps=2), seqgrad.InvalidArgumentError, "eval_steps needs eval_dataset"),
    (dict(lr_scheduler_type="linear", warmup_steps=3), seqgrad.InvalidArgumentError, "warmup_steps=3: "),
    (dict(train=[{"text": "hello"}]), seqgrad.InvalidArgumentError, "tokenizer: the data is text"),
    (dict(train=[]), seqgrad.InvalidArgumentError, "train_dataset: no records"),
    (dict(train=["hello"]), seqgrad.InvalidArgumentError, "train_dataset: expected records .*the string \"hello\""),
    (dict(train=[{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3]}]),
     seqgrad.InvalidArgumentError, r"train_dataset\[1\]: field 'labels' has 3 entries for 4 input_ids"),
    (dict(train=[{"input_ids": [1, 2, 500]}]), seqgrad.InvalidArgumentError,
     "train_dataset: record 0 has token id 500 outside the model's vocabulary of 97"),
    (dict(train=[{"input_ids": [1, 2], "labels": [-100, -7]}]), seqgrad.InvalidArgumentError, "token id -7 outside"),
    (dict(train=[{"input_ids": [1, 2 ** 40]}]), seqgrad.InvalidArgumentError,
     r"train_dataset\[0\]: field 'input_ids' holds 1099511627776, outside 32-bit integers"),
    (dict(train=[{"prompt": [1, 2], "chosen": [3], "rejected": "four"}]), seqgrad.InvalidArgumentError,
     r"train_dataset\[0\]: field 'rejected' must be a non-empty list of token ids"),
    (dict(train=[{"input_ids": [1, 2]}], eval_dataset=dpo_records(1)), seqgrad.InvalidArgumentError,
     "eval_dataset: evaluation is for SFT data"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    recs = kwargs.pop("train", records())
    with pytest.raises(error, match=message):
        fit(recs, **kwargs)


def test_the_model_directory_is_not_an_output_dir(tmp_path):
    with seqgrad.Model.from_preset("tiny", dtype="f64") as model:
        model.save(str(tmp_path))
    with pytest.raises(seqgrad.InvalidArgumentError, match="output_dir .* is the model's directory"):
        seqgrad.fit(str(tmp_path), records(), output_dir=str(tmp_path), strategy="full", progress=False)


def test_a_given_model_keeps_its_dtype():
    with seqgrad.Model.from_preset("tiny", dtype="f64") as model:
        with pytest.raises(seqgrad.InvalidArgumentError, match="dtype='f32', but the model given is f64"):
            seqgrad.fit(model, records(), dtype="f32")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
