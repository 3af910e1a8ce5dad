#!/usr/bin/env bash
# A GPU check bundle (tools/gpu/make_bundle.py) travels: at most MAX_BYTES, and it holds the check script, its helper
# scripts, the manifest, every named binary, and no CUDA library (the GPU machine has its own).
# usage: bundle_contents_test.sh BUNDLE.tar.xz MAX_BYTES BINARY...
set -euo pipefail
bundle="$1" max="$2"
shift 2
/usr/bin/python3 - "$bundle" "$max" "$@" <<'PY'
import json, re, sys, tarfile

path, limit, binaries = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with tarfile.open(path) as tar:
    members = {m.name: m for m in tar.getmembers()}
    manifest = json.load(tar.extractfile("gpu_bundle/manifest.json"))
packed = sum(m.size for m in members.values())
size = __import__("os").path.getsize(path)
print(f"{path}: {size / 2**20:.1f} MiB compressed, {packed / 2**20:.1f} MiB unpacked")
for name, m in sorted(members.items()):
    print(f"  {m.size / 2**20:8.2f} MiB  {name}")
print("needs", manifest["needs"], "; CUDA from the machine:", manifest["cuda_libraries_from_the_machine"])
want = ["gpu_bundle/gpu_check.sh", "gpu_bundle/manifest.json", "gpu_bundle/scripts/bench_torch_gpu.py",
        "gpu_bundle/scripts/gpu_check_summary.py"] + ["gpu_bundle/bin/" + b for b in binaries]
missing = [w for w in want if w not in members]
assert not missing, f"missing from the bundle: {missing}"
for w in want:
    if w.endswith(".sh") or "/bin/" in w:
        assert members[w].mode & 0o111, f"{w} is not executable"
cuda = [n for n in members if re.search(r"/lib/lib(cuda|cudart|cublas|nccl)", n)]
assert not cuda, f"CUDA libraries in the bundle (the GPU machine has them): {cuda}"
assert sorted(manifest["files"]) == sorted(n[len("gpu_bundle/"):] for n in members if n != "gpu_bundle/manifest.json")
assert size <= limit, f"the bundle is {size / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB that may travel"
print("bundle OK")
PY
