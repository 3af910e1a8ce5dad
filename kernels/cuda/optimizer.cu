// AdamW with decoupled weight decay and bias correction, as kernels/cpu/optimizer.cc: the bias corrections are
// computed once on the host in double, the update in double per element (the CPU's precision), stored as T.
// --dtype=bf16: the same update of the fp32 masters, then the bf16 weights rounded from them.
#include <cmath>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;

// weights (may be null): bf16 copies of p, rounded from the updated fp32 masters (--dtype=bf16).
template <typename T>
__global__ void AdamWKernel(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2,
                            double eps, double weight_decay, double c1, double c2, uint16_t* weights) {
  SG_CUDA_LOOP(i, count) {
    const double gi = g[i];
    const T mi = static_cast<T>(beta1 * m[i] + (1 - beta1) * gi);
    const T vi = static_cast<T>(beta2 * v[i] + (1 - beta2) * gi * gi);
    m[i] = mi;
    v[i] = vi;
    // m_hat / (sqrt(v_hat) + eps) from the stored (rounded) moments, as the CPU reads them back.
    const double update = (mi / c1) / (sqrt(vi / c2) + eps) + weight_decay * p[i];
    p[i] = static_cast<T>(p[i] - lr * update);
    if (weights) weights[i] = ToBf16(static_cast<float>(p[i]));
  }
}

template <typename T>
void Launch(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
            double weight_decay, int64_t step, uint16_t* weights, const char* op) {
  if (count <= 0) return;
  const double c1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double c2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamWKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(p, g, m, v, count, lr, beta1, beta2, eps,
                                                                     weight_decay, c1, c2, weights);
  End(op);
}

}  // namespace

template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
           double weight_decay, int64_t step) {
  Launch(p, g, m, v, count, lr, beta1, beta2, eps, weight_decay, step, nullptr, "adamw");
}

void AdamWBF16(uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  Launch(master, g, m, v, count, lr, beta1, beta2, eps, weight_decay, step, weights, "adamw_bf16");
}

template void AdamW<float>(float*, const float*, float*, float*, int64_t, double, double, double, double, double,
                           int64_t);
template void AdamW<double>(double*, const double*, double*, double*, int64_t, double, double, double, double, double,
                            int64_t);

}  // namespace sg::cuda
