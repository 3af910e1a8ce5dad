"""seqgrad.fit: a whole training run in one call, in the shape of TRL's trainers.

    import seqgrad
    result = seqgrad.fit("path/to/hf_model", "chats.jsonl", lora={"r": 16, "lora_alpha": 32},
                         max_length=32768, output_dir="run")
    print(result.strategy, result.strategy_reason, result.metrics["loss_last"])

is TRL's SFTTrainer(model, args=SFTConfig(output_dir="run", max_length=32768), train_dataset=...,
peft_config=LoraConfig(r=16, lora_alpha=32)).train(), with the config's fields as keyword arguments of the same
names (num_train_epochs, max_steps, per_device_train_batch_size, gradient_accumulation_steps, learning_rate,
lr_scheduler_type, warmup_steps, seed, eval_steps, save_steps, save_total_limit, resume_from_checkpoint,
logging_steps, max_length, packing, beta) and TRL's defaults, but max_length (None: no limit) and save_steps (None:
a checkpoint after the last step only). The data's format picks the objective: text,
prompt/completion and messages train SFT, {prompt, chosen, rejected} DPO, {prompt, completions, advantages} GRPO
(seqgrad.data tokenizes them with the model directory's tokenizer); records already tokenized ({"input_ids"[,
"labels"]}, or the token-id records seqgrad.data writes) are taken as they are.

strategy="auto" plans one step of every exact strategy with the package's plan tool (the engine's allocation
schedule walked on the meta device, checked byte for byte against the CPU by //core:plan_test) at the data's longest
sequence, fastest first, and takes the first whose planned peak fits the budget: memory_budget, else the model's
memory limit, else the device's memory less a 256 MiB margin (the host's MemAvailable plus what the model holds; a
GPU's total from nvidia-smi). A separate reference model (DPO, GRPO) is not in the plan. The order, from the
measured runs in docs/bench: full (no recompute), then seco and streambp (each recomputes one forward; seco was 0-8%
faster than streambp at 2K-16K tokens on the CPU and is faster in the H100 roofline census), then ckpt (the slowest
of the four in docs/cpu.md's table, and more memory than streambp). spaco is left out (an unbiased estimate, not
exact), and so is adjoint: docs/strategies.md measures it as seco's gradient with no less memory and, in its default
pairs form, O(T^2) time, so it is never the fastest that fits.

Order of the data (what a hand-written loop reproduces): epoch e takes the records in the order
numpy.random.default_rng([seed, e]).permutation(n) (shuffle=False: as given), in micro-batches of
per_device_train_batch_size (the last may be smaller); each optimizer step takes gradient_accumulation_steps
micro-batches of one epoch (an epoch's last step may take fewer): Trainer.step() for one micro-batch, else
accumulate_gradients() for each and optimizer_step(). max_steps > 0 runs that many steps through as many epochs
as needed, else num_train_epochs epochs. The Trainer gets total_steps = the run's steps for its schedule.
"""
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import types

import numpy as np

from . import Model, PRESETS, Trainer, data
from ._cli import tool_path
from ._errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError

# Exact strategies, fastest first (the module docstring says why).
AUTO_ORDER = ("full", "seco", "streambp", "ckpt")
STRATEGIES = ("full", "ckpt", "seco", "spaco", "streambp", "adjoint")
MARGIN_BYTES = 256 << 20  # what the CLI keeps free on a device: runtime workspaces, fragmentation
# TRL's default learning rate of each trainer (SFTConfig, DPOConfig, GRPOConfig).
DEFAULT_LR = {"sft": 2e-5, "dpo": 1e-6, "grpo": 1e-6}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
_STEP_CALLS = {"sft": ("step", "accumulate_gradients"), "dpo": ("step_dpo", "accumulate_gradients_dpo"),
               "grpo": ("step_grpo", "accumulate_gradients_grpo")}
_LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules")  # a PEFT LoraConfig's, as lora= reads them
HISTORY_FILE = "fit_history.json"  # per-step metrics, inside each checkpoint-<step> directory
CONFIG_FILE = "fit_config.json"  # the data and batching a resume must match


