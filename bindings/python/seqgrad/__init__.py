"""seqgrad: train Llama/Qwen2 transformers on long sequences with exact gradient strategies.

    import seqgrad
    with seqgrad.Model.from_preset("tiny") as model, seqgrad.Trainer(model, strategy="seco", chunk=64) as tr:
        m = tr.step([[1, 5, 7, 9], [3, 4, 5]])       # next-token labels when labels is None
        print(m["loss"], m["peak_bytes"])
        w = model.parameters()["model.norm.weight"]  # numpy view of the engine's memory (no copy)

Everything goes through the stable C API (libseqgrad.so); errors raise seqgrad.SeqgradError subclasses carrying
`.code`. Training steps release the GIL; Trainer.cancel() may be called from any thread.
"""
import numpy as np

from . import _native
from ._errors import (BusyError, CancelledError, ClosedError, InternalError, InvalidArgumentError, NotFoundError,
                      OutOfRangeError, ResourceExhaustedError, SeqgradError)

__all__ = [
    "Model", "Trainer", "SeqgradError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError", "CancelledError",
    "BusyError", "ResourceExhaustedError", "InternalError", "ClosedError", "version", "MEMORY_CATEGORIES",
    "PRESETS",
]

__version__ = "%d.%d.%d" % (_native.VERSION_MAJOR, _native.VERSION_MINOR, _native.VERSION_PATCH)
MEMORY_CATEGORIES = tuple(_native.memory_category_names())
PRESETS = tuple(_native.preset_names())


def version():
    """Version of the loaded libseqgrad.so."""
    return _native.version()


class Model:
    """A model (native handle). Use Model.from_preset / Model.load; a context manager.

    close() drops this object's reference to the native model; numpy views from parameters()/gradients() and
    trainers keep the memory alive until they are gone, so views never dangle.
    """

    def __init__(self, native):
        self._native = native

    @classmethod
    def from_preset(cls, name="tiny", dtype="f32", seed=0):
        return cls(_native.Model.create_preset(name, dtype, seed))

    @classmethod
    def load(cls, hf_dir, dtype="f32"):
        return cls(_native.Model.load(str(hf_dir), dtype))

    def _get(self):
        if self._native is None:
            raise ClosedError("Model is closed")
        return self._native

    def save(self, directory):
        self._get().save(str(directory))

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

    def __len__(self):
        return self._get().num_params

    def _params(self):
        n = self._get()
        return [n.param(i) for i in range(n.num_params)]

    def parameters(self):
        """dict name -> numpy array sharing the engine's memory (writes change the model)."""
        return {name: value for name, value, _ in self._params()}

    def gradients(self):
        """dict name -> numpy array view of each gradient (frozen parameters are left out)."""
        return {name: grad for name, _, grad in self._params() if grad is not None}

    def close(self):
        self._native = None

    @property
    def closed(self):
        return self._native is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _as_tokens(seq, what, index):
    a = np.asarray(seq)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise InvalidArgumentError("%s[%d] must be a 1-D sequence of token ids, got shape %s" % (what, index, a.shape))
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError("%s[%d] must hold integers, got dtype %s" % (what, index, a.dtype))
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise InvalidArgumentError("%s[%d] has values outside int32" % (what, index))
    return a.astype(np.int32, copy=False)


def _flatten(batch, what):
    if isinstance(batch, np.ndarray):
        if batch.ndim == 1:
            batch = [batch]
        elif batch.ndim != 2:
            raise InvalidArgumentError("%s must be a list of sequences or a 2-D array, got %d-D" % (what, batch.ndim))
    if isinstance(batch, (str, bytes)) or not hasattr(batch, "__len__"):
        raise InvalidArgumentError("%s must be a list of sequences or a 2-D array" % what)
    seqs = [_as_tokens(s, what, i) for i, s in enumerate(batch)]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    flat = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int32)
    return np.ascontiguousarray(flat, dtype=np.int32), lengths


class Trainer:
    """Computes gradients with a strategy ("full", "ckpt", "seco", "spaco") and applies AdamW. A context manager.

    spaco backpropagates each of a sequence's k chunks with probability spaco_budget / k (1 <= spaco_budget <= k)
    and compensates the kept ones so the gradient is unbiased; spaco_cap caps the compensation of relayed state
    gradients (0 = no cap, else >= 1) and seed seeds the sampling. Metrics count "chunks" and
    "chunks_backpropagated".

    Not for concurrent use: a step while another thread's step runs raises BusyError. cancel() is thread-safe and
    makes the running (or next) step raise CancelledError.
    """

    def __init__(self, model, strategy="full", chunk=512, page_size=256, lm_chunk=256, lr=1e-3, betas=(0.9, 0.95),
                 eps=1e-8, weight_decay=0.0, clip_grad_norm=1.0, progress=None, *, spaco_budget=8, spaco_cap=2.0,
                 seed=0):
        if not isinstance(model, Model):
            raise InvalidArgumentError("model must be a seqgrad.Model")
        self.model = model
        self._native = _native.Trainer(model._get(), strategy, chunk, page_size, lm_chunk, lr, betas[0], betas[1],
                                       eps, weight_decay, clip_grad_norm, spaco_budget, spaco_cap, seed)
        if progress is not None:
            self.set_progress_callback(progress)

    def _get(self):
        if self._native is None or self._native.closed:
            raise ClosedError("Trainer is closed")
        return self._native

    def set_progress_callback(self, fn):
        """fn(dict(step, loss, tokens, grad_norm, phase)) is called on the stepping thread after each phase."""
        self._get().set_callback(fn)

    def _batch(self, ids, labels):
        flat, lengths = _flatten(ids, "ids")
        flat_labels = None
        if labels is not None:
            flat_labels, label_lengths = _flatten(labels, "labels")
            if not np.array_equal(lengths, label_lengths):
                raise InvalidArgumentError("labels must have the same sequence lengths as ids: %s vs %s" %
                                           (label_lengths.tolist(), lengths.tolist()))
        return flat, flat_labels, lengths

    def step(self, ids, labels=None):
        """Gradients of the batch + an optimizer step. ids: list of token lists or a 2-D int array; labels alike
        (-100 = ignored) or None for next-token labels. Returns a metrics dict."""
        n = self._get()
        return n.step(*self._batch(ids, labels))

    def compute_gradients(self, ids, labels=None):
        n = self._get()
        return n.compute_gradients(*self._batch(ids, labels))

    def optimizer_step(self):
        return self._get().optimizer_step()

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
