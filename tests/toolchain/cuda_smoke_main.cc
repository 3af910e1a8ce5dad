// Runs the CUDA smoke library; exits 0 with a message when no GPU is present.
#include <cstdio>

#include "tests/toolchain/cuda_smoke.h"

int main() {
  if (!sg::toolchain::CudaDeviceAvailable()) {
    std::printf("cuda_smoke: no CUDA device; linked fine, nothing to run\n");
    return 0;
  }
  float max_error = -1.0f;
  int rc = sg::toolchain::CudaSmoke(1 << 20, 3.0f, &max_error);
  std::printf("cuda_smoke: rc=%d max_error=%g\n", rc, max_error);
  return (rc == 0 && max_error == 0.0f) ? 0 : 1;
}
