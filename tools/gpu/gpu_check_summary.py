"""summary.json of a gpu_check.sh run: every stage's status with its checks, and the tables the run is for (speed:
tok/s, MFU and peak memory per engine; memory: device growth per 10K tokens against the plan; the top kernels).

usage: gpu_check_summary.py OUT_DIR BUDGET_S ELAPSED_S TINY
"""
import csv
import glob
import json
import os
import re
import sys

STAGES = ("correctness", "speed", "memory", "extras")


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def last_json_line(path):
    try:
        lines = [l for l in open(path, errors="replace") if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def gpu_used_peak_bytes(out, check):
    """The highest of nvidia-smi's used-memory samples (MiB) taken while the check ran, in bytes; None without."""
    try:
        samples = [float(l) for l in open(os.path.join(out, check + ".gpu_mem")) if l.strip()]
    except (OSError, ValueError):
        return None
    return int(max(samples) * 2**20) if samples else None


def stage_status(checks):
    if not checks:
        return "not run"
    statuses = {c["status"] for c in checks}
    if statuses & {"fail", "timeout"}:
        return "fail"
    return "skipped" if statuses == {"skipped"} else "pass"


def speed_table(out):
    """One row per engine, strategy and length of the bench_speed_*.json files; the GPU's used-memory peak of each
    check (seqgrad's steps, then PyTorch's beside seqgrad's resident memory) as a row of its own."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "bench_speed_*.json"))):
        d = read_json(path) or {}
        for r in d.get("rows", []):
            rows.append({"engine": r["engine"], "strategy": r["strategy"], "seq_len": r["seq_len"],
                         "tokens_per_s": r.get("tokens_per_s"), "mfu": r.get("sgemm_fraction"),
                         "peak_bytes": r.get("peak_bytes"), "loss": r.get("loss")})
        for r in d.get("skipped", []):
            rows.append({"engine": r.get("engine", "seqgrad"), "strategy": r["strategy"], "seq_len": r["seq_len"],
                         "skipped": r["reason"]})
        if "torch" in d:
            rows.append({"torch": d["torch"], "torch_error": d.get("torch_error")})
        check = os.path.basename(path)[:-len(".json")]
        rows.append({"check": check, "gpu_used_peak_bytes": gpu_used_peak_bytes(out, check)})
    return rows


def growth_per_10k(peaks):
    """(peak at the longest T - peak at the shortest) per 10K tokens, or None."""
    peaks = {t: p for t, p in peaks.items() if p is not None}
    if len(peaks) < 2:
        return None
    (t0, p0), (t1, p1) = min(peaks.items()), max(peaks.items())
    return (p1 - p0) / (t1 - t0) * 1e4


def memory_table(out):
    """Per length: the engine-accounted device peak of one gradient step (bench), the plan's peak of a training step
    (its optimizer state more: a difference constant in T), nvidia-smi's; and their growth per 10K tokens."""
    rows = []
    for path in glob.glob(os.path.join(out, "bench_offload_*.json")):
        d = read_json(path) or {}
        for r in d.get("rows", []):
            if r["engine"] != "seqgrad":
                continue
            plan = last_json_line(os.path.join(out, "plan_%d.log" % r["seq_len"])) or {}
            planned = plan.get("device_total_peak")
            rows.append({"seq_len": r["seq_len"], "measured_peak_bytes": r["peak_bytes"], "plan_peak_bytes": planned,
                         "plan_minus_measured_bytes": None if planned is None else planned - r["peak_bytes"],
                         "gpu_used_peak_bytes": gpu_used_peak_bytes(out, "bench_offload_%d" % r["seq_len"]),
                         "host_offloaded_bytes": r.get("offloaded_bytes")})
    rows.sort(key=lambda r: r["seq_len"])
    growth = {k: growth_per_10k({r["seq_len"]: r[k + "_peak_bytes"] for r in rows})
              for k in ("measured", "plan", "gpu_used")}
    return {
        "rows": rows,
        "growth_bytes_per_10k_tokens": growth,
        "measured_growth_equals_plan": growth["measured"] is not None and growth["measured"] == growth["plan"],
    }


def top_kernels(out, n=5):
    """The n kernels of ncu's CSV (gpu__time_duration.sum per launch) with the most time in all."""
    path = os.path.join(out, "kernel_profile.csv")
    if not os.path.exists(path):
        return None
    lines = [l for l in open(path, errors="replace") if l.startswith('"')]
    totals = {}
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", r.get("Kernel Name") or r.get("Function Name") or "?")
        ns = float(r["Metric Value"].replace(",", ""))
        t = totals.setdefault(name, [0.0, 0])
        t[0] += ns
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"kernel": k, "total_ms": v[0] / 1e6, "launches": v[1]} for k, v in ranked]


def main():
    out, budget_s, elapsed_s, tiny = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    checks = [json.loads(l) for l in open(os.path.join(out, "checks.jsonl")) if l.strip()]
    budgets = {s["stage"]: s["budget_s"] for s in map(json.loads, open(os.path.join(out, "stages.jsonl")))}
    stages = []
    for name in STAGES:
        mine = [c for c in checks if c["stage"] == name]
        stages.append({"name": name, "budget_s": budgets.get(name), "status": stage_status(mine),
                       "elapsed_s": sum(c["elapsed_s"] for c in mine), "checks": mine})
    summary = {
        "mode": "tiny (emulated device)" if tiny else "gpu",
        "budget_s": budget_s,
        "elapsed_s": elapsed_s,
        "ok": all(s["status"] in ("pass", "skipped") for s in stages),
        "bundle": read_json(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         "manifest.json")),
        "stages": stages,
        "speed": speed_table(out),
        "memory": memory_table(out),
        "top_kernels": top_kernels(out),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for s in stages:
        print("%-12s %-8s %s" % (s["name"], s["status"],
                                  ", ".join("%s %s" % (c["check"], c["status"]) for c in s["checks"])))


if __name__ == "__main__":
    main()
