// Row-wise and element-wise ops: embedding, RMSNorm, RoPE, bias, SwiGLU, the sigmoid output gate, residual add,
// copies of column blocks; and the fused layer ops (RoPE into the K/V page write, RMSNorm and SwiGLU with their bf16
// roundings).
#include <cstring>
#include <algorithm>
#include <cmath>
#include <type_traits>
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

// 1 / sqrt(mean(x^2) + eps) of one row, the sum in double.
template <typename T>
static T RowRstd(const T* x, int64_t d, double eps) {
  double ss = 0;
  for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[j]) * x[j];
  return static_cast<T>(1.0 / std::sqrt(ss / d + eps));
}

template <typename T>
void RmsNormForward(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd) {
#pragma omp parallel for if (n * d > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T r = rstd[i] = RowRstd(xi, d, eps);
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = xi[j] * r * w[j];
  }
}

// Rounds an f32 value to bf16 as F32ToBF16 does (nearest even, NaN kept quiet): returns the bits, x becomes their
// value. In 32-bit lanes throughout (signed compares, which SSE2 has), so that the loops around it vectorize well.
static inline uint16_t Round(float& x) {
  int32_t u;
  std::memcpy(&u, &x, 4);
  const int32_t rounded = (u & 0x7fffffff) > 0x7f800000 ? u | 0x400000 : u + 0x7fff + ((u >> 16) & 1);
  const int32_t top = rounded & ~0xffff;
  std::memcpy(&x, &top, 4);
  return static_cast<uint16_t>(static_cast<uint32_t>(top) >> 16);
}

// kHalf: the bits are stored too. A template parameter, not a test in the loop: a conditional store keeps the
// loop from vectorizing.
template <bool kHalf>
static void RmsNormForwardRounded(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y,
                                  float* rstd, uint16_t* half) {
#pragma omp parallel for if (n * d > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * d;
    const float r = rstd[i] = RowRstd(xi, d, eps);
    float* yi = y + i * d;
    for (int64_t j = 0; j < d; ++j) {
      yi[j] = xi[j] * r * w[j];
      const uint16_t h = Round(yi[j]);
      if constexpr (kHalf) half[i * d + j] = h;
    }
  }
}

void RmsNormForwardBF16(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y, float* rstd,
                        uint16_t* half) {
  if (half) RmsNormForwardRounded<true>(x, w, n, d, eps, y, rstd, half);
  else RmsNormForwardRounded<false>(x, w, n, d, eps, y, rstd, half);
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

// RoPE's cos and sign * sin at position pos for the half = head_dim / 2 frequencies, angles in double.
template <typename T>
static void RopeAngles(int64_t pos, const double* inv_freq, int64_t half, double sign, T* cs, T* sn) {
  for (int64_t f = 0; f < half; ++f) {
    const double angle = static_cast<double>(pos) * inv_freq[f];
    cs[f] = static_cast<T>(std::cos(angle));
    sn[f] = static_cast<T>(sign * std::sin(angle));
  }
}

// One token's heads [heads][2 * half] rotated from x into y (which may be x), each value stored through put.
template <typename T, typename Y, typename Put>
static void RotateHeads(const T* x, int64_t heads, int64_t half, const T* cs, const T* sn, Y* y, Put put) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* v = x + h * 2 * half;
    Y* out = y + h * 2 * half;
    for (int64_t f = 0; f < half; ++f) {
      const T a = v[f], b = v[f + half];
      put(out[f], a * cs[f] - b * sn[f]);
      put(out[f + half], b * cs[f] + a * sn[f]);
    }
  }
}

template <typename T>
void Rope(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq, bool inverse) {
  const int64_t half = head_dim / 2;
#pragma omp parallel if (n * heads * head_dim > 65536)
  {
    std::vector<T> cs(half), sn(half);
#pragma omp for
    for (int64_t i = 0; i < n; ++i) {
      RopeAngles(pos0 + i, inv_freq, half, inverse ? -1.0 : 1.0, cs.data(), sn.data());
      T* v = x + i * heads * head_dim;
      RotateHeads(v, heads, half, cs.data(), sn.data(), v, [](T& out, T value) { out = value; });
    }
  }
}

// A value as a page of element type P stores it: itself, or rounded to bf16 bits.
template <typename P, typename T>
static inline void PutPage(P& out, T value) {
  if constexpr (std::is_same_v<P, uint16_t>) out = F32ToBF16(value);
  else out = value;
}

