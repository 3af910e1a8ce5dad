// AdamW with decoupled weight decay and bias correction.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {

template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t count, double lr, double beta1, double beta2, double eps,
           double weight_decay, int64_t step) {
  const double c1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double c2 = 1.0 - std::pow(beta2, static_cast<double>(step));
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    m[i] = static_cast<T>(beta1 * m[i] + (1 - beta1) * g[i]);
    v[i] = static_cast<T>(beta2 * v[i] + (1 - beta2) * g[i] * g[i]);
    const double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + weight_decay * p[i];
    p[i] = static_cast<T>(p[i] - lr * update);
  }
}

void AdamWBF16(uint16_t* weights, float* master, const float* g, float* m, float* v, int64_t count, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  AdamW<float>(master, g, m, v, count, lr, beta1, beta2, eps, weight_decay, step);
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) weights[i] = F32ToBF16(master[i]);
}

template void AdamW<float>(float*, const float*, float*, float*, int64_t, double, double, double, double, double,
                           int64_t);
template void AdamW<double>(double*, const double*, double*, double*, int64_t, double, double, double, double, double,
                            int64_t);

}  // namespace sg::cpu
