"""cuda_library: compile .cu files with nvcc into a static archive wrapped by a cc_library.

    load("//tools:nvcc.bzl", "cuda_library")

    cuda_library(
        name = "attention_cuda",
        srcs = ["attention.cu"],            # .cu (and private .cuh/.h) files
        hdrs = ["attention_cuda.h"],         # host-callable API, visible to cc_* dependents
        deps = ["//base:dtype"],             # cc_library deps: headers/includes/defines reach nvcc
    )

    cc_binary(name = "bench", srcs = ["bench.cc"], deps = [":attention_cuda"])

* Includes are resolved from the repository root (`#include "base/dtype.h"`), the bin
  directory (generated headers) and every include path of `deps`; CUDA headers come from
  //third_party:cuda (always added to deps), which also links cuBLAS, cuBLASLt, NCCL and a
  static cudart.
* The library is only buildable with --config=cuda; in the default build it (and everything
  that depends on it) is incompatible and skipped quietly by `bazel build //...`.
* Each .cu file is compiled separately (whole-program mode, no -rdc): a kernel must be
  launched from the .cu file that defines it.
* Targets: sm_90 (+ compute_90 PTX for newer GPUs) and sm_80.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

CUDA_PATH = "/usr/local/cuda"

NVCC_FLAGS = [
    "-gencode",
    "arch=compute_90,code=[sm_90,compute_90]",
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-O3",
    "--std=c++17",
    "-Xcompiler",
    "-fPIC",
]

_HDR_EXTS = [".h", ".hh", ".hpp", ".hxx", ".inc", ".inl", ".cuh"]

def _object_path(ctx, src):
    # Unique per source, mirroring the source's path below the package.
    rel = src.short_path
    pkg = ctx.label.package
    if pkg and rel.startswith(pkg + "/"):
        rel = rel[len(pkg) + 1:]
    if rel.startswith("../"):  # source from an external repository
        rel = rel[3:]
    return "_cuda_objs/%s/%s.o" % (ctx.label.name, rel.rsplit(".", 1)[0])

def _cuda_archive_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    comp_ctxs = [d[CcInfo].compilation_context for d in ctx.attr.deps if CcInfo in d]

    headers = depset(
        [f for f in ctx.files.srcs if not f.basename.endswith(".cu")] + ctx.files.hdrs,
        transitive = [c.headers for c in comp_ctxs],
    )

    # Flags common to every .cu of this target.
    common = ctx.actions.args()
    common.add("-ccbin", cc_toolchain.compiler_executable)
    common.add_all(NVCC_FLAGS)
    # nvcc has no -iquote: quote and plain include paths both become -I.
    includes = depset(
        [".", ctx.bin_dir.path],
        transitive = [c.quote_includes for c in comp_ctxs] + [c.includes for c in comp_ctxs],
        order = "preorder",
    )
    system_includes = depset(transitive = [c.system_includes for c in comp_ctxs])
    defines = depset(ctx.attr.defines, transitive = [c.defines for c in comp_ctxs])
    common.add_all(includes, format_each = "-I%s", uniquify = True)
    common.add_all(system_includes, before_each = "-isystem", uniquify = True)
    common.add_all(defines, format_each = "-D%s", uniquify = True)
    common.add_all(ctx.attr.copts)

    objs = []
    for src in ctx.files.srcs:
        if not src.basename.endswith(".cu"):
            continue
        obj = ctx.actions.declare_file(_object_path(ctx, src))
        per_src = ctx.actions.args()
        per_src.add("-c", src)
        per_src.add("-o", obj)
        ctx.actions.run(
            executable = CUDA_PATH + "/bin/nvcc",
            arguments = [common, per_src],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc %s" % src.short_path,
            use_default_shell_env = True,
        )
        objs.append(obj)

    if not objs:
        fail("cuda_library %s: srcs contains no .cu file" % ctx.label)

    # Bazel links a ".lo" archive whole (alwayslink); a ".a" only for the symbols something references.
    archive = ctx.actions.declare_file("lib%s.%s" % (ctx.label.name, "lo" if ctx.attr.alwayslink else "a"))
    ar_args = ctx.actions.args()
    ar_args.add("rcsD")
    ar_args.add(archive)
    ar_args.add_all(objs)
    ctx.actions.run(
        executable = cc_toolchain.ar_executable,
        arguments = [ar_args],
        inputs = objs,
        outputs = [archive],
        mnemonic = "CudaArchive",
        progress_message = "ar %s" % archive.short_path,
        use_default_shell_env = True,
    )
    return [
        DefaultInfo(files = depset([archive])),
        OutputGroupInfo(objects = depset(objs)),
    ]

_cuda_archive = rule(
    implementation = _cuda_archive_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"] + _HDR_EXTS),
        "hdrs": attr.label_list(allow_files = _HDR_EXTS),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "defines": attr.string_list(),
        "alwayslink": attr.bool(default = False),
        "_cc_toolchain": attr.label(
            default = Label("@bazel_tools//tools/cpp:current_cc_toolchain"),
        ),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)

def cuda_library(
        name,
        srcs,
        hdrs = [],
        deps = [],
        copts = [],
        defines = [],
        alwayslink = False,
        **kwargs):
    """Compiles CUDA sources with nvcc; the result is a cc_library named `name`.

    Args:
      name: target name; cc_* targets depend on it like on any cc_library.
      srcs: .cu files (plus private .cuh/.h headers they include).
      hdrs: public headers (host API). .cuh headers are given to nvcc only (cc_library
        does not accept that extension).
      deps: cc_library deps (their headers, include paths and defines reach nvcc; they are
        also linked). //third_party:cuda is always added.
      copts: extra nvcc flags (e.g. ["-lineinfo"], ["--use_fast_math"]).
      defines: -D for nvcc and for dependents (like cc_library.defines).
      alwayslink: keep all objects even if no symbol is referenced (static registration).
      **kwargs: visibility, testonly, tags, target_compatible_with, ... for the cc_library.
    """
    all_deps = deps + ["//third_party:cuda"]
    archive = name + "_nvcc"
    _cuda_archive(
        name = archive,
        srcs = srcs,
        hdrs = hdrs,
        deps = all_deps,
        copts = copts,
        defines = defines,
        alwayslink = alwayslink,
        testonly = kwargs.get("testonly", False),
        tags = kwargs.get("tags", []),
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [":" + archive],
        hdrs = [h for h in hdrs if not h.endswith(".cuh")],
        deps = all_deps,
        defines = defines,
        alwayslink = alwayslink,
        linkstatic = True,
        **kwargs
    )
