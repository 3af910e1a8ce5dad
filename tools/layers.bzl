"""The layering of docs/design.md ("Layers of the code") for Bazel: who may depend on each layer, and the sources
//tools:layering_test checks.

    bindings/ -> cabi/ -> distributed/ -> core/ -> kernels/ -> base/      (cli/, examples/ and tests/ may use any)
"""

_ABOVE_DISTRIBUTED = [
    "//bindings/...",
    "//cabi/...",
    "//cli/...",
    "//examples/...",
    "//tests/...",
    "//tools/...",
]

# Packages that may depend on //distributed: not //base, //kernels or //core (core's tensor parallelism holds the
# //base:communicator interface).
DISTRIBUTED_USERS = _ABOVE_DISTRIBUTED + ["//distributed"]

# Packages that may depend on //core and //core/io: not //base or //kernels, but for //kernels/cuda, whose
# bf16_strategy tests run the engine's strategies on the CUDA backend (//tools:layering_test keeps its other sources
# off core/).
CORE_USERS = DISTRIBUTED_USERS + [
    "//core/...",
    "//kernels/cuda",
]

# Packages that may depend on the model families (//core:models) and what is built on them (//core:train, the
# //core aggregate, ...): CORE_USERS but //core/strategies, whose strategies see a model only through core/model.h
# (//core:model; //tools:layering_test checks their #include lines too).
FAMILY_USERS = DISTRIBUTED_USERS + [
    "//core",
    "//core/io",
    "//kernels/cuda",
]

# Packages that may depend on //kernels and its backends: all but //base.
KERNELS_USERS = DISTRIBUTED_USERS + [
    "//core/...",
    "//kernels/...",
]

def layer_sources():
    """The package's C++ and CUDA sources as :sources, the data of //tools:layering_test."""
    native.filegroup(
        name = "sources",
        srcs = native.glob([
            "**/*.cc",
            "**/*.cu",
            "**/*.cuh",
            "**/*.h",
            "**/*.inc",
        ]),
        visibility = ["//tools:__pkg__"],
    )
