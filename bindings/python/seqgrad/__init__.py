"""seqgrad: train Llama / Qwen transformers (Qwen3.5 and MoE too) and Mamba-1 SSMs on long sequences, exactly.

    import seqgrad
    with seqgrad.Model.from_preset("tiny") as model, seqgrad.Trainer(model, strategy="seco", chunk=64) as tr:
        m = tr.step([[1, 5, 7, 9], [3, 4, 5]])       # next-token labels when labels is None
        lp = tr.score([[1, 5, 7, 9]])                 # per-token log p(token | prefix), NaN at position 0
        print(m["loss"], m["peak_bytes"])
        w = model.parameters()["model.norm.weight"]  # numpy view of the engine's memory (no copy)

Preference and RL objectives (a Trainer's `objective`, with an optional frozen `reference` model):

    with seqgrad.Trainer(policy, objective="dpo", dpo_beta=0.1, reference=ref_model) as tr:
        tr.step_dpo([{"chosen": (ids, labels), "rejected": (ids, labels)}])   # labels: -100 outside the response
    with seqgrad.Trainer(policy, objective="grpo", grpo_kl_beta=0.0) as tr:
        tr.step_grpo([[{"ids": ids, "labels": labels, "advantage": 1.0}, ...], ...])   # groups of completions

LoRA, a learning-rate schedule, gradient accumulation, checkpoints and held-out evaluation (since 0.5):

    model.enable_lora(rank=8, targets="q_proj,v_proj")     # base frozen; model.save() writes the merged model
    with seqgrad.Trainer(model, lr=2e-4, lr_schedule="cosine", warmup_steps=10, total_steps=1000) as tr:
        state = tr.resume("run", missing_ok=True)           # None, or {"step", "data_position"}
        tr.accumulate_gradients(micro_batch); tr.accumulate_gradients(micro_batch2); tr.optimizer_step()
        tr.save_checkpoint("run", data_position=records_read, keep=3)
        tr.evaluate_detailed(ids, labels, distances=d)     # loss, perplexity, accuracy, by_distance buckets
    model.save_lora_adapter("adapter")                     # PEFT files

A whole run in one call, TRL-style (seqgrad/fit.py; strategy="auto" picks the fastest that fits the memory):

    result = seqgrad.fit("hf_model_dir", "chats.jsonl", lora={"r": 16}, max_length=32768, output_dir="run")

Labels follow Hugging Face's convention everywhere: aligned with ids (labels[t] is the token at position t, -100 =
ignored), shifted by the engine (position t learns to predict labels[t + 1]), None = next-token labels (labels = ids).

Everything goes through the stable C API (libseqgrad.so); errors raise seqgrad.SeqgradError subclasses carrying
`.code`. A progress callback that raises during a call that then completes makes the call raise
seqgrad.StepAppliedError (the update is in place: do not retry the batch). Training steps release the GIL; Trainer.cancel() may be called from any thread. OpenMP threads wait
passively (OMP_WAIT_POLICY=PASSIVE) unless the environment says otherwise, so idle threads do not spin on a machine
shared with other processes; Trainer(num_threads=n) sets the thread count of a trainer's calls.
"""
import os

# libgomp reads the wait policy once, when it is loaded (below, with _native; the wheel bundles its own copy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

from . import _native
from ._errors import (BusyError, CancelledError, ClosedError, DataLossError, FailedPreconditionError, InternalError,
                      InvalidArgumentError, NotFoundError, OutOfRangeError, PermissionDeniedError,
                      ResourceExhaustedError, SeqgradError, StepAppliedError, UnimplementedError)

__all__ = [
    "Model", "Trainer", "SeqgradError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError", "CancelledError",
    "BusyError", "ResourceExhaustedError", "FailedPreconditionError", "InternalError", "ClosedError", "DataLossError",
    "PermissionDeniedError", "UnimplementedError", "StepAppliedError", "version", "MEMORY_CATEGORIES", "PRESETS", "LORA_TARGETS",
    "fit", "FitResult",
]

__version__ = "%d.%d.%d" % (_native.VERSION_MAJOR, _native.VERSION_MINOR, _native.VERSION_PATCH)
MEMORY_CATEGORIES = tuple(_native.memory_category_names())
PRESETS = tuple(_native.preset_names())
_NO_ADJOINT_WINDOW = 2**63 - 1  # the C API's INT64_MAX: adjoint_window=None
# The module names LoRA can target, per model family (Model.family).
LORA_TARGETS = {
    "transformer": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "ssm": ("in_proj", "x_proj"),
}


