// Row-wise and element-wise ops: embedding, RMSNorm, RoPE, bias, SwiGLU, residual add.
#include <cstring>
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/vexp.h"

namespace sg::cpu {

template <typename T>
void EmbeddingForward(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out) {
#pragma omp parallel for if (n * d > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const T* row = table + static_cast<int64_t>(ids[i]) * d;
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = row[j];
  }
}

template <typename T>
void EmbeddingBackward(const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable) {
  // Serial over tokens: repeated ids would race.
  for (int64_t i = 0; i < n; ++i) {
    T* row = dtable + static_cast<int64_t>(ids[i]) * d;
    for (int64_t j = 0; j < d; ++j) row[j] += dout[i * d + j];
  }
}

template <typename T>
void RmsNormForward(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd) {
#pragma omp parallel for if (n * d > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xi[j]) * xi[j];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / d + eps));
    rstd[i] = r;
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = xi[j] * r * w[j];
  }
}

template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx, T* dw,
                     bool accumulate_dx) {
  // y_j = x_j r w_j, r = (mean(x^2)+eps)^-1/2  =>  dx_j = r (w_j dy_j) - x_j r^3 / d * sum_k (w_k dy_k x_k)
#pragma omp parallel for if (n * d > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T* dyi = dy + i * d;
    const double r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += static_cast<double>(w[j]) * dyi[j] * xi[j];
    const double c = dot * r * r * r / d;
    T* dxi = dx + i * d;
    for (int64_t j = 0; j < d; ++j) {
      const T g = static_cast<T>(r * w[j] * dyi[j] - c * xi[j]);
      dxi[j] = accumulate_dx ? dxi[j] + g : g;
    }
  }
  // dw_j += sum_i dy_ij x_ij r_i, reduced over rows in a second pass so no two threads write one cell.
#pragma omp parallel for if (n * d > 65536)
  for (int64_t j = 0; j < d; ++j) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(dy[i * d + j]) * x[i * d + j] * rstd[i];
    dw[j] += static_cast<T>(acc);
  }
}

template <typename T>
void Rope(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq, bool inverse) {
  const int64_t half = head_dim / 2;
  const double sign = inverse ? -1.0 : 1.0;
#pragma omp parallel for if (n * heads * head_dim > 65536)
  for (int64_t i = 0; i < n; ++i) {
    std::vector<T> cs(half), sn(half);
    for (int64_t f = 0; f < half; ++f) {
      const double angle = static_cast<double>(pos0 + i) * inv_freq[f];
      cs[f] = static_cast<T>(std::cos(angle));
      sn[f] = static_cast<T>(sign * std::sin(angle));
    }
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + (i * heads + h) * head_dim;
      for (int64_t f = 0; f < half; ++f) {
        const T a = v[f], b = v[f + half];
        v[f] = a * cs[f] - b * sn[f];
        v[f + half] = b * cs[f] + a * sn[f];
      }
    }
  }
}

template <typename T>
void AddBias(T* y, const T* b, int64_t n, int64_t m) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) y[i * m + j] += b[j];
}

template <typename T>
void BiasBackward(const T* dy, int64_t n, int64_t m, T* db) {
  for (int64_t j = 0; j < m; ++j) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += dy[i * m + j];
    db[j] += static_cast<T>(acc);
  }
}

// f32 through vexp.h's polynomial exp, which vectorizes (std::exp on float is a scalar libm call); f64 keeps
// std::exp, the exactness reference.
static inline float Sigmoid(float x) { return 1.0f / (1.0f + ExpF32(-x)); }
static inline double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

template <typename T>
void SwigluForward(const T* gate, const T* up, int64_t count, T* out) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) out[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

template <typename T>
void SwigluBackward(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    const T g = gate[i], s = Sigmoid(g);
    const T silu = g * s;
    dup[i] = dout[i] * silu;
    dgate[i] = dout[i] * up[i] * (s + g * s * (T(1) - s));
  }
}

template <typename T>
void AddInplace(T* y, const T* x, int64_t count) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) y[i] += x[i];
}

template <typename T>
void Copy(T* dst, const T* src, int64_t count) {
  std::memcpy(dst, src, count * sizeof(T));
}

template <typename T>
void Fill(T* x, int64_t count, T value) {
  std::fill_n(x, count, value);
}

template <typename T>
void Scale(T* x, int64_t count, double factor) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) x[i] = static_cast<T>(x[i] * factor);
}

#define SG_INSTANTIATE(T)                                                                                   \
  template void EmbeddingForward<T>(const int32_t*, int64_t, const T*, int64_t, T*);                         \
  template void EmbeddingBackward<T>(const int32_t*, int64_t, const T*, int64_t, T*);                        \
  template void RmsNormForward<T>(const T*, const T*, int64_t, int64_t, double, T*, T*);                     \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, T*, T*, bool);  \
  template void Rope<T>(T*, int64_t, int64_t, int64_t, int64_t, const double*, bool);                        \
  template void AddBias<T>(T*, const T*, int64_t, int64_t);                                                  \
  template void BiasBackward<T>(const T*, int64_t, int64_t, T*);                                             \
  template void SwigluForward<T>(const T*, const T*, int64_t, T*);                                           \
  template void SwigluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                            \
  template void AddInplace<T>(T*, const T*, int64_t);                                                       \
  template void Copy<T>(T*, const T*, int64_t);                                                              \
  template void Fill<T>(T*, int64_t, T);                                                                     \
  template void Scale<T>(T*, int64_t, double);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
