#!/usr/bin/env bash
# bench --compare_torch on the hybrids against transformers 5.23 (the venv of tests/e2e/pip_venv.sh): its model class
# loads the saved Qwen3.5 and Qwen3-Next (dense) directories and runs its torch delta rule (no fla, no causal-conv1d),
# the plain-ops engine is skipped saying why, and the losses agree with seqgrad's for full and seco (compared with
# transformers' full). f64: transformers runs its delta rule in f32 whatever the model's dtype, hence 1e-6. A
# Qwen3-MoE the same way (the plain-ops engine has no experts), in f32: transformers' grouped expert GEMM takes no
# f64. Mamba-2 the same way: transformers' Mamba2ForCausalLM, loaded without SDPA (it has no attention), runs its torch
# SSD chunk scan (no mamba-ssm), in f32 whatever the model's dtype, hence 1e-6 in f64.
# usage: bench_hybrid_hf_test.sh <bench binary> <pip_venv.sh>
set -euo pipefail
bench="$1"
python="$("$2")/bin/python"
check() {  # check <json> <model_type> <transformers class> <in hf's label> <in the plain-ops engine's skip> <tol>
  /usr/bin/python3 - "$@" <<'PY'
import json, sys

path, model_type, model_class, path_label, gap, tolerance = sys.argv[1:]
d = json.load(open(path))
assert d["config"]["architecture"] == model_type, d["config"]
label = d["torch"]["labels"]["hf"]
assert model_class in label and path_label in label, label
assert gap in d["torch"]["skipped_engines"]["torch"], d["torch"]
ratios = {r["strategy"]: r for r in d["ratios"]}
assert set(ratios) == {"full", "seco"} and {r["versus"] for r in ratios.values()} == {"hf"}, d["ratios"]
assert ratios["seco"]["torch_strategy"] == "full", ratios
for r in ratios.values():
    assert r["loss_rel_diff"] < float(tolerance), r
print(model_type, "against transformers OK:", {s: r["loss_rel_diff"] for s, r in ratios.items()})
PY
}
out="${TEST_TMPDIR:-$(mktemp -d)}"
flags=(--dtype=f64 --strategies=full,seco --chunk=16 --seq_lens=64 --repeats=1 --warmup=0 --compare_torch
       --python="$python")
deltanet=("sdpa, torch delta rule and conv1d" "Gated DeltaNet" 1e-6)
"$bench" --model=tiny-qwen3.5 "${flags[@]}" --json="$out/qwen3_5.json"
check "$out/qwen3_5.json" qwen3_5_text Qwen3_5ForCausalLM "${deltanet[@]}"
"$bench" --model=tiny-qwen3.5 "${flags[@]}" --json="$out/qwen3_next.json" \
  --config_overrides='{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "num_experts": 0}'
check "$out/qwen3_next.json" qwen3_next Qwen3NextForCausalLM "${deltanet[@]}"
"$bench" --model=tiny-qwen3-moe "${flags[@]}" --dtype=f32 --json="$out/qwen3_moe.json"
check "$out/qwen3_moe.json" qwen3_moe Qwen3MoeForCausalLM sdpa "mixture of experts" 1e-5
"$bench" --model=tiny-mamba2 "${flags[@]}" --json="$out/mamba2.json"
check "$out/mamba2.json" mamba2 Mamba2ForCausalLM "no attention, torch SSD scan and conv1d" "Mamba-2 mixer" 1e-6
