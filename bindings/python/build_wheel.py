"""Builds seqgrad's self-contained wheel: packs the package, its native module and libseqgrad.so into a
linux_x86_64 wheel (PEP 427, with zipfile), then `auditwheel repair` copies every shared library they need outside
the manylinux policy (Abseil, OpenBLAS, libgomp, libgfortran, ...) into <dist>.libs/ and retags it.

usage: build_wheel.py [--cuda] OUT.whl VERSION PYTHON_TAG PLATFORM PATCHELF AUDITWHEEL_DIR _native.so libseqgrad.so
       libseqgrad_mpi.so NAME=FILE... (libseqgrad_mpi.so links the system OpenMPI, which is left out of the bundle)
  --cuda: the package of a --config=cuda build, distribution seqgrad-cu13: cuBLAS and NCCL come from NVIDIA's wheels
  (requirements of the wheel, not bundled), which its libraries and tools find in site-packages/nvidia/.
  PYTHON_TAG: cp310, cp311, ...: the CPython _native.so was built for. NAME=FILE: a file of the package under its
  path inside seqgrad/ (bin/train: the command-line tools, run by the `seqgrad` console script).
  OUT.whl's name must be what auditwheel names the repaired wheel (DIST-VERSION-TAG-TAG-PLATFORM.whl).
"""
import base64
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile

# What the tests run: Debian 12's NumPy 1.24 and PyPI's NumPy 2 (//bindings/python:seqgrad_numpy2_test).
NUMPY_REQUIREMENT = "numpy>=1.24,<3"
# `pip install 'seqgrad[data]'`: what seqgrad.data needs (the tokenizer, chat templates, saved datasets), from the
# releases //bindings/python:data_test runs.
DATA_REQUIREMENTS = ["transformers>=5.23,<6", "jinja2>=3.1", "datasets>=5.2"]
# seqgrad-cu13: the CUDA libraries it loads, from NVIDIA's wheels (the CUDA runtime is linked in statically), and
# where those wheels put them, relative to site-packages.
CUDA_REQUIREMENTS = ["nvidia-cublas>=13,<14", "nvidia-nccl-cu13>=2.27,<3"]
CUDA_LIBRARIES = ["libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2"]
CUDA_LIBRARY_DIRS = ["nvidia/cu13/lib", "nvidia/nccl/lib"]


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_zip(path, entries):
    """entries: (name in the wheel, bytes, executable), RECORD left out: it is written last, of the others."""
    dist = next(n.split("/")[0] for n, _, _ in entries if n.endswith(".dist-info/METADATA"))
    record = "".join("%s,%s,%d\n" % (p, _record_hash(d), len(d)) for p, d, _ in entries)
    entries = entries + [(dist + "/RECORD", (record + dist + "/RECORD,,\n").encode(), False)]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible
            info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16  # pip: regular file
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


def _write_wheel(path, dist_name, version, python_tag, files, cuda):
    """files: (name inside seqgrad/, local path). Tag linux_x86_64: the repair retags it."""
    dist = "%s-%s.dist-info" % (dist_name.replace("-", "_"), version)
    minor = int(python_tag[len("cp3"):])
    entries = []
    for name, local in files:
        with open(local, "rb") as fh:
            entries.append(("seqgrad/" + name, fh.read(), ".so" in name or name.startswith("bin/")))
    requires = [NUMPY_REQUIREMENT] + (CUDA_REQUIREMENTS if cuda else [])
    metadata = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
                "Summary: Exact-gradient long-sequence training of Llama/Qwen2 transformers (C ABI bindings)\n"
                "Requires-Python: >=3.%d,<3.%d\n" % (dist_name, version, minor, minor + 1))
    metadata += "".join("Requires-Dist: %s\n" % r for r in requires) + "Provides-Extra: data\n"
    metadata += "".join('Requires-Dist: %s; extra == "data"\n' % r for r in DATA_REQUIREMENTS)
    wheel = ("Wheel-Version: 1.0\nGenerator: seqgrad build_wheel.py\nRoot-Is-Purelib: false\n"
             "Tag: %s-%s-linux_x86_64\n" % (python_tag, python_tag))
    entry_points = "[console_scripts]\nseqgrad = seqgrad._cli:main\n"
    entries.append((dist + "/METADATA", metadata.encode(), False))
    entries.append((dist + "/WHEEL", wheel.encode(), False))
    entries.append((dist + "/entry_points.txt", entry_points.encode(), False))
    _write_zip(path, entries)