def version():
    """Version of the loaded libseqgrad.so."""
    return _native.version()


class Model:
    """A model (native handle). Use Model.from_preset / Model.load; a context manager.

    close() drops this object's reference to the native model; numpy views from parameters()/gradients() and
    trainers keep the memory alive until they are gone, so views never dangle.
    """

    def __init__(self, native, spec=None):
        self._native = native
        self._spec = spec  # the preset name or directory it was made from: what seqgrad.fit plans with

    @classmethod
    def from_preset(cls, name="tiny", dtype="f32", seed=0, device="cpu", frozen_base=False, offload_experts=False):
        """A randomly initialised preset. device: "cpu" or "cuda" (the model's tensors and steps on the GPU;
        without a usable GPU FailedPreconditionError "device 'cuda' cannot run: ..."). frozen_base: no parameter
        gets a gradient, none is allocated (for LoRA, enabled next, or a model that only scores). offload_experts
        (with frozen_base, on a mixture of experts): the expert weights made in host memory, for a Trainer with
        offload_experts=True, so that they never all sit on the device."""
        return cls(_native.Model.create_preset(name, dtype, seed, device, bool(frozen_base), bool(offload_experts)),
                   name)

    @classmethod
    def load(cls, hf_dir, dtype="f32", device="cpu", frozen_base=False, offload_experts=False):
        """A Hugging Face directory; dtype "f32", "f64" or "bf16", device, frozen_base and offload_experts as in
        from_preset."""
        return cls(_native.Model.load(os.fspath(hf_dir), dtype, device, bool(frozen_base), bool(offload_experts)),
                   os.path.abspath(hf_dir))

    def _get(self):
        if self._native is None:
            raise ClosedError("Model is closed")
        return self._native

    def save(self, directory, dtype=None):
        """config.json + model.safetensors that Hugging Face transformers loads; with LoRA the merged weights
        W + (alpha / rank) B A (a plain model without adapters). dtype: None saves the weights as the model stores
        them (a "bf16" model: bf16 matrices, f32 norms and biases, labelled bfloat16), "f32" every tensor in f32,
        "bf16" only for a bf16 model."""
        if dtype is not None and not isinstance(dtype, str):
            raise InvalidArgumentError("dtype must be None, 'f32' or 'bf16', got %r" % (dtype,))
        self._get().save(os.fspath(directory), dtype or "")

    @property
    def vocab_size(self):
        return self._get().vocab_size

    @property
    def num_layers(self):
        return self._get().num_layers

    @property
    def hidden_size(self):
        return self._get().hidden_size

    @property
    def dtype(self):
        return self._get().dtype

    @property
    def family(self):
        return self._get().family

    @property
    def device(self):
        """"cpu" or "cuda"."""
        return self._get().device

    def set_memory_limit(self, nbytes):
        """Caps the engine memory of this model's tensors (weights included) at nbytes; 0 removes the cap. A step
        that would need more raises ResourceExhaustedError and leaves the model usable."""
        self._get().set_memory_limit(int(nbytes))

    @property
    def memory_limit(self):
        """The memory limit in bytes (0 = none)."""
        return self._get().memory_limit

    def __len__(self):
        return self._get().num_params

    def enable_lora(self, rank=8, alpha=None, dropout=0.0, targets=None, seed=0):
        """Adds LoRA adapters (Hugging Face PEFT's convention) and freezes every base parameter.

        rank: r >= 1; alpha: lora_alpha, the adapters' output is scaled by alpha / rank (None = 2 * rank);
        dropout: on the adapters' input in [0, 1), training passes only; targets: module names as a list or a
        comma-separated string, "all", or None for the family's default (q_proj,v_proj; Mamba in_proj,x_proj),
        see LORA_TARGETS; seed: initialisation of the A matrices. Once per model, before any Trainer of it exists
        (FailedPreconditionError otherwise, or while numpy views of its gradients are alive: the base gradients are
        released). Adapters appear in parameters()/gradients() as "<module>.lora_A.weight" / ".lora_B.weight"."""
        if isinstance(targets, (list, tuple)):
            if not all(isinstance(t, str) for t in targets):
                raise InvalidArgumentError("targets must be module names (str), got %r" % (targets,))
            targets = ",".join(targets)
        elif targets is not None and not isinstance(targets, str):
            raise InvalidArgumentError("targets must be None, a comma-separated str or a list of str, got %r" %
                                       (targets,))
        if alpha is None:
            alpha = 0.0  # the C API's 2 * rank
        elif _float(alpha, "alpha", False) == 0:
            raise InvalidArgumentError("alpha is 0; need > 0 (None = 2 * rank)")
        self._get().enable_lora(int(rank), float(alpha), float(dropout), targets, int(seed))

    @property
    def lora(self):
        """None without LoRA, else dict(rank, alpha, dropout, targets (list), seed)."""
        d = self._get().lora()
        if d is not None:
            d["targets"] = d["targets"].split(",")
        return d

    def save_lora_adapter(self, directory, base_model_name_or_path=None):
        """Writes the adapters as PEFT files (adapter_config.json + adapter_model.safetensors) that
        peft.PeftModel.from_pretrained(base, directory) loads. save() writes the merged model instead."""
        self._get().save_lora_adapter(os.fspath(directory),
                                      None if base_model_name_or_path is None else str(base_model_name_or_path))

    def load_lora_adapter(self, directory):
        """Loads a PEFT adapter directory; without LoRA it is enabled with the adapter's options first. An adapter
        of another base model raises InvalidArgumentError naming the tensor and both shapes."""
        self._get().load_lora_adapter(os.fspath(directory))

    def _params(self):
        n = self._get()
        return [n.param(i) for i in range(n.num_params)]

    def parameters(self):
        """dict name -> C-contiguous numpy array sharing the engine's memory (writes change the model). NumPy's
        __dlpack__ hands them to torch/JAX/CuPy without a copy: torch.from_dlpack(array). A dtype="bf16" model's
        weight matrices are uint16 arrays of the raw bf16 bits (widen: (a.astype(np.uint32) << 16).view(np.float32)).

        On a "cuda" model the arrays are copies (GPU memory is not host memory): writes to them do not reach the
        model; use set_parameter."""
        return {name: value for name, value, _ in self._params()}

    def gradients(self):
        """dict name -> numpy array view of each gradient (frozen parameters are left out); copies on "cuda"."""
        return {name: grad for name, _, grad in self._params() if grad is not None}

    def set_parameter(self, name, values):
        """Writes a parameter's values from an array of its shape (converted to its dtype), on any device."""
        n = self._get()
        for i in range(n.num_params):
            pname, dtype, shape = n.param_meta(i)
            if pname == name:
                array = np.asarray(values, dtype=dtype)
                if array.shape != tuple(shape):
                    raise InvalidArgumentError("set_parameter: %r has shape %s, got %s" %
                                               (name, tuple(shape), array.shape))
                n.write_param(i, np.ascontiguousarray(array).reshape(-1))
                return
        raise InvalidArgumentError("set_parameter: no parameter named %r" % (name,))

    def close(self):
        self._native = None

    @property
    def closed(self):
        return self._native is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Modes of the native dpo/grpo calls.
