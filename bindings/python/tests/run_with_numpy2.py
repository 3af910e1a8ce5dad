"""Runs seqgrad_test.py under PyPI's NumPy 2 (argv[1]: its pip --target directory, from pypi.bzl) instead of Debian
12's NumPy 1.24: pip installs NumPy 2 by default, and the binding must give the same views under both."""
import os
import sys

numpy2_dir = sys.argv[1]
sys.path.insert(0, numpy2_dir)
import numpy  # noqa: E402
import pytest  # noqa: E402

if not numpy.__version__.startswith("2.") or not numpy.__file__.startswith(numpy2_dir):
    sys.exit("expected NumPy 2 from %s, got %s from %s" % (numpy2_dir, numpy.__version__, numpy.__file__))
test = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seqgrad_test.py")
sys.exit(pytest.main([test, "-q", "-p", "no:cacheprovider"]))
