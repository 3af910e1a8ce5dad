"""Packs the GPU check (tools/gpu_check.sh), its binaries and the shared libraries they load into one xz tarball
that a GPU machine without Bazel unpacks and runs: gpu_bundle/{gpu_check.sh, bin/, lib/, scripts/, manifest.json}.

usage: make_bundle.py OUT.tar.xz --script gpu_check.sh --bin NAME=PATH... [--file REL=PATH...]

Binaries are stripped (the symbol tables are a third of their size). lib/ holds every library they load that a Linux
system with CUDA cannot be assumed to have (oneDNN, OpenBLAS, libgomp, ...: bundle_shared_libs.py's rule), but not
CUDA's own (cuBLAS, cuBLASLt, NCCL, the driver): gpu_check.sh finds those on the GPU machine. One LZMA stream with a
64 MiB dictionary holds the binaries one after the other, so the CUDA kernels and libraries every binary links
statically are stored about once.
"""
import argparse
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bundle_shared_libs import SYSTEM  # noqa: E402  (glibc, libstdc++, libgcc_s: every system has them)

# Found on the GPU machine (the CUDA toolkit, the driver, PyTorch's wheels), never carried.
CUDA = re.compile(r"^(libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-|libnvrtc|libcusparse|libcufft)[.-]")
ROOT = "gpu_bundle"


def loaded_libraries(binaries):
    """{soname: path} of the non-system, non-CUDA libraries the binaries load, transitively (ldd)."""
    found = {}
    for b in binaries:
        out = subprocess.run(["ldd", b], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (not found|\S+)", line)
            if not m or SYSTEM.match(m.group(1)) or CUDA.match(m.group(1)):
                continue
            if m.group(2) == "not found":
                sys.exit("make_bundle.py: %s needs %s, which the loader cannot find" % (b, m.group(1)))
            found.setdefault(m.group(1), m.group(2))
    return found


def required_versions(paths, prefix):
    """The newest symbol version (e.g. GLIBC_2.34) the files need, as a string, or None."""
    best = None
    for p in paths:
        out = subprocess.run(["objdump", "-T", p], check=True, capture_output=True, text=True).stdout
        for v in re.findall(r"\b%s_([0-9.]+)\b" % prefix, out):
            key = tuple(int(x) for x in v.split("."))
            best = max(best or key, key)
    return None if best is None else "%s_%s" % (prefix, ".".join(map(str, best)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--script", required=True)
    ap.add_argument("--bin", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--file", action="append", default=[], metavar="REL=PATH")
    args = ap.parse_args()

    stage = tempfile.mkdtemp()
    files = {}  # path in the bundle -> file to pack
    bins = []
    for spec in args.bin:
        name, path = spec.split("=", 1)
        dest = os.path.join(stage, name)
        shutil.copyfile(path, dest)
        os.chmod(dest, 0o755)
        subprocess.run(["strip", "--strip-all", dest], check=True)
        files["bin/" + name] = dest
        bins.append(dest)
    for soname, path in sorted(loaded_libraries(bins).items()):
        files["lib/" + soname] = path
    for spec in args.file:
        rel, path = spec.split("=", 1)
        files[rel] = path
    files["gpu_check.sh"] = args.script

    elves = [p for rel, p in files.items() if rel.startswith(("bin/", "lib/"))]
    manifest = {
        "files": {rel: os.path.getsize(p) for rel, p in sorted(files.items())},
        "cuda_libraries_from_the_machine": sorted({m.group(1) for b in bins for m in re.finditer(
            r"^\s*(\S+) =>", subprocess.run(["ldd", b], capture_output=True, text=True).stdout, re.M)
            if CUDA.match(m.group(1))}),
        "needs": {"glibc": required_versions(elves, "GLIBC"), "libstdc++": required_versions(elves, "GLIBCXX")},
    }
    manifest_bytes = json.dumps(manifest, indent=2).encode() + b"\n"

    def add(tar, rel, data=None, path=None):
        info = tarfile.TarInfo("%s/%s" % (ROOT, rel))
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        if path is not None:
            info.size = os.path.getsize(path)
            info.mode = 0o755 if os.access(path, os.X_OK) or rel.endswith(".sh") else 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
        else:
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

    # A dictionary wider than the distance between two binaries' copies of the same code; preset 1's fast match finder
    # (19 MiB in half a minute, against preset 9's 17 MiB in three).
    lzma2 = [{"id": lzma.FILTER_LZMA2, "preset": 1, "dict_size": 64 << 20}]
    with lzma.open(args.out, "wb", filters=lzma2) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        add(tar, "manifest.json", data=manifest_bytes)
        for rel in sorted(files):
            add(tar, rel, path=files[rel])
    shutil.rmtree(stage)


if __name__ == "__main__":
    main()
