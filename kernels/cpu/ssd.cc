// Mamba-2 (transformers' Mamba2Mixer): the SSD scan over a chunk with a carried state, forward and backward, and
// the gated group RMSNorm. The scan runs per head (OpenMP over heads, each head's sums in token order, so the
// results do not depend on the thread count); a head's state rows [head_dim][N] are contiguous. The backward keeps
// the states at sqrt(n)-spaced checkpoints (kernels/ssd_workspace.h), as gated_delta.cc does.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/ssd_workspace.h"

namespace sg::cpu {
namespace {

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Where one token's rows lie for head h of group h / (heads / groups).
struct SsdRows {
  int64_t heads, head_dim, groups, N;
  int64_t X(int64_t t, int64_t h) const { return (t * heads + h) * head_dim; }
  int64_t BC(int64_t t, int64_t h) const { return (t * groups + h / (heads / groups)) * N; }
  int64_t Gate(int64_t t, int64_t h) const { return t * heads + h; }
};

// One token's step size dt = clamp(softplus(raw + bias), lo, hi) (torch's softplus, threshold 20) and its
// derivative in raw (0 where the clamp binds: torch's clamp with scalar limits passes the gradient where
// lo < softplus < hi).
template <typename T>
struct TimeStep {
  T dt, grad;
  TimeStep(T raw, T bias, double lo, double hi) {
    const T v = raw + bias, sp = v > T(20) ? v : std::log1p(std::exp(v));
    dt = std::min(std::max(sp, T(lo)), T(hi));
    grad = sp > T(lo) && sp < T(hi) ? (v > T(20) ? T(1) : Sigmoid(v)) : T(0);
  }
};

// The per-head scalars of the scan.
template <typename T>
struct SsdHead {
  T A, D;  // -exp(A_log[h]); D[h] (0 when D is null)
  SsdHead(const T* A_log, const T* D_all, int64_t h) : A(-std::exp(A_log[h])), D(D_all ? D_all[h] : T(0)) {}
};

// The two loops over a state row where the scan spends its time, compiled for each ISA (kernels/cpu/isa.h) and
// picked once per call. Forward: row = decay src + u B, returns row . C. Backward (SsdTokenBackward): with
// g = ds + dy C (the gradient of the row after the token), dC += (decay src + u B) dy, dB += u g, ds = decay g;
// returns du = g . B and d decay = g . src.
template <typename T>
inline __attribute__((always_inline)) T StepRowBody(const T* src, T* row, const T* B, const T* C, T decay, T u,
                                                    int64_t N) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < N; ++j) {
    row[j] = decay * src[j] + u * B[j];
    acc += row[j] * C[j];
  }
  return acc;
}

template <typename T>
struct RowGrads {
  T du, ddecay;
};

template <typename T>
inline __attribute__((always_inline)) RowGrads<T> BackwardRowBody(const T* src, T* ds, const T* B, const T* C, T decay,
                                                                  T u, T dy, T* dC_row, T* dB_row, int64_t N) {
  T du = 0, dd = 0;
#pragma omp simd reduction(+ : du, dd)
  for (int64_t j = 0; j < N; ++j) {
    dC_row[j] += (decay * src[j] + u * B[j]) * dy;
    const T g = ds[j] + dy * C[j];
    du += g * B[j];
    dd += g * src[j];
    dB_row[j] += g * u;
    ds[j] = decay * g;
  }
  return {du, dd};
}

#define SG_ROW_KERNELS(suffix, target)                                                                               \
  template <typename T>                                                                                              \
  target T StepRow##suffix(const T* src, T* row, const T* B, const T* C, T decay, T u, int64_t N) {                  \
    return StepRowBody(src, row, B, C, decay, u, N);                                                                 \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  target RowGrads<T> BackwardRow##suffix(const T* src, T* ds, const T* B, const T* C, T decay, T u, T dy, T* dC_row, \
                                         T* dB_row, int64_t N) {                                                     \
    return BackwardRowBody(src, ds, B, C, decay, u, dy, dC_row, dB_row, N);                                          \
  }
