"""Compiler flags shared by every C++ target of seqgrad.

    load("//tools:copts.bzl", "SG_COPTS", "SG_TEST_COPTS", "CUDA_ONLY")

    cc_library(
        name = "matmul",
        srcs = ["matmul.cc"],
        hdrs = ["matmul.h"],
        copts = SG_COPTS,
        deps = ["//third_party:openblas", "//third_party:openmp"],
    )

-fopenmp must be in the copts of every library that uses `#pragma omp` (copts do not
propagate to dependents); //third_party:openmp supplies -fopenmp at link time.
"""

# -std=c++17 is also set globally in .bazelrc (--cxxopt); repeated here so the flags are
# right even for someone building without the project's .bazelrc.
SG_COPTS = [
    "-std=c++17",
    "-O3",
    "-fopenmp",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]

# Tests: same flags; gtest macros trip -Wextra's sign-compare in EXPECT_EQ(size_t, int).
SG_TEST_COPTS = SG_COPTS + ["-Wno-sign-compare"]

# target_compatible_with value for targets that only make sense with --config=cuda:
#     cc_binary(..., target_compatible_with = CUDA_ONLY)
# `bazel build //...` / `bazel test //...` then skip them quietly in the default build.
# (Anything depending on //third_party:cuda or a cuda_library is skipped automatically.)
CUDA_ONLY = select({
    "//tools:cuda": [],
    "//conditions:default": ["//tools:incompatible"],
})