class FitResult:
    """What fit() returns. metrics: loss_first, loss_last, steps, tokens_per_s, peak_bytes(_by_category) (of the
    steps this call trained), eval (the last evaluation or None); history: per-step metrics; strategy,
    strategy_reason, planned_peak_bytes, memory_budget, rejected (faster strategies that did not fit, as (name,
    planned peak bytes)); objective; model: the trained seqgrad.Model; paths: what was written (report, model or
    adapter, checkpoints)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self):
        return "FitResult(strategy=%r, steps=%d, loss_last=%r)" % (self.strategy, self.metrics["steps"],
                                                                  self.metrics["loss_last"])


# ---- arguments ----

def _integer(value, name, low, none_ok=False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError("%s must be an integer >= %d%s, got %r" % (name, low, " or None" if none_ok else "",
                                                                             value))
    return int(value)


def _number(value, name, low, high=math.inf, low_open=False):
    ok = not isinstance(value, (bool, str, bytes)) and np.ndim(value) == 0
    try:
        x = float(value) if ok else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not (low < x if low_open else low <= x) or not x <= high or not math.isfinite(x):
        raise InvalidArgumentError("%s must be a number in %s%g, %g], got %r" % (name, "(" if low_open else "[", low,
                                                                                high, value))
    return x


def lora_options(lora):
    """Model.enable_lora's keyword arguments of a PEFT LoraConfig (read by attribute, no peft import) or a dict with
    its field names: r, lora_alpha, lora_dropout, target_modules ("all-linear" = every target)."""
    if isinstance(lora, dict):
        unknown = sorted(set(lora) - set(_LORA_FIELDS))
        if unknown:
            raise InvalidArgumentError("lora: unknown key(s) %s (known: %s)" % (", ".join(map(str, unknown)),
                                                                                  ", ".join(_LORA_FIELDS)))
        get = lora.get
    else:
        if not hasattr(lora, "r"):
            raise InvalidArgumentError("lora must be a peft.LoraConfig or a dict (r, lora_alpha, lora_dropout, "
                                       "target_modules), got %s" % type(lora).__name__)
        for field, plain in (("bias", "none"), ("use_dora", False), ("use_rslora", False)):
            if getattr(lora, field, plain) != plain:
                raise InvalidArgumentError("lora.%s=%r is not supported (seqgrad's LoRA is plain PEFT LoRA: %s=%r)" %
                                           (field, getattr(lora, field), field, plain))
        get = lambda key, default=None: getattr(lora, key, default)  # noqa: E731
    rank = _integer(get("r", 8), "lora r", 1)
    targets = get("target_modules")
    if targets == "all-linear":
        targets = "all"
    elif isinstance(targets, (set, frozenset)):
        targets = sorted(targets)
    return {"rank": rank, "alpha": _number(get("lora_alpha", 8), "lora lora_alpha", 0, low_open=True),
            "dropout": _number(get("lora_dropout", 0.0), "lora lora_dropout", 0, 1), "targets": targets}


def _open_model(model, dtype, device, seed, frozen_base=False):
    """(Model, spec) of fit's model argument; one made here is created frozen_base when only adapters will train
    (or it only scores), so the base's gradients are never allocated."""
    if isinstance(model, Model):
        for name, value, have in (("dtype", dtype, model.dtype), ("device", device, model.device)):
            if value is not None and value != have:
                raise InvalidArgumentError("%s=%r, but the model given is %s (leave %s out)" % (name, value, have,
                                                                                                 name))
        return model, model._spec
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidArgumentError("model must be a seqgrad.Model, a Hugging Face model directory or a preset "
                                   "name, got %s" % type(model).__name__)
    spec = os.fspath(model)
    if os.path.isdir(spec):
        return Model.load(spec, dtype or "f32", device or "cpu", frozen_base), os.path.abspath(spec)
    if spec in PRESETS:
        return Model.from_preset(spec, dtype or "f32", seed, device or "cpu", frozen_base), spec
    raise InvalidArgumentError("model: %r is neither a directory nor a preset (%s)" % (spec, ", ".join(PRESETS)))


# ---- data ----

def _int_list(v):
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in v)


def _is_tokenized(obj):
    return isinstance(obj, dict) and (obj.get("input_ids") is not None or _int_list(obj.get("prompt")) or
                                      _int_list(obj.get("chosen")))


def _tokenized_format(where, obj):
    if obj.get("input_ids") is not None:
        return "tokens"
    if obj.get("completions") is not None:
        return "grpo"
    if obj.get("chosen") is not None:
        return "dpo"
    raise InvalidArgumentError("%s: a tokenized record needs 'input_ids' (sft), 'prompt' + 'chosen' + 'rejected' "
                               "(dpo) or 'prompt' + 'completions' + 'advantages' (grpo)" % where)


def _token_field(rec, name, value=None, empty_ok=False):
    v = rec.obj.get(name) if value is None else value
    if not (_int_list(v) or (empty_ok and isinstance(v, (list, tuple)) and not v)):
        raise rec.error(name, "must be a non-empty list of token ids, got %s" % data._describe(v))
    wide = [t for t in v if not -2 ** 31 <= t < 2 ** 31]
    if wide:
        raise rec.error(name, "holds %d, outside 32-bit integers" % wide[0])
    return [int(t) for t in v]