SG_ROW_KERNELS(Avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,prefer-vector-width=512"))))
SG_ROW_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
SG_ROW_KERNELS(Generic, )
#undef SG_ROW_KERNELS

template <typename T>
struct RowKernels {
  T (*step)(const T*, T*, const T*, const T*, T, T, int64_t);
  RowGrads<T> (*backward)(const T*, T*, const T*, const T*, T, T, T, T*, T*, int64_t);
};

template <typename T>
RowKernels<T> RowKernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return {StepRowAvx512<T>, BackwardRowAvx512<T>};
    case Isa::kAvx2:
      return {StepRowAvx2<T>, BackwardRowAvx2<T>};
    case Isa::kGeneric:
      break;
  }
  return {StepRowGeneric<T>, BackwardRowGeneric<T>};
}

// S = exp(dt A) from + dt x_t B_t^T for token t of head h (`from` may be S); y_t = S C_t + D x_t unless y is null.
template <typename T>
void Step(const RowKernels<T>& k, const SsdRows& r, const T* x, const T* B, const T* C, const TimeStep<T>& ts,
          const SsdHead<T>& head, int64_t t, int64_t h, const T* from, T* S, T* y) {
  const int64_t P = r.head_dim, N = r.N;
  const T* xt = x + r.X(t, h);
  const T* Bt = B + r.BC(t, h);
  const T* Ct = C + r.BC(t, h);
  const T decay = std::exp(ts.dt * head.A);
  for (int64_t p = 0; p < P; ++p) {
    const T acc = k.step(from + p * N, S + p * N, Bt, Ct, decay, ts.dt * xt[p], N);
    if (y) y[r.X(t, h) + p] = acc + head.D * xt[p];
  }
}

// The gradients that flow out of token t of head h; the running state gradient dS (that of S_t from the later
// tokens) becomes that of S_{t-1}. prev = S_{t-1}. dC_row, dB_row [N] are this head's rows of token t; the per-head
// parameter gradients add into the sums of `acc`.
template <typename T>
struct SsdTokenBackward {
  const RowKernels<T>& k;
  const SsdRows& r;
  const T *dy, *x, *dt_raw, *dt_bias, *B, *C;
  double dt_min, dt_max;
  T *dx, *ddt_raw;

  struct Sums {
    T dt_bias = 0, A = 0, D = 0;  // d/d dt_bias, d/dA (A = -exp(A_log)), d/dD
  };

  void operator()(int64_t t, int64_t h, const SsdHead<T>& head, const T* prev, T* dS, T* dC_row, T* dB_row,
                  Sums& acc) const {
    const int64_t P = r.head_dim, N = r.N;
    const TimeStep<T> ts(dt_raw[r.Gate(t, h)], dt_bias[h], dt_min, dt_max);
    const T decay = std::exp(ts.dt * head.A);
    const T* xt = x + r.X(t, h);
    const T* dyt = dy + r.X(t, h);
    const T* Bt = B + r.BC(t, h);
    const T* Ct = C + r.BC(t, h);
    std::fill(dC_row, dC_row + N, T(0));
    std::fill(dB_row, dB_row + N, T(0));
    T ddt = 0, ddecay = 0;
    for (int64_t p = 0; p < P; ++p) {
      const T xp = xt[p], dyp = dyt[p];
      // y = S_t C + D x: dC += S_t^T dy, dS_t += dy C^T. S_t = decay S_{t-1} + u B^T (u = dt x): d decay,
      // du = dS_t B, dB += dS_t^T u, dS_{t-1} = decay dS_t.
      const RowGrads<T> g = k.backward(prev + p * N, dS + p * N, Bt, Ct, decay, ts.dt * xp, dyp, dC_row, dB_row, N);
      dx[r.X(t, h) + p] = head.D * dyp + ts.dt * g.du;
      ddt += xp * g.du;
      ddecay += g.ddecay;
      acc.D += dyp * xp;
    }
    // decay = exp(dt A)
    ddt += ddecay * decay * head.A;
    acc.A += ddecay * decay * ts.dt;
    ddt_raw[r.Gate(t, h)] = ddt * ts.grad;
    acc.dt_bias += ddt * ts.grad;
  }
};

template <typename T>
T Silu(T z) {
  return z * Sigmoid(z);
}

}  // namespace

int64_t SsdWorkspaceElems(int64_t n, int64_t heads, int64_t head_dim, int64_t /*groups*/, int64_t N) {
  return SsdLayout(n, heads, head_dim, N).elems;
}

