"""gpu_bundle: tools/gpu_check.sh with its binaries and their non-CUDA shared libraries in one .tar.xz
(tools/gpu/make_bundle.py), for a GPU machine that has CUDA but no Bazel.

    gpu_bundle(name = "bundle", binaries = {"ops_test": "//kernels/cuda:ops_test", ...})  # -> bundle.tar.xz
"""

SCRIPTS = {
    "scripts/bench_torch_gpu.py": "//cli:bench_torch_gpu.py",
    "scripts/gpu_check_summary.py": "//tools/gpu:gpu_check_summary.py",
}

def gpu_bundle(name, binaries, **kwargs):
    """binaries: {name in the bundle's bin/: label of a cc_binary or cc_test}."""
    names = sorted(binaries)
    args = ["--bin %s=$(location %s)" % (n, binaries[n]) for n in names]
    args += ["--file %s=$(location %s)" % (rel, SCRIPTS[rel]) for rel in sorted(SCRIPTS)]
    native.genrule(
        name = name,
        srcs = [binaries[n] for n in names] + SCRIPTS.values() + ["//tools:gpu_check.sh"],
        outs = [name + ".tar.xz"],
        cmd = "python3 $(location //tools/gpu:make_bundle.py) $@ --script $(location //tools:gpu_check.sh) " +
              " ".join(args),
        tools = [
            "//tools/gpu:make_bundle.py",
            "//tools:bundle_shared_libs.py",
        ],
        message = "Packing the GPU check bundle " + name,
        **kwargs
    )
