"""Packs the seqgrad package, its native module and libseqgrad.so into a wheel (PEP 427) with zipfile.

usage: build_wheel.py OUT.whl VERSION FILE... (files land in seqgrad/ under their base names)
"""
import base64
import hashlib
import os
import sys
import zipfile


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main():
    out, version, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    name = os.path.basename(out)
    tag = "-".join(name[:-len(".whl")].split("-")[2:])  # cp311-cp311-linux_x86_64
    dist = "seqgrad-%s.dist-info" % version
    entries = []
    for f in files:
        with open(f, "rb") as fh:
            entries.append(("seqgrad/" + os.path.basename(f), fh.read(), os.path.basename(f).endswith(".so")))
    metadata = ("Metadata-Version: 2.1\nName: seqgrad\nVersion: %s\n"
                "Summary: Exact-gradient long-sequence training of Llama/Qwen2 transformers (C ABI bindings)\n"
                "Requires-Python: >=3.11\nRequires-Dist: numpy\n" % version)
    wheel = "Wheel-Version: 1.0\nGenerator: seqgrad build_wheel.py\nRoot-Is-Purelib: false\nTag: %s\n" % tag
    entries.append((dist + "/METADATA", metadata.encode(), False))
    entries.append((dist + "/WHEEL", wheel.encode(), False))
    record = "".join("%s,%s,%d\n" % (p, _record_hash(d), len(d)) for p, d, _ in entries)
    record += dist + "/RECORD,,\n"
    entries.append((dist + "/RECORD", record.encode(), False))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data, executable in entries:
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


if __name__ == "__main__":
    main()