_GRADIENTS, _STEP, _ACCUMULATE = 0, 1, 3


def _as_tokens(seq, what):
    a = np.asarray(seq)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise InvalidArgumentError("%s must be a 1-D sequence of token ids, got shape %s" % (what, a.shape))
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError("%s must hold integers, got dtype %s" % (what, a.dtype))
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise InvalidArgumentError("%s has values outside int32" % what)
    return np.require(a, np.int32, "CA")  # what the native layer reads: C-contiguous, aligned (a copy if not)


def _flatten(batch, what):
    if isinstance(batch, np.ndarray):
        if batch.ndim == 1:
            batch = [batch]
        elif batch.ndim != 2:
            raise InvalidArgumentError("%s must be a list of sequences or a 2-D array, got %d-D" % (what, batch.ndim))
    if isinstance(batch, (str, bytes)) or not hasattr(batch, "__len__"):
        raise InvalidArgumentError("%s must be a list of sequences or a 2-D array" % what)
    seqs = [_as_tokens(s, "%s[%d]" % (what, i)) for i, s in enumerate(batch)]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int32), lengths


def _documents(doc_lengths, num_sequences):
    """(num_documents, flat doc_lengths) as int64 arrays for the C ABI, or (None, None); the values are checked there,
    by name (doc_lengths[s][d])."""
    if doc_lengths is None:
        return None, None
    if isinstance(doc_lengths, (str, bytes, dict)) or not hasattr(doc_lengths, "__len__") or \
            len(doc_lengths) != num_sequences:
        raise InvalidArgumentError("doc_lengths must hold one entry per sequence of ids (%d): None or the lengths of "
                                   "the documents packed into it" % num_sequences)
    parts = []
    for i, d in enumerate(doc_lengths):
        a = np.zeros(0, dtype=np.int64) if d is None else np.asarray(d)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidArgumentError("doc_lengths[%d] must be None or a list of integer document lengths" % i)
        parts.append(a.astype(np.int64))
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    return counts, np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0), dtype=np.int64)