def _tokenized_record(rec, fmt):
    """One already tokenized record, checked, in seqgrad.data's output form."""
    if fmt == "tokens":
        ids = _token_field(rec, "input_ids")
        labels = ids if rec.obj.get("labels") is None else _token_field(rec, "labels")
        if len(labels) != len(ids):
            raise rec.error("labels", "has %d entries for %d input_ids" % (len(labels), len(ids)))
        return {"input_ids": ids, "labels": labels}
    out = {"prompt": _token_field(rec, "prompt", empty_ok=True)}
    if fmt == "dpo":
        out.update(chosen=_token_field(rec, "chosen"), rejected=_token_field(rec, "rejected"))
        for key in ("ref_chosen_logp", "ref_rejected_logp"):
            if rec.obj.get(key) is not None:
                out[key] = rec.number(rec.obj[key], key)
        return out
    completions, advantages = rec.obj.get("completions"), rec.obj.get("advantages")
    if not isinstance(completions, (list, tuple)) or not completions:
        raise rec.error("completions", "must be a non-empty list of token-id lists")
    if not isinstance(advantages, (list, tuple)) or len(advantages) != len(completions):
        raise rec.error("advantages", "must be a list of one number per completion (%d)" % len(completions))
    out["completions"] = [_token_field(rec, "completions[%d]" % i, c) for i, c in enumerate(completions)]
    out["advantages"] = [rec.number(a, "advantages[%d]" % i) for i, a in enumerate(advantages)]
    return out


def _first_record(source, name):
    for _, obj in data._records(source, name, data.MAX_LINE_BYTES):
        return obj
    return None


def _prepare(source, name, tokenizer, fmt, max_length, packing, overlong):
    """seqgrad.data.Prepared of a dataset argument; tokenizer() gives the tokenizer when the records need one."""
    if isinstance(source, data.Prepared):
        return source
    if not isinstance(source, (str, os.PathLike, list, tuple)) and not hasattr(source, "column_names"):
        source = list(source)  # a one-pass iterable is read twice (the first record says what it holds)
    first = _first_record(source, name)
    if not isinstance(first, dict):
        raise InvalidArgumentError("%s: %s" % (name, "no records" if first is None else
                                               "expected records (dicts), the first is %s" % data._describe(first)))
    if _is_tokenized(first):
        return data._convert(source, name, data.MAX_LINE_BYTES, "auto", _tokenized_format, _tokenized_record,
                             max_length, packing, overlong)
    return data.prepare(source, tokenizer(), fmt, max_length, packing, overlong, name)


def _sequences(kind, r):
    """The (ids, labels) sequences of one prepared record."""
    if kind == "sft":
        return [(r["input_ids"], r["labels"])]
    responses = [r["chosen"], r["rejected"]] if kind == "dpo" else r["completions"]
    return [data.response_sequence(r["prompt"], x) for x in responses]


def _check_vocab(prepared, vocab, name):
    """Every token id and label inside the model's vocabulary, before the first step."""
    for i, r in enumerate(prepared.records):
        for ids, labels in _sequences(prepared.kind, r):
            labels = np.asarray(labels, dtype=np.int64)
            tokens = np.concatenate([np.asarray(ids, dtype=np.int64), labels[labels != data.IGNORE]])
            bad = tokens[(tokens < 0) | (tokens >= vocab)]
            if bad.size:
                raise InvalidArgumentError("%s: record %d has token id %d outside the model's vocabulary of %d "
                                           "(a tokenizer of another model?)" % (name, i, bad[0], vocab))


def _trainer_batch(kind, records):
    """The arguments of a Trainer call on these records."""
    if kind == "sft":
        return data.sft_batch(records)
    return ([data._trainer_pair(r) for r in records] if kind == "dpo" else
            [data._trainer_group(r) for r in records],)


def step_schedule(n, batch_size, grad_accum, shuffle, seed, total_steps):
    """The run's optimizer steps, each a list of micro-batches of record indices (the module docstring's order)."""
    epoch, steps = 0, 0
    while steps < total_steps:
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        micro = [order[b:b + batch_size].tolist() for b in range(0, n, batch_size)]
        for s in range(0, len(micro), grad_accum):
            if steps == total_steps:
                return
            yield micro[s:s + grad_accum]
            steps += 1
        epoch += 1


# ---- the strategy ----

def _plan_peak(spec, dtype, lora, strategy, seq_len, kind, a):
    """Planned peak bytes of one step (the plan tool, --json); lora: enable_lora's options or None."""
    args = [tool_path("plan"), "--json", "--model=" + spec, "--dtype=" + dtype, "--strategy=" + strategy,
            "--objective=" + kind, "--seq_len=%d" % seq_len, "--chunk=%d" % a.chunk, "--page_size=%d" % a.page_size,
            "--lm_chunk=%d" % a.lm_chunk]
    if lora:
        targets = lora["targets"] or ""
        args += ["--lora_rank=%d" % lora["rank"], "--lora_alpha=%r" % float(lora["alpha"]),
                 "--lora_dropout=%r" % float(lora["dropout"]),
                 "--lora_targets=" + (targets if isinstance(targets, str) else ",".join(targets))]
    run = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        raise InvalidArgumentError("strategy='auto': planning %s failed: %s" % (strategy, run.stderr.strip()))
    return int(json.loads(run.stdout)["device_total_peak"])


