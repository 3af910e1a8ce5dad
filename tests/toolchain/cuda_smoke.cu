// CUDA smoke test: a real kernel plus cuBLAS, built by //tools:nvcc.bzl cuda_library.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "tests/toolchain/cuda_smoke.h"  // repository-root include, as core/ headers are
#include "tests/toolchain/smoke_defs.h"  // from a cc_library dep

namespace sg::toolchain {
namespace {

__global__ void SaxpyKernel(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

int CudaSmoke(int n, float a, float* max_error) {
  cublasHandle_t handle = nullptr;
  cublasStatus_t st = cublasCreate(&handle);
  if (st != CUBLAS_STATUS_SUCCESS) return 1000 + static_cast<int>(st);
  cublasDestroy(handle);

  std::vector<float> x(n, 1.0f), y(n, 2.0f);
  float *dx = nullptr, *dy = nullptr;
  cudaError_t err = cudaMalloc(&dx, n * sizeof(float));
  if (err == cudaSuccess) err = cudaMalloc(&dy, n * sizeof(float));
  if (err == cudaSuccess) err = cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) {
    SaxpyKernel<<<(n + kSmokeBlock - 1) / kSmokeBlock, kSmokeBlock>>>(n, a, dx, dy);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(dy);
  if (err != cudaSuccess) return static_cast<int>(err);
  float worst = 0.0f;
  for (float v : y) worst = std::fmax(worst, std::fabs(v - (a + 2.0f)));
  *max_error = worst;
  return 0;
}

}  // namespace sg::toolchain
