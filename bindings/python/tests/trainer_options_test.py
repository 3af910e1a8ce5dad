"""seqgrad.Trainer passes its options by sg_trainer_options' field names (cabi/trainer_options.inc), with the C API's
defaults."""
import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seqgrad  # noqa: E402
from seqgrad import _native  # noqa: E402


def test_keyword_defaults_are_the_c_defaults():
    c = _native.trainer_default_options()
    assert tuple(c) == _native.TRAINER_OPTIONS
    py = {name: p.default for name, p in inspect.signature(seqgrad.Trainer).parameters.items()
          if p.default is not inspect.Parameter.empty}
    py["beta1"], py["beta2"] = py.pop("betas")
    # Python spells no window None and no tensor parallelism 1, where C has INT64_MAX and 0 (the same as 1).
    assert py.pop("adjoint_window") is None and c.pop("adjoint_window") == 2**63 - 1
    assert py.pop("tp") == 1 and c.pop("tp") == 0
    assert {name: py[name] for name in c} == c


def test_unknown_and_mistyped_options_are_refused():
    with seqgrad.Model.from_preset("tiny", seed=1) as model:
        with pytest.raises(seqgrad.InvalidArgumentError, match="unknown option 'chunks'"):
            _native.Trainer(model._get(), {"chunks": 4})
        with pytest.raises(TypeError, match="'chunk' cannot be str"):
            _native.Trainer(model._get(), {"chunk": "4"})
        with seqgrad.Trainer(model, chunk=4, lr=0.5, betas=(0.5, 0.75)) as tr:
            assert tr.step([[1, 2, 3, 4, 5]])["lr"] == 0.5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