def _held_bytes(model):
    return sum(a.nbytes for a in model.parameters().values()) + sum(a.nbytes for a in model.gradients().values())


def _device_budget(model):
    """(bytes, where from) of the memory a run may take on the model's device, less MARGIN_BYTES."""
    if model.memory_limit:
        return model.memory_limit, "the model's memory limit"
    if model.device == "cpu":
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
        return available + _held_bytes(model) - MARGIN_BYTES, "the host's MemAvailable + the model's bytes - 256 MiB"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"] +
                             (["--id=" + visible] if visible else []),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True).stdout
        return int(out.split()[0]) * (1 << 20) - MARGIN_BYTES, "the GPU's memory (nvidia-smi) - 256 MiB"
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        raise InvalidArgumentError("strategy='auto' cannot read the GPU's memory (no nvidia-smi): give "
                                   "memory_budget=bytes") from None


def _mib(n):
    return ("%.1f MiB" if n >= 10 << 20 else "%.3f MiB") % (n / 1048576.0)


def choose_strategy(spec, dtype, lora, seq_len, kind, budget, source, a):
    """dict(strategy, planned_peak_bytes, memory_budget, budget_source, seq_len, rejected, reason): the first of
    AUTO_ORDER whose planned step fits the budget. ResourceExhaustedError when none does."""
    if spec is None:
        raise InvalidArgumentError("strategy='auto' plans the model's architecture, and this seqgrad.Model was not "
                                   "made by Model.load or Model.from_preset: give strategy=")
    rejected = []
    for strategy in AUTO_ORDER:
        peak = _plan_peak(spec, dtype, lora, strategy, seq_len, kind, a)
        if peak <= budget:
            slower = "; faster ones that do not fit: %s" % ", ".join(
                "%s plans %s" % (s, _mib(p)) for s, p in rejected) if rejected else ""
            reason = ("%s: the fastest exact strategy whose planned step peak (%s at %d tokens) fits the budget of "
                      "%s (%s)%s" % (strategy, _mib(peak), seq_len, _mib(budget), source, slower))
            return {"strategy": strategy, "planned_peak_bytes": peak, "memory_budget": budget,
                    "budget_source": source, "seq_len": seq_len, "rejected": rejected, "reason": reason}
        rejected.append((strategy, peak))
    raise ResourceExhaustedError(
        "strategy='auto': no exact strategy fits %s (%s) at %d tokens: %s planned; shorten max_length, lower chunk, "
        "train LoRA adapters or give a larger memory_budget" % (
            _mib(budget), source, seq_len, ", ".join("%s %s" % (s, _mib(p)) for s, p in rejected)))


def _strategy_choice(a, model, spec, lora, seq_len, kind):
    if a.strategy != "auto":
        return {"strategy": a.strategy, "planned_peak_bytes": None, "memory_budget": None, "budget_source": None,
                "seq_len": seq_len, "rejected": [], "reason": "%s: given (strategy=)" % a.strategy}
    budget, source = (a.memory_budget, "memory_budget") if a.memory_budget is not None else _device_budget(model)
    return choose_strategy(spec, model.dtype, lora or model.lora, seq_len, kind, budget, source, a)


# ---- checkpoints, the report ----

def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.write("\n")
    os.replace(tmp, path)


def _run_config(prepared, a, total_steps):
    """What a resumed run must share with the run that wrote the checkpoint, besides the Trainer's configuration."""
    digest = hashlib.sha256(json.dumps(prepared.records, sort_keys=True).encode()).hexdigest()
    return {"data_sha256": digest, "records": len(prepared.records),
            "per_device_train_batch_size": a.per_device_train_batch_size,
            "gradient_accumulation_steps": a.gradient_accumulation_steps, "shuffle": a.shuffle, "seed": a.seed,
            "total_steps": total_steps}


def _check_run_config(directory, config):
    path = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        differ = sorted(k for k in config if saved.get(k) != config[k])
        if differ:
            raise FailedPreconditionError("%s: the checkpoints were written by a run with other %s; use another "
                                          "output_dir" % (path, ", ".join(differ)))


