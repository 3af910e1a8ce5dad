// Host API of the CUDA smoke library (compiled by nvcc, callable from plain C++).
#pragma once

namespace sg::toolchain {

// Launches a real kernel computing y = a * x + y on n floats (device buffers allocated
// internally) and creates/destroys a cuBLAS handle. Returns 0 on success, otherwise a
// CUDA/cuBLAS error code. Needs a GPU at run time.
int CudaSmoke(int n, float a, float* max_error);

// True if the CUDA runtime sees at least one device.
bool CudaDeviceAvailable();

}  // namespace sg::toolchain
