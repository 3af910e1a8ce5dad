"""Typed exceptions for seqgrad statuses (codes mirror the C API's sg_code, i.e. absl's codes)."""

OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
NOT_FOUND = 5
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
DATA_LOSS = 15
BUSY = 100


class SeqgradError(Exception):
    """Base class of every seqgrad error; `.code` is the C API's status code, `.code_name` its name."""

    code = UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def code_name(self):
        from . import _native
        return _native.code_name(self.code)


class InvalidArgumentError(SeqgradError, ValueError):
    code = INVALID_ARGUMENT


class NotFoundError(SeqgradError):
    code = NOT_FOUND


class OutOfRangeError(SeqgradError, IndexError):
    code = OUT_OF_RANGE


class CancelledError(SeqgradError):
    code = CANCELLED


class BusyError(SeqgradError):
    """Another thread is running a step on this trainer (or its model)."""

    code = BUSY


class ResourceExhaustedError(SeqgradError, MemoryError):
    """Out of memory, or a step would pass the model's memory limit (Model.set_memory_limit)."""

    code = RESOURCE_EXHAUSTED


class FailedPreconditionError(SeqgradError):
    """The call does not fit the object's state, e.g. step_dpo() on a trainer whose objective is not "dpo"."""

    code = FAILED_PRECONDITION


class InternalError(SeqgradError):
    """An internal failure, e.g. a NaN/Inf loss or gradient (the message names the step and the tensor)."""

    code = INTERNAL


class DataLossError(SeqgradError):
    """Unrecoverable data: a corrupt, truncated or incomplete checkpoint (the message names the file)."""

    code = DATA_LOSS


class PermissionDeniedError(SeqgradError, PermissionError):
    code = PERMISSION_DENIED


class UnimplementedError(SeqgradError, NotImplementedError):
    code = UNIMPLEMENTED


class ClosedError(FailedPreconditionError, ValueError):
    """The handle was closed (use after close)."""

    code = FAILED_PRECONDITION


class StepAppliedError(Exception):
    """The progress callback raised during a trainer call that then completed: its update is in place (the optimizer
    step, the accumulated micro-batch or the gradients), so retrying the call would apply the batch twice.
    `.step` is the trainer's step count after the call; `__cause__` is what the callback raised. Not a SeqgradError:
    the engine did not fail. A callback exception in a call that failed is raised as it is."""

    def __init__(self, step, cause):
        super().__init__("the call completed (step count %d; do not retry it) but the progress callback raised %s: %s"
                         % (step, type(cause).__name__, cause))
        self.step = step


def step_applied(step, cause):
    """The StepAppliedError of a completed call whose callback raised `cause` (called by the native module)."""
    e = StepAppliedError(step, cause)
    e.__cause__ = cause
    return e


_BY_CODE = {
    c.code: c
    for c in (InvalidArgumentError, NotFoundError, OutOfRangeError, CancelledError, BusyError,
              ResourceExhaustedError, FailedPreconditionError, InternalError, DataLossError, PermissionDeniedError,
              UnimplementedError)
}


def from_status(code, message):
    """The exception for a failed status (called by the native module)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return SeqgradError(message, code)
    return cls(message)