def _prepare_output_dir(output_dir, resume_from_checkpoint, config, spec):
    """Creates output_dir; refuses to train over its checkpoints unless resuming, to resume another run's, or to
    write over the model directory."""
    if spec is not None and os.path.isdir(spec) and os.path.exists(output_dir) and os.path.samefile(spec, output_dir):
        raise InvalidArgumentError("output_dir %s is the model's directory: the trained model would overwrite it; "
                                   "choose another output_dir" % output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError("output_dir %s: cannot create it: %s" % (output_dir, e.strerror)) from None
    existing = sorted(e for e in os.listdir(output_dir) if e.startswith("checkpoint-"))
    if existing and not resume_from_checkpoint:
        raise FailedPreconditionError("output_dir %s already holds %s: pass resume_from_checkpoint=True to continue "
                                      "from its newest checkpoint, or choose another output_dir" %
                                      (output_dir, existing[-1]))
    _check_run_config(output_dir, config)
    _write_json(os.path.join(output_dir, CONFIG_FILE), config)


def _resume(trainer, a, config):
    """(first step, history, records read before it) after loading the checkpoint resume_from_checkpoint names
    (True: the newest in output_dir)."""
    if a.resume_from_checkpoint is True:
        state = trainer.resume(a.output_dir, missing_ok=True)
        if state is None:
            return 1, [], 0
        where = os.path.join(a.output_dir, "checkpoint-%d" % state["step"])
    else:
        where = os.fspath(a.resume_from_checkpoint)
        _check_run_config(os.path.dirname(os.path.abspath(where)), config)
        state = trainer.load_checkpoint(where)
    history = []
    if os.path.exists(os.path.join(where, HISTORY_FILE)):
        with open(os.path.join(where, HISTORY_FILE)) as f:
            history = json.load(f)
    return state["step"] + 1, history, state["data_position"]


def _summary(history, first):
    """The run's numbers; speed and peak memory of the steps this call trained."""
    done = [h for h in history if h["step"] >= first]
    seconds = sum(h["seconds"] for h in done)
    peak = max(done, key=lambda h: h["peak_bytes"], default={"peak_bytes": 0, "peak_bytes_by_category": {}})
    return {"loss_first": history[0]["loss"] if history else None,
            "loss_last": history[-1]["loss"] if history else None,
            "tokens_per_s": sum(h["tokens"] for h in done) / seconds if seconds else 0.0,
            "peak_bytes": peak["peak_bytes"], "peak_bytes_by_category": peak["peak_bytes_by_category"],
            "eval": next((h["eval"] for h in reversed(history) if "eval" in h), None)}


def _lora_json(model):
    lora = model.lora
    if lora is None:
        return None
    grads = model.gradients()
    return dict(lora, adapters=sum(name.endswith("lora_A.weight") for name in grads),
                trainable_params=int(sum(g.size for g in grads.values())))


def _report(model, spec, kind, choice, a, total, first, history, summary):
    """report.json: train --report's keys where they apply, and how the strategy was chosen."""
    return {"model": spec, "objective": kind, "strategy": choice["strategy"], "seq_len": choice["seq_len"],
            "chunk": a.chunk, "steps": total, "resumed_from_step": first - 1, "loss_first": summary["loss_first"],
            "loss_last": summary["loss_last"], "tokens_per_s": summary["tokens_per_s"],
            "peak_bytes": summary["peak_bytes"], "peak_bytes_by_category": summary["peak_bytes_by_category"],
            "lora": _lora_json(model), "losses": [h["loss"] for h in history], "metrics": history,
            "evals": [dict(step=h["step"], **h["eval"]) for h in history if "eval" in h], "plots": [],
            "strategy_choice": {k: choice[k] for k in ("strategy", "planned_peak_bytes", "memory_budget",
                                                        "budget_source", "rejected", "reason")}}


def _evaluate(trainer, prepared, batch_size):
    """Token-weighted loss, perplexity and accuracy over the SFT records."""
    loss = tokens = correct = 0.0
    for ids, labels, *docs in prepared.batches(batch_size):
        r = trainer.evaluate_detailed(ids, labels, doc_lengths=docs[0] if docs else None)
        loss += r["loss"] * r["tokens"]
        tokens += r["tokens"]
        correct += r["correct"]
    mean = loss / tokens if tokens else math.nan
    return {"loss": mean, "perplexity": math.exp(mean) if tokens else math.nan,
            "accuracy": correct / tokens if tokens else math.nan, "sequences": len(prepared), "tokens": int(tokens)}


class _Progress:
    """A tqdm bar when tqdm is importable, else a line per logging step; silent when off."""

    def __init__(self, enabled, total, first, logging_steps):
        self.enabled, self.total, self.logging_steps, self.bar = enabled, total, logging_steps, None
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, initial=first - 1, unit="step", desc="seqgrad.fit")
            except ImportError:
                pass

    def step(self, m):
        line = {"loss": "%.4f" % m["loss"], "tok/s": "%.0f" % m["tokens_per_s"], "peak": _mib(m["peak_bytes"])}
        if self.bar is not None:
            self.bar.set_postfix(line, refresh=False)
            self.bar.update(1)
        elif self.enabled and (m["step"] % self.logging_steps == 0 or m["step"] == self.total):
            self.note("step %d/%d  %s" % (m["step"], self.total, "  ".join("%s %s" % kv for kv in line.items())))

    def note(self, line):
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        elif self.enabled:
            print(line, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---- the run ----

def fit(model, train_dataset, *, eval_dataset=None, tokenizer=None, lora=None, output_dir=None, dtype=None,
        device=None, strategy="auto", memory_budget=None, chunk=512, page_size=256, lm_chunk=256, max_length=None,
        packing=False, overlong="refuse", dataset_format="auto", num_train_epochs=3, max_steps=None,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=None,
        lr_scheduler_type="linear", warmup_steps=0, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, shuffle=True, seed=42, eval_steps=None, save_steps=None,
        save_total_limit=None, resume_from_checkpoint=False, logging_steps=10, beta=None, epsilon=0.2,
        ref_model=None, progress=True, num_threads=0):
    """Trains `model` on `train_dataset`; returns a FitResult.

    model: a Hugging Face model directory, a preset name (made with dtype, device and seed) or a seqgrad.Model.
    train_dataset / eval_dataset: a `datasets` Dataset, a list of dicts, a JSONL path or a saved-dataset directory
    in TRL's formats (seqgrad.data), or tokenized records; eval_dataset is SFT data, evaluated every eval_steps
    steps and after the last. tokenizer: a transformers tokenizer or its directory (default: the model directory's).
    max_length: tokens per sequence (records longer are refused, or cut with overlong="truncate"); packing: SFT
    records packed into sequences of max_length, each record training as if alone (seqgrad.data, doc_lengths).
    lora: a peft.LoraConfig or a dict of its fields.
    strategy: "auto" (the module docstring) or a Trainer strategy; memory_budget: bytes for "auto".
    output_dir: checkpoint-<step>/ every save_steps steps and after the last (save_total_limit kept), the trained
    model (or LoRA adapter), the tokenizer and report.json; resume_from_checkpoint: True (the newest there) or a
    checkpoint directory. beta: DPO's beta (TRL's 0.1) or GRPO's KL coefficient (TRL's 0.0); epsilon: GRPO's clip.
    DPO and GRPO with a KL term need a frozen reference: ref_model (a Model or what `model` takes), else with LoRA
    the base weights (adapters off), else a copy of the model's weights. learning_rate None: TRL's (2e-5 SFT,
    1e-6 DPO and GRPO). progress: a tqdm bar (or a line every logging_steps steps) and notes on stderr.
    The given model is changed only once everything is checked and the strategy chosen."""
    a = _checked_arguments(types.SimpleNamespace(**locals()))
    model, spec = _open_model(model, dtype, device, seed, frozen_base=bool(a.lora_options))
    if a.lora_options and model.lora is not None:
        raise InvalidArgumentError("lora: the model already has LoRA adapters (rank %d)" % model.lora["rank"])
    tokenizers = _Tokenizers(tokenizer, spec)
    train, evals = _datasets(a, tokenizers, model.vocab_size)
    total = _total_steps(len(train), a)
    longest = max(len(ids) for p in (train, evals) if p is not None for r in p.records
                  for ids, _ in _sequences(p.kind, r))
    choice = _strategy_choice(a, model, spec, a.lora_options, longest, train.kind)
    if a.lora_options:
        model.enable_lora(seed=seed, **a.lora_options)
    config = _run_config(train, a, total)
    with _trainer(model, choice["strategy"], train.kind, total, a) as trainer:
        if output_dir is not None:
            _prepare_output_dir(output_dir, resume_from_checkpoint, config, spec)
        _set_reference(trainer, train, model, spec, a)
        first, history, position = _resume(trainer, a, config) if resume_from_checkpoint else (1, [], 0)
        bar = _Progress(progress, total, first, logging_steps)
        bar.note("seqgrad.fit: strategy %s" % choice["reason"])
        try:
            written = _train(trainer, train, evals, config, first, position, history, bar, a)
        finally:
            bar.close()
    summary = _summary(history, first)
    paths = {}
    if output_dir is not None:
        paths = _save_outputs(model, spec, tokenizers.loaded, output_dir,
                              _report(model, spec, train.kind, choice, a, total, first, history, summary), written)
    return FitResult(metrics=dict(summary, steps=total), history=history, strategy=choice["strategy"],
                     strategy_reason=choice["reason"], planned_peak_bytes=choice["planned_peak_bytes"],
                     memory_budget=choice["memory_budget"], rejected=choice["rejected"], model=model, paths=paths,
                     objective=train.kind)


def _total_steps(records, a):
    """max_steps, else num_train_epochs epochs of optimizer steps (an epoch's last step may be short)."""
    per_epoch = math.ceil(math.ceil(records / a.per_device_train_batch_size) / a.gradient_accumulation_steps)
    total = a.max_steps or a.num_train_epochs * per_epoch
    if a.schedule != "constant" and total <= a.warmup_steps:
        raise InvalidArgumentError("warmup_steps=%d: lr_scheduler_type=%r decays after the warmup, and the run has "
                                   "%d steps" % (a.warmup_steps, a.lr_scheduler_type, total))
    return total


def _checked_arguments(a):
    """fit()'s plain arguments checked by name before anything is loaded; adds schedule and lora_options."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "logging_steps"):
        _integer(getattr(a, name), name, 1)
    for name in ("max_steps", "eval_steps", "save_steps", "save_total_limit", "memory_budget"):
        _integer(getattr(a, name), name, 1, none_ok=True)
    _integer(a.warmup_steps, "warmup_steps", 0)
    _integer(a.max_length, "max_length", 2, none_ok=True)
    if a.packing and a.max_length is None:
        raise InvalidArgumentError("packing needs max_length (the length of the packed sequences)")
    if a.lr_scheduler_type not in SCHEDULES:
        raise InvalidArgumentError("lr_scheduler_type must be one of %s, got %r" % (", ".join(SCHEDULES),
                                                                                   a.lr_scheduler_type))
    a.schedule = SCHEDULES[a.lr_scheduler_type]
    if a.strategy != "auto" and a.strategy not in STRATEGIES:
        raise InvalidArgumentError("strategy must be 'auto' or one of %s, got %r" % (", ".join(STRATEGIES),
                                                                                    a.strategy))
    if a.memory_budget is not None and a.strategy != "auto":
        raise InvalidArgumentError("memory_budget is what strategy='auto' plans for; strategy=%r was given" %
                                   a.strategy)
    if a.learning_rate is not None:
        _number(a.learning_rate, "learning_rate", 0, low_open=True)
    if a.beta is not None:
        _number(a.beta, "beta", 0)
    for name, low, high in (("min_lr", 0, math.inf), ("weight_decay", 0, math.inf), ("adam_beta1", 0, 1),
                            ("adam_beta2", 0, 1), ("max_grad_norm", 0, math.inf), ("epsilon", 0, math.inf)):
        _number(getattr(a, name), name, low, high)
    _number(a.adam_epsilon, "adam_epsilon", 0, low_open=True)
    for name in ("shuffle", "packing", "progress"):
        if not isinstance(getattr(a, name), bool):
            raise InvalidArgumentError("%s must be True or False, got %r" % (name, getattr(a, name)))
    _check_output_arguments(a)
    a.lora_options = None if a.lora is None else lora_options(a.lora)
    return a


def _check_output_arguments(a):
    if not isinstance(a.resume_from_checkpoint, (bool, str, os.PathLike)):
        raise InvalidArgumentError("resume_from_checkpoint must be True, False or a checkpoint directory, got %r" %
                                   (a.resume_from_checkpoint,))
    if a.output_dir is not None and not isinstance(a.output_dir, (str, os.PathLike)):
        raise InvalidArgumentError("output_dir must be a directory path or None, got %r" % (a.output_dir,))
    if a.resume_from_checkpoint is True and a.output_dir is None:
        raise InvalidArgumentError("resume_from_checkpoint=True needs output_dir (where the checkpoints are)")
    if a.save_steps is not None and a.output_dir is None:
        raise InvalidArgumentError("save_steps needs output_dir (where checkpoints are written)")
    if a.eval_steps is not None and a.eval_dataset is None:
        raise InvalidArgumentError("eval_steps needs eval_dataset")


class _Tokenizers:
    """The tokenizer, loaded when text first needs it: tokenizer= (an object or a directory), else the model's."""

    def __init__(self, given, spec):
        self.given, self.spec, self.loaded = given, spec, None

    def __call__(self):
        if self.loaded is None:
            tok = self.given
            if tok is None:
                if self.spec is None or not os.path.isdir(self.spec):
                    raise InvalidArgumentError("tokenizer: the data is text, and the model is not a Hugging Face "
                                               "directory to load one from: pass tokenizer=")
                tok = self.spec
            self.loaded = data.load_tokenizer(os.fspath(tok)) if isinstance(tok, (str, os.PathLike)) else tok
        return self.loaded


def _datasets(a, tokenizers, vocab):
    """(train, eval or None) as seqgrad.data.Prepared, every token inside the vocabulary."""
    options = (a.dataset_format, a.max_length, a.packing, a.overlong)
    train = _prepare(a.train_dataset, "train_dataset", tokenizers, *options)
    _check_vocab(train, vocab, "train_dataset")
    if a.eval_dataset is None:
        return train, None
    evals = _prepare(a.eval_dataset, "eval_dataset", tokenizers, *options)
    if train.kind != "sft" or evals.kind != "sft":
        raise InvalidArgumentError("eval_dataset: evaluation is for SFT data (token loss), not %s" %
                                   (evals.kind if train.kind == "sft" else train.kind))
    _check_vocab(evals, vocab, "eval_dataset")
    return train, evals


def _trainer(model, strategy, kind, total, a):
    lr = DEFAULT_LR[kind] if a.learning_rate is None else a.learning_rate
    beta = (0.1 if kind == "dpo" else 0.0) if a.beta is None else a.beta
    objective = {"dpo": {"dpo_beta": beta}, "grpo": {"grpo_kl_beta": beta, "grpo_clip_eps": a.epsilon}}.get(kind, {})
    return Trainer(model, strategy=strategy, chunk=a.chunk, page_size=a.page_size, lm_chunk=a.lm_chunk, lr=lr,
                   betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, weight_decay=a.weight_decay,
                   clip_grad_norm=a.max_grad_norm, seed=a.seed, objective=kind, lr_schedule=a.schedule,
                   warmup_steps=a.warmup_steps, min_lr=a.min_lr, total_steps=total,
                   grad_accum=a.gradient_accumulation_steps, num_threads=a.num_threads, **objective)


def _set_reference(trainer, prepared, model, spec, a):
    """DPO, and GRPO with a KL term: the frozen reference the records' own log-probs do not replace."""
    kl_beta = 0.0 if a.beta is None else a.beta
    needed = (prepared.kind == "dpo" and any("ref_chosen_logp" not in r for r in prepared.records) or
              prepared.kind == "grpo" and kl_beta > 0)
    if not needed and a.ref_model is None:
        return
    if a.ref_model is not None:
        trainer.set_reference(_open_model(a.ref_model, model.dtype, model.device, a.seed, frozen_base=True)[0])
    elif model.lora is not None:
        trainer.set_reference_base_model()
    else:
        trainer.set_reference(_frozen_copy(model, spec))


def _frozen_copy(model, spec):
    if spec is None:
        raise InvalidArgumentError("ref_model: DPO/GRPO needs a frozen reference, and this seqgrad.Model cannot be "
                                   "copied (not made by Model.load or from_preset): pass ref_model=")
    copy = (Model.load(spec, model.dtype, model.device, frozen_base=True) if os.path.isdir(spec) else
            Model.from_preset(spec, model.dtype, 0, model.device, frozen_base=True))
    for name, value in model.parameters().items():
        copy.set_parameter(name, value)
    return copy


def _train(trainer, train, evals, config, first, resumed_position, history, bar, a):
    """The steps from `first` on; appends each step's metrics to history. Returns the checkpoints written."""
    step_call, accumulate_call = (getattr(trainer, name) for name in _STEP_CALLS[train.kind])
    total, written, position = config["total_steps"], [], 0
    schedule = step_schedule(len(train), a.per_device_train_batch_size, a.gradient_accumulation_steps, a.shuffle,
                             a.seed, total)
    for step, micro_batches in enumerate(schedule, 1):
        if step == first and position != resumed_position:
            raise FailedPreconditionError("the checkpoint of step %d had read %d records, this run's step %d starts "
                                          "at record %d: other data or batch options" % (first - 1, resumed_position,
                                                                                         first, position))
        position += sum(map(len, micro_batches))
        if step < first:
            continue
        batches = [[train.records[i] for i in mb] for mb in micro_batches]
        t0 = time.perf_counter()
        if len(batches) == 1:
            m = step_call(*_trainer_batch(train.kind, batches[0]))
        else:
            for b in batches:
                accumulate_call(*_trainer_batch(train.kind, b))
            m = trainer.optimizer_step()
        seconds = time.perf_counter() - t0
        tokens = sum(len(ids) for b in batches for r in b for ids, _ in _sequences(train.kind, r))
        record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": tokens,
                  "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                  "peak_bytes": m["peak_bytes"], "peak_bytes_by_category": m["peak_bytes_by_category"]}
        history.append(record)
        bar.step(record)
        if evals is not None and ((a.eval_steps and step % a.eval_steps == 0) or step == total):
            record["eval"] = _evaluate(trainer, evals, a.per_device_train_batch_size)
            bar.note("step %d: eval loss %.4f, accuracy %.4f" % (step, record["eval"]["loss"],
                                                                 record["eval"]["accuracy"]))
        if a.output_dir is not None and ((a.save_steps and step % a.save_steps == 0) or step == total):
            path = trainer.save_checkpoint(a.output_dir, data_position=position, keep=a.save_total_limit or 0)
            _write_json(os.path.join(path, HISTORY_FILE), history)
            written.append(path)
            bar.note("saved %s" % path)
    return written


def _save_outputs(model, spec, tokenizer, output_dir, report, checkpoints):
    """The trained model (or adapter), the tokenizer and report.json in output_dir; their paths."""
    output_dir = os.fspath(output_dir)
    if model.lora is not None:
        model.save_lora_adapter(output_dir, spec if spec and os.path.isdir(spec) else None)
    else:
        model.save(output_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    report_path = os.path.join(output_dir, "report.json")
    _write_json(report_path, report)
    return {"output_dir": output_dir, "report": report_path, "checkpoints": checkpoints,
            "adapter" if model.lora is not None else "model": output_dir}