def _find_cuda_in_site_packages(wheel, patchelf, work):
    """Adds to every ELF file of the package a RUNPATH entry to each of CUDA_LIBRARY_DIRS, relative to the file."""
    with zipfile.ZipFile(wheel) as z:
        entries = [(i.filename, z.read(i), bool((i.external_attr >> 16) & 0o111)) for i in z.infolist()
                   if not i.filename.endswith((".dist-info/RECORD", "/"))]  # files only
    patched = []
    for name, data, executable in entries:
        if name.startswith("seqgrad/") and data[:4] == b"\x7fELF":
            local = os.path.join(work, "elf")
            with open(local, "wb") as fh:
                fh.write(data)
            up = "/".join([".."] * (name.count("/")))  # seqgrad/x -> .., seqgrad/bin/x -> ../..
            rpath = ":".join("$ORIGIN/%s/%s" % (up, d) for d in CUDA_LIBRARY_DIRS)
            subprocess.check_call([patchelf, "--add-rpath", rpath, local])
            with open(local, "rb") as fh:
                data = fh.read()
        patched.append((name, data, executable))
    _write_zip(wheel, patched)


def main():
    args = sys.argv[1:]
    cuda = args[:1] == ["--cuda"]
    if cuda:
        args = args[1:]
    out, version, python_tag, platform, patchelf, auditwheel, native, lib, mpi_plugin = args[:9]
    package_files = [arg.split("=", 1) for arg in args[9:]]
    dist_name = "seqgrad-cu13" if cuda else "seqgrad"
    work = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)))
    try:
        # libseqgrad.so goes in under its SONAME (what _native.so's DT_NEEDED asks for). _native.so finds it
        # beside itself: its Bazel RUNPATH (into bazel-out's _solib) is replaced by $ORIGIN. libseqgrad.so keeps
        # its RUNPATH to Debian's OpenMP OpenBLAS for auditwheel to find the right libopenblas; the repair
        # replaces it with <dist>.libs/ (auditwheel drops RUNPATH entries outside the wheel).
        soname = subprocess.check_output([patchelf, "--print-soname", lib], text=True).strip()
        native_copy = os.path.join(work, "_native.so")
        shutil.copyfile(native, native_copy)
        os.chmod(native_copy, 0o755)
        subprocess.check_call([patchelf, "--set-rpath", "$ORIGIN", native_copy])
        files = [(name, f) for name, f in package_files]
        # libseqgrad_mpi.so (tensor parallelism) beside libseqgrad.so, which loads it from there. It links the
        # system's OpenMPI, which is not bundled: a job must use the OpenMPI its mpirun belongs to.
        files += [("_native.so", native_copy), (soname, lib), ("libseqgrad_mpi.so", mpi_plugin)]
        plain = os.path.join(work, "%s-%s-%s-%s-linux_x86_64.whl" % (dist_name.replace("-", "_"), version,
                                                                     python_tag, python_tag))
        _write_wheel(plain, dist_name, version, python_tag, files, cuda)
        env = dict(os.environ, PYTHONPATH=auditwheel,
                   PATH=os.path.dirname(patchelf) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        repaired = os.path.join(work, "repaired")
        excluded = ["libmpi.so.40"] + (CUDA_LIBRARIES if cuda else [])
        run = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--plat", platform, "--only-plat"] +
                             [a for lib_name in excluded for a in ("--exclude", lib_name)] +
                             ["-w", repaired, plain], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        if run.returncode != 0:
            sys.exit("build_wheel.py: auditwheel repair failed:\n" + run.stdout)
        made = os.listdir(repaired)
        if made != [os.path.basename(out)]:
            sys.exit("build_wheel.py: auditwheel made %s, the BUILD file expects %s" % (made, os.path.basename(out)))
        if cuda:
            _find_cuda_in_site_packages(os.path.join(repaired, made[0]), patchelf, work)
        shutil.move(os.path.join(repaired, made[0]), out)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