def _float(value, what, none_ok):
    if value is None and none_ok:
        return float("nan")
    if not isinstance(value, (str, bytes)) and np.ndim(value) == 0:  # no parsing of text, no 1-element arrays
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise InvalidArgumentError("%s must be a number%s, got %r" % (what, " or None" if none_ok else "", value))


def _logprobs(value, what, length):
    """None, or a float64 array of `length` entries (one per position of the sequence)."""
    if value is None:
        return None
    try:
        a = np.asarray(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError("%s must be a sequence of floats (NaN where the label is ignored)" % what) from None
    if a.dtype.kind not in "fiu":  # never None -> NaN, text -> float or complex -> real part
        raise InvalidArgumentError("%s must hold real numbers (NaN where the label is ignored), got dtype %s" %
                                   (what, a.dtype))
    a = np.require(a, np.float64, "CA")
    if a.ndim != 1:
        raise InvalidArgumentError("%s must be 1-D (one entry per position), got shape %s" % (what, a.shape))
    if a.size != length:
        raise InvalidArgumentError("%s has %d entries but the sequence has %d tokens (one per position, aligned with "
                                   "labels)" % (what, a.size, length))
    return a


def _thread_count(n):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= np.iinfo(np.int32).max:
        raise InvalidArgumentError("num_threads must be an integer >= 0 (0 = the default), got %r" % (n,))
    return int(n)


def _check_callback(fn, what):
    if fn is not None and not callable(fn):
        raise InvalidArgumentError("%s must be a callable taking a dict (step, loss, tokens, grad_norm, phase) or None, "
                                   "got %r" % (what, fn))


def _tp_size(n):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= np.iinfo(np.int32).max:
        raise InvalidArgumentError("tp must be an integer >= 1 (1 = no tensor parallelism), got %r" % (n,))
    return int(n)


def _fields(item, what, required, optional):
    if not isinstance(item, dict):
        raise InvalidArgumentError("%s must be a dict with keys %s" % (what, ", ".join(required + optional)))
    missing = [k for k in required if k not in item]
    unknown = sorted(set(item) - set(required) - set(optional))
    if missing or unknown:
        raise InvalidArgumentError("%s: %s" % (what, "; ".join(
            (["missing key(s) %s" % ", ".join(missing)] if missing else []) +
            (["unknown key(s) %s (known: %s)" % (", ".join(map(str, unknown)), ", ".join(required + optional))]
             if unknown else []))))
    return item


def _ids_labels(ids, labels, what):
    """(int32 ids, int32 labels or None) of one sequence."""
    a = _as_tokens(ids, what + " ids")
    if labels is None:
        return a, None
    b = _as_tokens(labels, what + " labels")
    if b.size != a.size:
        raise InvalidArgumentError("%s: labels has %d tokens but ids has %d" % (what, b.size, a.size))
    return a, b


def _pair_sequence(value, what):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgumentError("%s must be a pair (ids, labels); labels may be None (next-token labels)" % what)
    return _ids_labels(value[0], value[1], what)


class Trainer:
    """Computes gradients with a strategy ("full", "ckpt", "seco", "spaco", "streambp", "adjoint") for an objective
    ("sft", "dpo", "grpo") and applies AdamW. A context manager.

    spaco backpropagates each of a sequence's k chunks with probability spaco_budget / k (1 <= spaco_budget <= k)
    and compensates the kept ones so the gradient is unbiased; spaco_cap caps the compensation of relayed state
    gradients (0 = no cap, else >= 1) and seed seeds the sampling. streambp backpropagates each layer in partitions
    of `chunk` tokens. Metrics count "chunks" and "chunks_backpropagated".

    adjoint (state-space models only; InvalidArgumentError on a transformer) is adjoint sharding: each layer's scan
    gradient as independent vector-Jacobian products over the pairs (t, i), i <= t, in chunks of `chunk` tokens.
    adjoint_form: "pairs" (the default), "scan" (one reverse scan per chunk, exact, no window) or "paper" (the paper's
    multi-layer formula, exact for one layer only). adjoint_window: None (no truncation) or a number of tokens > 0
    that keeps only the pairs with t - i < adjoint_window. Metrics count "adjoint_pairs": the (t, i) products per
    channel, summed over layers and sequences (w*T - w*(w-1)/2 per layer for a sequence of T tokens and window w).

    objective "sft" trains with step()/compute_gradients(), "dpo" with step_dpo()/compute_gradients_dpo() (dpo_beta),
    "grpo" with step_grpo()/compute_gradients_grpo() (grpo_clip_eps, grpo_kl_beta; grpo_kl_bias_correction: the KL
    term times the importance ratio, TRL's use_bias_correction_kl and its default; False: plain k3); the other calls raise
    FailedPreconditionError. `reference` (a Model, or None) is the frozen reference of dpo/grpo, used where the
    batch gives no reference log-probs; the trainer keeps it alive (set_reference changes it). evaluate() gives the
    token loss of a batch without gradients, for any objective.

    Learning-rate schedule (optimizer step s, W = warmup_steps, S = total_steps): lr * s / W while s <= W, then
    lr_schedule "constant" (lr), "cosine" or "linear" decay from lr to min_lr at step S; metrics report "lr".
    Gradient accumulation: accumulate_gradients() (and _dpo/_grpo) add one micro-batch at a time, optimizer_step()
    then steps as on one batch of all of them (metrics "micro_batches"); grad_accum is how many the caller feeds per
    step, recorded in checkpoints. save_checkpoint()/load_checkpoint()/resume() continue a run exactly (same losses
    on CPU); evaluate_detailed() gives loss, perplexity, accuracy and retrieval accuracy by key-query distance.

    seco on transformers (SeCOv2): sparse_pages=k makes each query chunk attend, per layer, to page 0, its own
    pages and the one before, and the k other earlier pages of highest score (0 = dense); offload=True keeps every
    layer's KV and KV-gradient pages in host memory and a few layers on the device (the same gradients).
    offload_experts=True (mixtures of experts under LoRA) keeps the frozen expert weights in host memory and
    streams them through the device two MoE layers' worth at a time (the same gradients).

    num_threads: OpenMP/OpenBLAS threads of this trainer's calls (0 = OMP_NUM_THREADS, else one per core).

    tp: tensor parallelism (transformers; CPU or "cuda" models). With tp=N > 1 in a program launched as `mpirun -np N python ...`,
    creating the trainer joins the MPI job and keeps this rank's blocks of the model (1/N of the heads, KV cache,
    SwiGLU width and vocabulary); every rank must create the same model and trainer and make the same calls with the
    same batches. The Model keeps showing the whole model (its parameters and gradients are gathered after each
    call), and Model.save(), save_checkpoint(), load_checkpoint() and resume() are then collective: every rank
    calls them, rank 0 alone writes the whole model (what one process writes). Metrics' memory is this rank's;
    "tp" and "tp_bytes_reduced" (bytes this rank sent to its group in the call) report the split. Bad values (tp not
    dividing the heads or vocabulary, a job that is not tp ranks, ranks disagreeing) raise on every rank with the
    numbers. docs/distributed.md, "Tensor parallel".

    Not for concurrent use: a step while another thread's step runs raises BusyError. cancel() is thread-safe and
    makes the running (or next) step raise CancelledError. A step past the model's memory limit
    (Model.set_memory_limit) raises ResourceExhaustedError.
    """

    def __init__(self, model, strategy="full", chunk=512, page_size=256, lm_chunk=256, lr=1e-3, betas=(0.9, 0.95),
                 eps=1e-8, weight_decay=0.0, clip_grad_norm=1.0, progress=None, *, spaco_budget=8, spaco_cap=2.0,
                 seed=0, objective="sft", dpo_beta=0.1, grpo_clip_eps=0.2, grpo_kl_beta=0.04, reference=None,
                 grpo_kl_bias_correction=True,
                 adjoint_form="pairs", adjoint_window=None, lr_schedule="constant", warmup_steps=0, min_lr=0.0,
                 total_steps=0, grad_accum=1, sparse_pages=0, offload=False, num_threads=0, tp=1,
                 offload_experts=False):
        if not isinstance(model, Model):
            raise InvalidArgumentError("model must be a seqgrad.Model")
        _check_callback(progress, "progress")
        if adjoint_window is None:
            adjoint_window = _NO_ADJOINT_WINDOW
        elif isinstance(adjoint_window, bool) or not isinstance(adjoint_window, (int, np.integer)):
            raise InvalidArgumentError("adjoint_window must be None (no window) or a positive number of tokens, got %r"
                                       % (adjoint_window,))
        elif not -_NO_ADJOINT_WINDOW <= adjoint_window <= _NO_ADJOINT_WINDOW:  # in int64; the C API checks > 0
            raise InvalidArgumentError("adjoint_window is %d; need a positive number of tokens up to 2**63 - 1 (None = "
                                       "no window)" % adjoint_window)
        self.model = model
        self.reference = None
        # The keyword arguments are sg_trainer_options' fields by name (_native.TRAINER_OPTIONS), but for betas.
        options = dict(locals(), beta1=betas[0], beta2=betas[1], objective="sft" if objective is None else objective,
                       grpo_kl_bias_correction=bool(grpo_kl_bias_correction), adjoint_window=int(adjoint_window),
                       adjoint_form="pairs" if adjoint_form is None else adjoint_form,
                       lr_schedule="constant" if lr_schedule is None else lr_schedule, offload=bool(offload),
                       offload_experts=bool(offload_experts), num_threads=_thread_count(num_threads), tp=_tp_size(tp))
        self._native = _native.Trainer(model._get(), {name: options[name] for name in _native.TRAINER_OPTIONS})
        if reference is not None:
            self.set_reference(reference)
        if progress is not None:
            self.set_progress_callback(progress)

    def _get(self):
        if self._native is None or self._native.closed:
            raise ClosedError("Trainer is closed")
        return self._native

    def set_progress_callback(self, fn):
        """fn(dict(step, loss, tokens, grad_norm, phase)) is called on the stepping thread after each phase; None
        removes it. What fn raises ends the call's callbacks; when the call then completes (its step or gradients are
        in place) the call raises StepAppliedError (its __cause__ is fn's exception, .step the step count): do not
        retry it. When the call fails, fn's exception is raised as it is."""
        _check_callback(fn, "fn")
        self._get().set_callback(fn)

    def _batch(self, ids, labels, doc_lengths):
        flat, lengths = _flatten(ids, "ids")
        flat_labels = None
        if labels is not None:
            flat_labels, label_lengths = _flatten(labels, "labels")
            if not np.array_equal(lengths, label_lengths):
                raise InvalidArgumentError("labels must have the same sequence lengths as ids: %s vs %s" %
                                           (label_lengths.tolist(), lengths.tolist()))
        return (flat, flat_labels, lengths) + _documents(doc_lengths, len(lengths))

    def step(self, ids, labels=None, doc_lengths=None):
        """Gradients of the batch + an optimizer step. ids: list of token lists or a 2-D int array; labels alike,
        Hugging Face style (aligned with ids, shifted by the engine, -100 = ignored) or None for next-token labels.
        doc_lengths: None, or per sequence None or the lengths of the documents packed into it (summing to its
        length): each document trains as if alone (attention and RoPE positions restart, no label crosses into the
        next document). Returns a metrics dict."""
        n = self._get()
        return n.step(*self._batch(ids, labels, doc_lengths))

    def compute_gradients(self, ids, labels=None, doc_lengths=None):
        n = self._get()
        return n.compute_gradients(*self._batch(ids, labels, doc_lengths))

    def optimizer_step(self):
        """Clipping + AdamW with the gradients held now (of compute_gradients*, or the accumulate_gradients* calls
        since the last step, averaged as one batch)."""
        return self._get().optimizer_step()

    def accumulate_gradients(self, ids, labels=None, doc_lengths=None):
        """Adds the gradient of one micro-batch (zeroing first when none is pending); optimizer_step() then steps
        as on one batch holding every micro-batch. Returns the micro-batch's metrics (its own mean loss)."""
        n = self._get()
        return n.accumulate_gradients(*self._batch(ids, labels, doc_lengths))

    def evaluate_detailed(self, ids, labels=None, distances=None, doc_lengths=None):
        """Held-out evaluation without gradients: dict(sequences, tokens, loss, perplexity, correct, accuracy,
        peak_bytes, seconds, by_distance). distances: None, or per sequence (the shape of ids) the distance >= 1 from
        the key each labelled position retrieves (anything where the label is -100); by_distance then lists the
        buckets [lo, hi) = [2^k, 2^(k+1)) up to the largest distance: dict(lo, hi, count, correct, accuracy, loss)."""
        n = self._get()
        flat, flat_labels, lengths, counts, docs = self._batch(ids, labels, doc_lengths)
        flat_distances = None
        if distances is not None:
            seqs = distances
            if isinstance(seqs, np.ndarray) and seqs.ndim == 1:
                seqs = [seqs]
            if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__") or len(seqs) != len(lengths):
                raise InvalidArgumentError("distances must hold one sequence per sequence of ids (%d)" % len(lengths))
            parts = []
            for i, d in enumerate(seqs):
                a = np.asarray(d)
                if a.ndim != 1 or a.size != lengths[i] or (a.size and a.dtype.kind not in "iu"):
                    raise InvalidArgumentError("distances[%d] must be %d integers (one per position of ids[%d])" %
                                               (i, lengths[i], i))
                parts.append(a.astype(np.int64))
            flat_distances = np.ascontiguousarray(np.concatenate(parts), dtype=np.int64)
        return n.evaluate_detailed(flat, flat_labels, lengths, flat_distances, counts, docs)

    def save_checkpoint(self, out_dir, data_position=0, keep=0):
        """Writes out_dir/checkpoint-<step_count> atomically (weights and adapters, AdamW moments, step, sampling
        counter, data_position, run configuration) and keeps the `keep` newest (0 = all). data_position: where
        the caller is in its data, returned by load_checkpoint()/resume(). Returns the checkpoint's path."""
        out_dir = os.fspath(out_dir)
        self._get().save_checkpoint(out_dir, int(data_position), int(keep))
        return os.path.join(out_dir, "checkpoint-%d" % self.step_count)

    def load_checkpoint(self, checkpoint_dir):
        """Restores a checkpoint-<step> directory into this trainer and its model; returns dict(step,
        data_position). DataLossError: corrupt or truncated; FailedPreconditionError: written with another run
        configuration (the message lists the differing fields) or tensors of other shapes; NotFoundError."""
        step, position = self._get().load_checkpoint(os.fspath(checkpoint_dir))
        return {"step": step, "data_position": position}

    def resume(self, out_dir, missing_ok=False):
        """load_checkpoint() of the newest complete checkpoint in out_dir (damaged newer ones are skipped).
        None checkpoint: NotFoundError, or None with missing_ok=True."""
        try:
            step, position = self._get().resume(os.fspath(out_dir))
        except NotFoundError:
            if missing_ok:
                return None
            raise
        return {"step": step, "data_position": position}

    def evaluate(self, ids, labels=None, doc_lengths=None):
        """The batch's mean token loss without gradients (chunked forward), as a metrics dict; the batch as in
        step(). Gradients and the optimizer are left alone."""
        n = self._get()
        return n.evaluate(*self._batch(ids, labels, doc_lengths))

    def score(self, ids, labels=None, doc_lengths=None):
        """Per-token log-probabilities without gradients: a list with one float64 array per sequence, as long as its
        ids, whose entry t is log p(labels[t] | ids[:t]) (labels None: ids), NaN at position 0 and where the label is
        -100. Computed chunk by chunk (never a sequence x vocabulary array), at any length. The arrays are what
        step_grpo's old_logprobs/ref_logprobs take; their nan-sums are what step_dpo's ref_*_logp take."""
        n = self._get()
        flat, flat_labels, lengths, counts, docs = self._batch(ids, labels, doc_lengths)
        logprobs, _ = n.score(flat, flat_labels, lengths, counts, docs)
        return np.split(logprobs, np.cumsum(lengths)[:-1]) if len(lengths) else []

    def set_reference(self, model):
        """The frozen reference model of dpo/grpo (another Model with the same vocabulary), or None to clear it."""
        if model is not None and not isinstance(model, Model):
            raise InvalidArgumentError("reference must be a seqgrad.Model or None")
        self._get().set_reference(None if model is None else model._get())
        self.reference = model

    def set_reference_base_model(self):
        """Makes the reference of dpo/grpo this trainer's model with its LoRA adapters switched off: the frozen base
        weights, with no second model or weight copy (the model must have LoRA). set_reference replaces it."""
        self._get().set_reference_base_model()
        self.reference = None

    def _dpo(self, pairs, mode):
        if isinstance(pairs, dict) or not isinstance(pairs, (list, tuple)):
            raise InvalidArgumentError("pairs must be a list of dicts")
        if not pairs:
            raise InvalidArgumentError("pairs is empty; need at least 1 pair")
        cols = [[] for _ in range(6)]
        for i, p in enumerate(pairs):
            what = "pairs[%d]" % i
            _fields(p, what, ["chosen", "rejected"], ["ref_chosen_logp", "ref_rejected_logp"])
            for k, key in enumerate(("chosen", "rejected")):
                ids, labels = _pair_sequence(p[key], "%s['%s']" % (what, key))
                cols[2 * k].append(ids)
                cols[2 * k + 1].append(labels)
            for k, key in enumerate(("ref_chosen_logp", "ref_rejected_logp")):
                cols[4 + k].append(_float(p.get(key), "%s['%s']" % (what, key), True))
        return self._get().dpo(cols[0], cols[1], cols[2], cols[3], np.array(cols[4], dtype=np.float64),
                               np.array(cols[5], dtype=np.float64), mode)

    def step_dpo(self, pairs):
        """A DPO step (objective "dpo") on preference pairs, then AdamW. pairs: a list of dicts
            {"chosen": (ids, labels), "rejected": (ids, labels),
             "ref_chosen_logp": float or None, "ref_rejected_logp": float or None}
        ids: prompt + response token ids; labels: the same length, Hugging Face style: the response tokens where
        they stand in ids, -100 elsewhere (labels=ids with the prompt masked), or None for next-token labels. ref_*_logp: the reference model's log-prob summed
        over the labelled tokens; None or absent = computed by the reference model (Trainer(reference=...)).
        Returns a metrics dict; "loss" is the mean over pairs of -log sigmoid(dpo_beta * margin)."""
        return self._dpo(pairs, _STEP)

    def compute_gradients_dpo(self, pairs):
        """step_dpo() without the optimizer step."""
        return self._dpo(pairs, _GRADIENTS)

    def accumulate_gradients_dpo(self, pairs):
        """accumulate_gradients() for objective "dpo": pairs as in step_dpo()."""
        return self._dpo(pairs, _ACCUMULATE)

    def _grpo(self, groups, mode):
        if isinstance(groups, dict) or not isinstance(groups, (list, tuple)):
            raise InvalidArgumentError("groups must be a list of lists of completion dicts")
        if not groups:
            raise InvalidArgumentError("groups is empty; need at least 1 group")
        ids, labels, adv, old, ref, offsets = [], [], [], [], [], [0]
        for g, group in enumerate(groups):
            if isinstance(group, dict) or not isinstance(group, (list, tuple)):
                raise InvalidArgumentError("groups[%d] must be a list of completion dicts" % g)
            if not group:
                raise InvalidArgumentError("groups[%d] is empty (G = 0); every group needs at least 1 completion" % g)
            for i, c in enumerate(group):
                what = "groups[%d][%d]" % (g, i)
                _fields(c, what, ["ids", "advantage"], ["labels", "old_logprobs", "ref_logprobs"])
                a, b = _ids_labels(c["ids"], c.get("labels"), what)
                ids.append(a)
                labels.append(b)
                adv.append(_float(c["advantage"], what + "['advantage']", False))
                old.append(_logprobs(c.get("old_logprobs"), what + "['old_logprobs']", a.size))
                ref.append(_logprobs(c.get("ref_logprobs"), what + "['ref_logprobs']", a.size))
            offsets.append(offsets[-1] + len(group))
        return self._get().grpo(ids, labels, np.array(adv, dtype=np.float64), old, ref,
                                np.array(offsets, dtype=np.int64), mode)

    def step_grpo(self, groups):
        """A GRPO step (objective "grpo"), then AdamW. groups: a list of groups (the G >= 1 completions of one
        prompt), each a list of dicts
            {"ids": ids, "labels": labels or None, "advantage": float,
             "old_logprobs": per-position floats or None, "ref_logprobs": per-position floats or None}
        ids/labels as in step_dpo(); old_logprobs / ref_logprobs: one entry per position of ids, aligned with labels
        (log p(labels[t] | ids[:t]) under the sampling / reference policy, what score() returns; finite where the
        label is valid, NaN allowed at position 0 and where it is -100). old_logprobs None: the current policy (ratio 1); ref_logprobs None: the reference
        model's (needed unless grpo_kl_beta = 0). Returns a metrics dict; "loss" is the GRPO objective."""
        return self._grpo(groups, _STEP)

    def compute_gradients_grpo(self, groups):
        """step_grpo() without the optimizer step."""
        return self._grpo(groups, _GRADIENTS)

    def accumulate_gradients_grpo(self, groups):
        """accumulate_gradients() for objective "grpo": groups as in step_grpo()."""
        return self._grpo(groups, _ACCUMULATE)

    def cancel(self):
        if self._native is not None:
            self._native.cancel()

    @property
    def step_count(self):
        return self._get().step_count

    def close(self):
        if self._native is not None:
            self._native.close()
            self._native = None

    @property
    def closed(self):
        return self._native is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


from .fit import FitResult, fit  # noqa: E402 (it builds on Model and Trainer)
