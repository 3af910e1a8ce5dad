"""Runs the Python retrieval example: it trains and the loss goes down; with LoRA, a cosine schedule, gradient
accumulation and checkpoints, a run stopped and resumed prints the same losses as an uninterrupted one."""
import os
import sys

import pytest

import train_retrieval


def test_trains():
    losses = train_retrieval.main(["--steps", "8", "--seq-len", "128", "--chunk", "32", "--lr", "1e-2"])
    assert len(losses) == 8
    assert min(losses[-3:]) < losses[0]


LORA = ["--steps", "6", "--seq-len", "96", "--chunk", "32", "--lr", "2e-2", "--dtype", "f64", "--lora-rank", "4",
        "--lora-dropout", "0.1", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--lr-schedule", "cosine",
        "--warmup-steps", "2", "--grad-accum", "2", "--save-every", "2", "--keep", "2", "--eval-sequences", "2"]


def test_lora_checkpoints_resume(tmp_path, capsys):
    full = train_retrieval.main(LORA + ["--out-dir", str(tmp_path / "a")])
    assert len(full) == 6 and all(l == l for l in full)
    assert sorted(os.listdir(tmp_path / "a")) == ["adapter", "checkpoint-4", "checkpoint-6"]
    assert sorted(os.listdir(tmp_path / "a" / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    first = train_retrieval.main(LORA + ["--out-dir", str(tmp_path / "b"), "--stop-at-step", "3"])
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-2", "checkpoint-3"]
    capsys.readouterr()
    rest = train_retrieval.main(LORA + ["--out-dir", str(tmp_path / "b"), "--resume"])
    out = capsys.readouterr().out
    assert "resumed from step 3 (record 12)" in out and "held-out: loss" in out and "distance [" in out
    assert first + rest == full  # bit-identical (f64, fixed seed)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
