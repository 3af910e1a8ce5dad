"""The pinned interpreter (/usr/bin/python3, Debian) runs py_test and has numpy + torch."""
import sys

import pytest


def test_interpreter_is_pinned():
    assert sys.executable == "/usr/bin/python3", sys.executable
    assert sys.version_info[:2] == (3, 11)


def test_numpy_and_torch():
    import numpy as np
    import torch

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = torch.from_numpy(a) @ torch.ones(3, 1)
    np.testing.assert_allclose(t.numpy().ravel(), [3.0, 12.0])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