template <typename T>
void SsdForward(const T* x, const T* dt_raw, const T* dt_bias, const T* A_log, const T* B, const T* C, const T* D,
                const T* s0, int64_t n, int64_t heads, int64_t head_dim, int64_t groups, int64_t N, double dt_min,
                double dt_max, T* y, T* s_final) {
  CheckSsdArguments(heads, groups, dt_min, dt_max, "ssd_forward");
  const SsdRows r{heads, head_dim, groups, N};
  const RowKernels<T> k = RowKernelsFor<T>(ActiveIsa());
  const int64_t state = head_dim * N;
#pragma omp parallel if (n * heads * state > 16384)
  {
    std::vector<T> S(state);
#pragma omp for
    for (int64_t h = 0; h < heads; ++h) {
      const SsdHead<T> head(A_log, D, h);
      CopyOrZero(s0 ? s0 + h * state : nullptr, state, S.data());
      for (int64_t t = 0; t < n; ++t)
        Step(k, r, x, B, C, TimeStep<T>(dt_raw[r.Gate(t, h)], dt_bias[h], dt_min, dt_max), head, t, h, S.data(),
             S.data(), y);
      if (s_final) std::copy(S.begin(), S.end(), s_final + h * state);
    }
  }
}

template <typename T>
void SsdBackward(const T* dy, const T* ds_final, const T* x, const T* dt_raw, const T* dt_bias, const T* A_log,
                 const T* B, const T* C, const T* D, const T* s0, int64_t n, int64_t heads, int64_t head_dim,
                 int64_t groups, int64_t N, double dt_min, double dt_max, T* dx, T* ddt_raw, T* ddt_bias, T* dA_log,
                 T* dB, T* dC, T* dD, T* ds0, T* workspace) {
  CheckSsdArguments(heads, groups, dt_min, dt_max, "ssd_backward");
  const SsdRows r{heads, head_dim, groups, N};
  const SsdWorkspace w = SsdLayout(n, heads, head_dim, N);
  const int64_t state = head_dim * N, block = w.block, blocks = w.blocks;
  T* dC_heads = workspace + w.dC_heads;
  T* dB_heads = workspace + w.dB_heads;
  const RowKernels<T> k = RowKernelsFor<T>(ActiveIsa());
  const SsdTokenBackward<T> backward{k, r, dy, x, dt_raw, dt_bias, B, C, dt_min, dt_max, dx, ddt_raw};
  auto step = [&](int64_t t, int64_t h, const SsdHead<T>& head, const T* from, T* S) {
    Step(k, r, x, B, C, TimeStep<T>(dt_raw[r.Gate(t, h)], dt_bias[h], dt_min, dt_max), head, t, h, from, S,
         static_cast<T*>(nullptr));
  };
#pragma omp parallel for if (n * heads * state > 16384)
  for (int64_t h = 0; h < heads; ++h) {
    const SsdHead<T> head(A_log, D, h);
    T* checkpoints = workspace + w.checkpoints + h * blocks * state;
    T* states = workspace + w.block_states + h * block * state;
    T* dS = workspace + w.state_grad + h * state;
    // The state at the start of every block.
    if (blocks > 0) CopyOrZero(s0 ? s0 + h * state : nullptr, state, checkpoints);
    for (int64_t b = 0; b + 1 < blocks; ++b) {
      T* next = checkpoints + (b + 1) * state;
      for (int64_t t = b * block; t < (b + 1) * block; ++t)
        step(t, h, head, t == b * block ? checkpoints + b * state : next, next);
    }
    // Blocks last to first: the states before each token recomputed, then walked backward.
    CopyOrZero(ds_final ? ds_final + h * state : nullptr, state, dS);
    typename SsdTokenBackward<T>::Sums sums;
    for (int64_t b = blocks - 1; b >= 0; --b) {
      const int64_t t0 = b * block, t1 = std::min(n, t0 + block);
      std::copy(checkpoints + b * state, checkpoints + (b + 1) * state, states);
      for (int64_t t = t0; t + 1 < t1; ++t) step(t, h, head, states + (t - t0) * state, states + (t - t0 + 1) * state);
      for (int64_t t = t1 - 1; t >= t0; --t)
        backward(t, h, head, states + (t - t0) * state, dS, dC_heads + r.Gate(t, h) * N, dB_heads + r.Gate(t, h) * N,
                 sums);
    }
    if (ds0) std::copy(dS, dS + state, ds0 + h * state);
    ddt_bias[h] += sums.dt_bias;
    dA_log[h] += sums.A * head.A;  // dA / dA_log = A
    if (D) dD[h] += sums.D;
  }
  SumOverHeadGroups(dC_heads, n, groups, heads, N, dC);
  SumOverHeadGroups(dB_heads, n, groups, heads, N, dB);
}

