#!/usr/bin/env bash
# tools/gpu_check.sh run from the emulated bundle (the CUDA backend on the CPU), as a lent GPU machine runs the real
# one, so that no GPU minute goes to a bug of the script or the bundle:
#   1. --tiny: every stage runs and writes its JSON; correctness, speed and memory pass; the tools a GPU machine has
#      (nvidia-smi, compute-sanitizer, ncu) are recorded as skipped; summary.json is well-formed.
#   2. a check that hangs is killed at its stage's end (timeout) and, with the budget spent, the rest is skipped.
#   3. every binary failing: every check still runs and fails, the exit status is 1, summary.json still comes, and
#      with $OUT set (a lent machine returns at most 8 files from it) the results are packed there.
# usage: check_emulated_test.sh BUNDLE.tar.xz
set -euo pipefail
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
/usr/bin/python3 -m tarfile -e "$1" "$tmp/ok"
ok="$tmp/ok/gpu_bundle"

# No GPU machine's tools but a stand-in nvidia-smi whose memory samples (MiB) grow by 1 every 0.1 s: the GPU memory
# columns of the summary come from it.
mkdir -p "$tmp/tools"
cat >"$tmp/tools/nvidia-smi" <<'EOF'
#!/bin/sh
case "$*" in *--query-gpu=memory.used*) i=1000; while :; do echo $i; i=$((i + 1)); sleep 0.1; done ;; esac
echo "nvidia-smi: stand-in" >&2; exit 9
EOF
chmod +x "$tmp/tools/nvidia-smi"
export PATH="$tmp/tools:/usr/bin:/bin"
start=$SECONDS
"$ok/gpu_check.sh" --tiny --out "$tmp/out1"
echo "tiny run: $((SECONDS - start)) s"
/usr/bin/python3 - "$tmp/out1" <<'PY'
import json, os, sys

out = sys.argv[1]
s = json.load(open(os.path.join(out, "summary.json")))
assert s["mode"].startswith("tiny") and s["ok"] is True, s
assert s["budget_s"] == 430 and 0 <= s["elapsed_s"] <= 430, s
assert s["bundle"]["needs"]["glibc"].startswith("GLIBC_"), s["bundle"]
stages = {st["name"]: st for st in s["stages"]}
assert list(stages) == ["correctness", "speed", "memory", "extras"], list(stages)
assert sum(st["budget_s"] for st in s["stages"]) <= 430, s["stages"]
want = {
    "correctness": {"nvidia_smi": "skipped", "libraries": "pass", "ops_test": "pass", "cuda_strategy_test": "pass",
                    "bf16_strategy_test": "pass", "gradcheck_seco": "pass", "gradcheck_streambp": "pass",
                    "gradcheck_qwen3.5_seco": "pass", "gradcheck_qwen3_next_seco": "pass"},
    "speed": {"bench_speed_64": "pass", "bench_speed_128": "pass", "torch_reference": "skipped",
              "torch_arguments": "pass"},
    "memory": {"plan_64": "pass", "bench_offload_64": "pass", "plan_128": "pass", "bench_offload_128": "pass"},
    "extras": {"memcheck": "skipped", "racecheck": "skipped", "kernel_profile": "skipped"},
}
for name, checks in want.items():
    got = {c["check"]: c["status"] for c in stages[name]["checks"]}
    assert got == checks and list(got) == list(checks), (name, got)
    assert stages[name]["status"] == ("skipped" if name == "extras" else "pass"), stages[name]
    for c in stages[name]["checks"]:
        assert set(c) == {"stage", "check", "status", "rc", "elapsed_s", "reason", "log"}, c
        if c["status"] != "skipped":
            assert c["rc"] == 0 and os.path.getsize(os.path.join(out, c["log"])) > 0, c
for t in ("ops_test", "cuda_strategy_test", "bf16_strategy_test"):
    g = json.load(open(os.path.join(out, t + ".gtest.json")))
    assert g["tests"] >= 1 and g["failures"] == 0, (t, g["tests"], g["failures"])
for name, s_ in (("seco", "seco"), ("streambp", "streambp"), ("qwen3.5_seco", "seco"), ("qwen3_next_seco", "seco")):
    r = json.load(open(os.path.join(out, f"gradcheck_{name}.json")))
    assert r["strategy"] == s_ and r["dtype"] == "f64" and r["max_rel_err"] <= 1e-10, r
speed = [r for r in s["speed"] if "engine" in r]
assert all(r["gpu_used_peak_bytes"] >= 1000 * 2**20 for r in s["speed"] if "check" in r), s["speed"]
assert {(r["engine"], r["strategy"], r["seq_len"]) for r in speed} == \
    {("seqgrad", st, t) for st in ("full", "seco") for t in (64, 128)}, speed
for r in speed:
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["peak_bytes"] > 0, r
m = s["memory"]
assert [r["seq_len"] for r in m["rows"]] == [64, 128], m
for r in m["rows"]:
    assert 0 < r["measured_peak_bytes"] < r["plan_peak_bytes"] and r["gpu_used_peak_bytes"] >= 1000 * 2**20, r
    assert r["host_offloaded_bytes"] > 0, r
