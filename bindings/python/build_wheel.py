"""Builds seqgrad's self-contained wheel: packs the package, its native module and libseqgrad.so into a
linux_x86_64 wheel (PEP 427, with zipfile), then `auditwheel repair` copies every shared library they need outside
the manylinux policy (Abseil, OpenBLAS, libgomp, libgfortran, ...) into seqgrad.libs/ and retags it.

usage: build_wheel.py OUT.whl VERSION PYTHON_TAG PLATFORM PATCHELF AUDITWHEEL_DIR _native.so libseqgrad.so
       libseqgrad_mpi.so NAME=FILE... (libseqgrad_mpi.so links the system OpenMPI, which is left out of the bundle)
  PYTHON_TAG: cp310, cp311, ...: the CPython _native.so was built for. NAME=FILE: a file of the package under its
  path inside seqgrad/ (bin/train: the command-line tools, run by the `seqgrad` console script).
  OUT.whl's name must be what auditwheel names the repaired wheel (seqgrad-VERSION-TAG-TAG-PLATFORM.whl).
"""
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

# What the tests run: Debian 12's NumPy 1.24 and PyPI's NumPy 2 (//bindings/python:seqgrad_numpy2_test).
NUMPY_REQUIREMENT = "numpy>=1.24,<3"
# `pip install 'seqgrad[data]'`: what seqgrad.data needs (the tokenizer, chat templates, saved datasets), from the
# releases //bindings/python:data_test runs.
DATA_REQUIREMENTS = ["transformers>=5.23,<6", "jinja2>=3.1", "datasets>=5.2"]


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(path, version, python_tag, files):
    """files: (name inside seqgrad/, local path). Tag linux_x86_64: the repair retags it."""
    dist = "seqgrad-%s.dist-info" % version
    minor = python_tag[len("cp3"):]
    entries = []
    for name, local in files:
        with open(local, "rb") as fh:
            entries.append(("seqgrad/" + name, fh.read(), ".so" in name or name.startswith("bin/")))
    metadata = ("Metadata-Version: 2.1\nName: seqgrad\nVersion: %s\n"
                "Summary: Exact-gradient long-sequence training of Llama/Qwen2 transformers (C ABI bindings)\n"
                "Requires-Python: >=3.%s,<3.%d\nRequires-Dist: %s\nProvides-Extra: data\n"
                % (version, minor, int(minor) + 1, NUMPY_REQUIREMENT))
    metadata += "".join('Requires-Dist: %s; extra == "data"\n' % r for r in DATA_REQUIREMENTS)
    wheel = ("Wheel-Version: 1.0\nGenerator: seqgrad build_wheel.py\nRoot-Is-Purelib: false\n"
             "Tag: %s-%s-linux_x86_64\n" % (python_tag, python_tag))
    entry_points = "[console_scripts]\nseqgrad = seqgrad._cli:main\n"
    entries.append((dist + "/METADATA", metadata.encode(), False))
    entries.append((dist + "/entry_points.txt", entry_points.encode(), False))
    entries.append((dist + "/WHEEL", wheel.encode(), False))
    record = "".join("%s,%s,%d\n" % (p, _record_hash(d), len(d)) for p, d, _ in entries)
    record += dist + "/RECORD,,\n"
    entries.append((dist + "/RECORD", record.encode(), False))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


def main():
    out, version, python_tag, platform, patchelf, auditwheel, native, lib, mpi_plugin = sys.argv[1:10]
    package_files = [arg.split("=", 1) for arg in sys.argv[10:]]
    work = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)))
    try:
        # libseqgrad.so goes in under its SONAME (what _native.so's DT_NEEDED asks for). _native.so finds it
        # beside itself: its Bazel RUNPATH (into bazel-out's _solib) is replaced by $ORIGIN. libseqgrad.so keeps
        # its RUNPATH to Debian's OpenMP OpenBLAS for auditwheel to find the right libopenblas; the repair
        # replaces it with seqgrad.libs/ (auditwheel drops RUNPATH entries outside the wheel).
        soname = subprocess.check_output([patchelf, "--print-soname", lib], text=True).strip()
        native_copy = os.path.join(work, "_native.so")
        shutil.copyfile(native, native_copy)
        os.chmod(native_copy, 0o755)
        subprocess.check_call([patchelf, "--set-rpath", "$ORIGIN", native_copy])
        files = [(name, f) for name, f in package_files]
        # libseqgrad_mpi.so (tensor parallelism) beside libseqgrad.so, which loads it from there. It links the
        # system's OpenMPI, which is not bundled: a job must use the OpenMPI its mpirun belongs to.
        files += [("_native.so", native_copy), (soname, lib), ("libseqgrad_mpi.so", mpi_plugin)]
        plain = os.path.join(work, "seqgrad-%s-%s-%s-linux_x86_64.whl" % (version, python_tag, python_tag))
        _write_wheel(plain, version, python_tag, files)
        env = dict(os.environ, PYTHONPATH=auditwheel,
                   PATH=os.path.dirname(patchelf) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        repaired = os.path.join(work, "repaired")
        run = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--plat", platform, "--only-plat",
                              "--exclude", "libmpi.so.40", "-w", repaired, plain], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        if run.returncode != 0:
            sys.exit("build_wheel.py: auditwheel repair failed:\n" + run.stdout)
        made = os.listdir(repaired)
        if made != [os.path.basename(out)]:
            sys.exit("build_wheel.py: auditwheel made %s, the BUILD file expects %s" % (made, os.path.basename(out)))
        shutil.move(os.path.join(repaired, made[0]), out)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
