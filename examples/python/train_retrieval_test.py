"""Runs the Python retrieval example for a few steps: it trains and the loss goes down."""
import sys

import pytest

import train_retrieval


def test_trains():
    losses = train_retrieval.main(["--steps", "8", "--seq-len", "128", "--chunk", "32", "--lr", "1e-2"])
    assert len(losses) == 8
    assert min(losses[-3:]) < losses[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