# The plan is of a training step: the adapters' optimizer state more than the gradient step bench measures, the same
# at every length; the two grow alike.
assert m["rows"][0]["plan_minus_measured_bytes"] == m["rows"][1]["plan_minus_measured_bytes"], m
growth = m["growth_bytes_per_10k_tokens"]
assert growth["measured"] > 0 and growth["gpu_used"] is not None and m["measured_growth_equals_plan"] is True, m
bench = json.load(open(os.path.join(out, "bench_offload_128.json")))
assert bench["config"]["strategies"] == ["seco:offload"] and bench["config"]["lora"]["rank"] == 4, bench["config"]
assert s["top_kernels"] is None
print("tiny run OK")
PY

# The kernel table from ncu's CSV (what `ncu --csv --metrics gpu__time_duration.sum` writes; no ncu here).
cat >"$tmp/out1/kernel_profile.csv" <<'EOF'
==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","bench","h","gemm_kernel(float*, int)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,000"
"1","1","bench","h","attention_fwd","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","5000"
"2","1","bench","h","gemm_kernel(float*, int)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","4000"
EOF
/usr/bin/python3 "$ok/scripts/gpu_check_summary.py" "$tmp/out1" 420 0 1 >/dev/null
/usr/bin/python3 - "$tmp/out1/summary.json" <<'PY'
import json, sys

top = json.load(open(sys.argv[1]))["top_kernels"]
assert top == [{"kernel": "gemm_kernel", "total_ms": 0.006, "launches": 2},
               {"kernel": "attention_fwd", "total_ms": 0.005, "launches": 1}], top
print("kernel table OK")
PY

# A check that hangs: killed when the (5 s) budget ends; what follows is skipped, not run.
cp -r "$tmp/ok" "$tmp/hang"
printf '#!/bin/sh\nexec sleep 100\n' >"$tmp/hang/gpu_bundle/bin/ops_test"
start=$SECONDS
if "$tmp/hang/gpu_bundle/gpu_check.sh" --tiny --budget_s 5 --out "$tmp/out2"; then
  echo "gpu_check.sh exited 0 although ops_test timed out" >&2
  exit 1
fi
(( SECONDS - start < 30 )) || { echo "the 5 s budget took $((SECONDS - start)) s" >&2; exit 1; }
/usr/bin/python3 - "$tmp/out2" <<'PY'
import json, sys

s = json.load(open(sys.argv[1] + "/summary.json"))
stages = {st["name"]: st for st in s["stages"]}
checks = {c["check"]: c for st in s["stages"] for c in st["checks"]}
assert checks["ops_test"]["status"] == "timeout" and checks["ops_test"]["rc"] in (124, 137), checks["ops_test"]
assert checks["cuda_strategy_test"]["status"] == "skipped", checks["cuda_strategy_test"]
assert "no time left" in checks["cuda_strategy_test"]["reason"], checks["cuda_strategy_test"]
assert stages["correctness"]["status"] == "fail" and s["ok"] is False, stages["correctness"]
for name in ("speed", "memory", "extras"):
    assert stages[name]["status"] == "skipped", stages[name]
print("timeout run OK")
PY

# Every binary fails: every check still runs (rc 3), the run ends with status 1 and a summary.
cp -r "$tmp/ok" "$tmp/fail"
for b in "$tmp/fail/gpu_bundle/bin/"*; do printf '#!/bin/sh\necho broken >&2\nexit 3\n' >"$b"; done
mkdir -p "$tmp/returned"
if OUT="$tmp/returned" "$tmp/fail/gpu_bundle/gpu_check.sh" --tiny --out "$tmp/out3"; then
  echo "gpu_check.sh exited 0 although every binary failed" >&2
  exit 1
fi
/usr/bin/python3 - "$tmp/out3" <<'PY'
import json, sys

s = json.load(open(sys.argv[1] + "/summary.json"))
ran = {c["check"]: c for st in s["stages"] for c in st["checks"] if c["status"] != "skipped"}
for name in ("ops_test", "cuda_strategy_test", "bf16_strategy_test", "gradcheck_seco", "gradcheck_streambp",
             "gradcheck_qwen3.5_seco", "gradcheck_qwen3_next_seco", "bench_speed_64", "bench_speed_128", "plan_64", "plan_128", "bench_offload_64", "bench_offload_128"):
    assert ran[name]["status"] == "fail" and ran[name]["rc"] == 3 and ran[name]["reason"] == "broken", ran.get(name)
assert [st["status"] for st in s["stages"]] == ["fail", "fail", "fail", "skipped"], s["stages"]
assert [r for r in s["speed"] if "engine" in r] == [] and s["memory"]["rows"] == [], (s["speed"], s["memory"])
print("failing run OK")
PY
[[ "$(ls "$tmp/returned" | sort | tr '\n' ' ')" == "checks.jsonl gpu_results.tar.gz summary.json " ]] ||
  { echo "\$OUT holds: $(ls "$tmp/returned")" >&2; exit 1; }
tar tzf "$tmp/returned/gpu_results.tar.gz" >"$tmp/returned.list"  # no pipe: grep -q would cut tar off (pipefail)
grep -qx "out3/ops_test.log" "$tmp/returned.list" || { echo "gpu_results.tar.gz lacks the logs" >&2; exit 1; }
echo "packed OK"