template <typename T>
int64_t SsdBackwardPairs(const T* dy, const T* x, const T* dt_raw, const T* dt_bias, const T* A_log, const T* B,
                         const T* C, const T* D, const T* s0, int64_t n, int64_t heads, int64_t head_dim,
                         int64_t groups, int64_t N, double dt_min, double dt_max, const T* later_dy,
                         const T* later_dt_raw, const T* later_C, int64_t later, int64_t window, T* dx, T* ddt_raw,
                         T* ddt_bias, T* dA_log, T* dB, T* dC, T* dD, T* workspace) {
  CheckSsdArguments(heads, groups, dt_min, dt_max, "ssd_backward_pairs");
  CheckPairsWindow(window, "ssd_backward_pairs");
  window = std::min(window, n + later + 1);  // past every token left it changes nothing, and i + window stays small
  const SsdRows r{heads, head_dim, groups, N};
  const SsdWorkspace w = SsdLayout(n, heads, head_dim, N);
  const int64_t state = head_dim * N, span = std::min(n + later, n - 1 + window);  // tokens any pair reads
  const int64_t pairs = SsdPairs(n, later, window);
  T* dC_heads = workspace + w.dC_heads;
  T* dB_heads = workspace + w.dB_heads;
  const RowKernels<T> k = RowKernelsFor<T>(ActiveIsa());
  const SsdTokenBackward<T> backward{k, r, dy, x, dt_raw, dt_bias, B, C, dt_min, dt_max, dx, ddt_raw};
  auto token = [&](const T* here, const T* after, int64_t t, int64_t width, int64_t offset) {
    return t < n ? here + t * width + offset : after + (t - n) * width + offset;
  };
#pragma omp parallel if (pairs * heads * state > 16384)
  {
    std::vector<T> decay(span);
#pragma omp for
    for (int64_t h = 0; h < heads; ++h) {
      const SsdHead<T> head(A_log, D, h);
      const int64_t g = h / (heads / groups);
      T* S = workspace + w.block_states + h * w.block * state;  // the state before token i
      T* dS = workspace + w.state_grad + h * state;
      for (int64_t t = 0; t < span; ++t)
        decay[t] =
            std::exp(TimeStep<T>(*token(dt_raw, later_dt_raw, t, heads, h), dt_bias[h], dt_min, dt_max).dt * head.A);
      CopyOrZero(s0 ? s0 + h * state : nullptr, state, S);
      typename SsdTokenBackward<T>::Sums sums;
      for (int64_t i = 0; i < n; ++i) {
        // The pairs (t, i), i < t < end_i: dS_i += exp(A (dt_{i+1} + ... + dt_t)) dy_t C_t^T, the product built one
        // factor at a time; the pair (i, i) is the token's own term, which the backward adds.
        std::fill(dS, dS + state, T(0));
        T lambda = 1;
        for (int64_t t = i + 1; t < std::min(span, i + window); ++t) {
          lambda *= decay[t];
          const T* dyt = token(dy, later_dy, t, heads * head_dim, h * head_dim);
          const T* Ct = token(C, later_C, t, groups * N, g * N);
          for (int64_t p = 0; p < head_dim; ++p) {
            const T a = lambda * dyt[p];
            T* row = dS + p * N;
#pragma omp simd
            for (int64_t j = 0; j < N; ++j) row[j] += a * Ct[j];
          }
        }
        // S holds S_{i-1}: the VJP of token i with the cotangent dS_i, then S steps on to S_i.
        backward(i, h, head, S, dS, dC_heads + r.Gate(i, h) * N, dB_heads + r.Gate(i, h) * N, sums);
        Step(k, r, x, B, C, TimeStep<T>(dt_raw[r.Gate(i, h)], dt_bias[h], dt_min, dt_max), head, i, h, S, S,
             static_cast<T*>(nullptr));
      }
      ddt_bias[h] += sums.dt_bias;
      dA_log[h] += sums.A * head.A;
      if (D) dD[h] += sums.D;
    }
  }
  SumOverHeadGroups(dC_heads, n, groups, heads, N, dC);
  SumOverHeadGroups(dB_heads, n, groups, heads, N, dB);
  return pairs;
}

