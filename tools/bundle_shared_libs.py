"""Copies shared libraries, and every library they load that a Linux system cannot be assumed to have, into one
directory, each with RUNPATH $ORIGIN: the directory then works on a machine without this build's libraries.

usage: bundle_shared_libs.py OUT_DIR LIB...   (prints the names of the files it wrote)

Every file is named by its SONAME, the name the loader looks for. Kept from the system, as the manylinux policies do:
glibc's libraries, libstdc++ and libgcc_s (a JVM or Python has loaded its own already), and in a --config=cuda build
the CUDA driver, cuBLAS and NCCL (the machine's CUDA installation). Everything else that `ldd`
resolves (Abseil, OpenBLAS, libgomp, libgfortran, libquadmath, ...) is copied. Needs patchelf.
"""
import os
import re
import shutil
import subprocess
import sys

SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libmvec|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+"
                    r"|libgcc_s|libcuda|libcublas|libcublasLt|libnccl)[.-]")


def soname_of(lib):
    out = subprocess.run(["readelf", "-d", lib], check=True, capture_output=True, text=True).stdout
    m = re.search(r"\(SONAME\).*\[(.*)\]", out)
    return m.group(1) if m else os.path.basename(lib)


def resolved_deps(lib, names_in_bundle):
    """(soname, path) of every library `lib` loads, transitively, as the system loader resolves them."""
    out = subprocess.run(["ldd", lib], check=True, capture_output=True, text=True).stdout
    deps = []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+|not found)", line)
        if not m:
            continue
        soname, path = m.groups()
        if soname in names_in_bundle or SYSTEM.match(soname):
            continue
        if path == "not found":
            sys.exit("bundle_shared_libs.py: %s needs %s, which the loader cannot find" % (lib, soname))
        deps.append((soname, path))
    return deps


def main():
    out_dir, specs = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    libs = [(path, soname_of(path)) for path in specs]
    names = {name for _, name in libs}
    copies = {}
    for path, name in libs:
        copies[name] = path
        for soname, dep in resolved_deps(path, names):
            copies.setdefault(soname, dep)
    for name, path in sorted(copies.items()):
        dest = os.path.join(out_dir, name)
        shutil.copyfile(path, dest)
        os.chmod(dest, 0o755)
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN", dest], check=True)
    print("\n".join(sorted(copies)))


if __name__ == "__main__":
    main()
