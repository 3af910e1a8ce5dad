"""The one version of seqgrad: the C header (generated seqgrad/version.h), libseqgrad.so's SONAME, the wheel's
metadata and the jar's manifest all read it from here."""

SEQGRAD_VERSION = "0.7.0"

# libseqgrad.so.<SONAME_MAJOR>: bumped when the ABI breaks. 0.x releases are ABI-stable within a minor version,
# so the SONAME carries "0.<minor>".
SEQGRAD_SONAME = "libseqgrad.so." + ".".join(SEQGRAD_VERSION.split(".")[:2])
