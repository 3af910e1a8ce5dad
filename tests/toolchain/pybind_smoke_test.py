"""Imports the pybind11 module built by Bazel (a data dependency of this test)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sg_toolchain_py  # noqa: E402


def test_add():
    assert sg_toolchain_py.add(2, 3) == 5


def test_scale_in_place():
    x = np.array([1.0, 2.0], dtype=np.float32)
    sg_toolchain_py.scale_in_place(x, 3.0)
    np.testing.assert_array_equal(x, [3.0, 6.0])
    with pytest.raises(TypeError):  # float64 would be silently copied without noconvert
        sg_toolchain_py.scale_in_place(np.array([1.0]), 2.0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
