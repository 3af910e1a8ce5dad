"""Dynamic NTK RoPE through the command-line tools' JSONL path: score's per-token log-probs and their mean (the loss)
equal transformers' in float64 at T < M, T = M and T > M (tests/torch_ref/dynamic_rope_ref.py).
usage: dynamic_rope_cli_test.py SCORE PIP_VENV_SH DYNAMIC_ROPE_REF_PY"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[3])))
import dynamic_rope_ref as ref  # noqa: E402


def main():
    directory, want = ref.model_and_reference(sys.argv[2])
    seqs = ref.sequences()
    data = os.path.join(directory, "records.jsonl")
    with open(data, "w") as f:
        for ids in seqs.values():
            f.write(json.dumps({"input_ids": ids}) + "\n")
    out = subprocess.run([sys.argv[1], f"--model={directory}", f"--data={data}", "--dtype=f64", "--strategy=seco",
                          "--chunk=7"], check=True, capture_output=True, text=True).stdout
    got = {}
    for T, line in zip(seqs, out.splitlines()):
        record = json.loads(line)
        assert record["logprobs"][0] is None and len(record["logprobs"]) == T, record
        got[T] = {"logprobs": record["logprobs"][1:], "loss": -record["sum"] / record["tokens"]}
    ref.check("CLI score", got, want, keys=("loss", "logprobs"))


if __name__ == "__main__":
    main()