template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv) {
  const int64_t half = kv.head_dim / 2, row = kv.kv_heads * kv.head_dim;
#pragma omp parallel if (n * row > 65536)
  {
    std::vector<T> cs(half), sn(half);
#pragma omp for
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = pos0 + i, logical = t / kv.page_size;
      if (!kv.has_page(logical)) continue;
      const int64_t off = (t % kv.page_size) * row;
      P* dk = kv.k_page(logical) + off;
      P* dv = kv.v_page(logical) + off;
      RopeAngles(t, inv_freq, half, 1.0, cs.data(), sn.data());
      RotateHeads(k + i * row, kv.kv_heads, half, cs.data(), sn.data(), dk, [](P& out, T x) { PutPage(out, x); });
      for (int64_t j = 0; j < row; ++j) PutPage(dv[j], v[i * row + j]);
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

// x rounded to bf16 values in place (count values), their bits to half unless null.
static void RoundRow(float* x, int64_t count, uint16_t* half) {
  if (half) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) half[i] = Round(x[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) Round(x[i]);
  }
}

// Blocks small enough for L1: gate and up rounded into block buffers, swiglu's loop as swiglu_forward runs it, out
// rounded where it was written. Each loop stays simple enough to vectorize well (one fused loop ran 2x slower).
void SwigluForwardBF16(const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                       uint16_t* up_half, uint16_t* out_half) {
  constexpr int64_t kBlock = 1024;
  const int64_t blocks = (count + kBlock - 1) / kBlock;
#pragma omp parallel for if (count > 65536)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kBlock, len = std::min(kBlock, count - at);
    float g[kBlock], u[kBlock];
    std::memcpy(g, gate + at, len * sizeof(float));
    std::memcpy(u, up + at, len * sizeof(float));
    RoundRow(g, len, gate_half ? gate_half + at : nullptr);
    RoundRow(u, len, up_half ? up_half + at : nullptr);
    float* o = out + at;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) o[i] = g[i] * Sigmoid(g[i]) * u[i];
    RoundRow(o, len, out_half ? out_half + at : nullptr);
  }
}

// d/dgate and d/dup of silu(g) u given dout.
template <typename T>
static inline void SwigluGrad(T dout, T g, T u, T& dgate, T& dup) {
  const T s = Sigmoid(g);
  const T silu = g * s;
  dup = dout * silu;
  dgate = dout * u * (s + g * s * (T(1) - s));
}

template <typename T>
void SwigluBackward(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) SwigluGrad(dout[i], gate[i], up[i], dgate[i], dup[i]);
}

void SwigluBackwardBF16(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count, float* dgate,
                        float* dup) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) SwigluGrad(dout[i], BF16ToF32(gate[i]), BF16ToF32(up[i]), dgate[i], dup[i]);
}

// Gated attention's output gate: out = sigmoid(gate) x.
template <typename T>
void SigmoidGateForward(const T* gate, const T* x, int64_t count, T* out) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) out[i] = Sigmoid(gate[i]) * x[i];
}

// Reads every input of element i before writing it (dx or dgate may be dout's buffer).
template <typename T>
void SigmoidGateBackward(const T* dout, const T* gate, const T* x, int64_t count, T* dgate, T* dx) {
#pragma omp parallel for simd if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    const T s = Sigmoid(gate[i]), d = dout[i], xi = x[i];
    dgate[i] = d * xi * s * (T(1) - s);
    dx[i] = d * s;
  }
}

template <typename T>
void CopyRows(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ld_dst, src + r * ld_src, cols * sizeof(T));
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
  template void SigmoidGateForward<T>(const T*, const T*, int64_t, T*);                                     \
  template void SigmoidGateBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                      \
  template void CopyRows<T>(T*, int64_t, const T*, int64_t, int64_t, int64_t);                              \
  template void AddInplace<T>(T*, const T*, int64_t);                                                       \
  template void Copy<T>(T*, const T*, int64_t);                                                              \
  template void Fill<T>(T*, int64_t, T);                                                                     \
  template void Scale<T>(T*, int64_t, double);                                                              \
  template void RopeKvWrite<T, T>(const T*, const T*, int64_t, int64_t, const double*, const PagedKV<T>&);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE
template void RopeKvWrite<float, uint16_t>(const float*, const float*, int64_t, int64_t, const double*,
                                           const PagedKV<uint16_t>&);

}  // namespace sg::cpu