template <typename T>
void GatedGroupRmsnormForward(const T* x, const T* z, const T* w, int64_t rows, int64_t dim, int64_t group_size,
                              double eps, T* out, T* rstd) {
  CheckNormGroups(dim, group_size, "gated_group_rmsnorm_forward");
  const int64_t per_row = dim / group_size;
#pragma omp parallel for if (rows * dim > 65536)
  for (int64_t i = 0; i < rows * per_row; ++i) {
    const int64_t at = i * group_size, col = i % per_row * group_size;  // a row's groups are consecutive
    double ss = 0;
    for (int64_t j = 0; j < group_size; ++j) {
      const T u = x[at + j] * Silu(z[at + j]);
      out[at + j] = u;
      ss += static_cast<double>(u) * u;
    }
    const T r = rstd[i] = static_cast<T>(1.0 / std::sqrt(ss / group_size + eps));
    for (int64_t j = 0; j < group_size; ++j) out[at + j] = w[col + j] * (out[at + j] * r);
  }
}

template <typename T>
void GatedGroupRmsnormBackward(const T* dout, const T* x, const T* z, const T* w, const T* rstd, int64_t rows,
                               int64_t dim, int64_t group_size, double /*eps*/, T* dx, T* dz, T* dw) {
  CheckNormGroups(dim, group_size, "gated_group_rmsnorm_backward");
  const int64_t per_row = dim / group_size;
  // out_j = w_j u_j r, r = (mean(u^2) + eps)^-1/2  =>  du_j = r w_j dout_j - u_j r^3 / G sum_k (w_k dout_k u_k);
  // u = x silu(z): dx = du silu(z), dz = du x silu'(z), silu'(z) = s (1 + z (1 - s)).
#pragma omp parallel for if (rows * dim > 65536)
  for (int64_t i = 0; i < rows * per_row; ++i) {
    const int64_t at = i * group_size, col = i % per_row * group_size;
    const double r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < group_size; ++j)
      dot += static_cast<double>(w[col + j]) * dout[at + j] * x[at + j] * Silu(z[at + j]);
    const double c = dot * r * r * r / group_size;
    for (int64_t j = 0; j < group_size; ++j) {
      const T zj = z[at + j], s = Sigmoid(zj), silu = zj * s, u = x[at + j] * silu;
      const T du = static_cast<T>(r * w[col + j] * dout[at + j] - c * u);
      dx[at + j] = du * silu;
      dz[at + j] = du * x[at + j] * s * (T(1) + zj * (T(1) - s));
    }
  }
  // dw_j += sum_i dout_ij u_ij r_i(group of j), over rows in a second pass so that no two threads write one cell.
#pragma omp parallel for if (rows * dim > 65536)
  for (int64_t j = 0; j < dim; ++j) {
    double acc = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = i * dim + j;
      acc += static_cast<double>(dout[at]) * x[at] * Silu(z[at]) * rstd[i * per_row + j / group_size];
    }
    dw[j] += static_cast<T>(acc);
  }
}

#define SG_INSTANTIATE(T)                                                                                              \
  template void SsdForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, int64_t, \
                              int64_t, int64_t, int64_t, int64_t, double, double, T*, T*);                             \
  template void SsdBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                               const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, T*,    \
                               T*, T*, T*, T*, T*, T*, T*, T*);                                                        \
  template int64_t SsdBackwardPairs<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, \
                                       const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,          \
                                       const T*, const T*, const T*, int64_t, int64_t, T*, T*, T*, T*, T*, T*, T*,     \
                                       T*);                                                                            \
  template void GatedGroupRmsnormForward<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, double, T*, T*);  \
  template void GatedGroupRmsnormBackward<T>(const T*, const T*, const T*, const T*, const T*, int64_t, int64_t,       \
                                             int64_t, double, T*, T*, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
