"""The CUDA backend's sources: one list for //kernels/cuda:cuda (nvcc) and its CPU emulation (g++)."""

CUDA_SRCS = [
    "attention.cu",
    "attention.cuh",
    "attention_merge.cu",
    "attention_tc.cu",
    "bf16.cuh",
    "chunk_ops.cu",
    "common.cuh",
    "cuda_ops.cuh",
    "gated_delta.cu",
    "gemm.cu",
    "loss.cu",
    "mma.cuh",
    "moe.cu",
    "optimizer.cu",
    "pointwise.cu",
    "runtime.cu",
    "ssd.cu",
    "ssm.cu",
    "table.cu",
    "vocab_parallel.cu",
]
