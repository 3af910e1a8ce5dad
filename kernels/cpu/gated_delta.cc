// Gated DeltaNet (Qwen3-Next's linear attention): the gates and the gated delta rule over a chunk with a carried
// state, forward and backward. OpenMP over value heads; the loops over a state row (dv) are contiguous.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/gated_delta_workspace.h"

namespace sg::cpu {
namespace {

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// torch's softplus: the identity above 20.
template <typename T>
T Softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

// Where one token's rows lie for value head h; its key head is h / (v_heads / k_heads).
struct Rows {
  int64_t k_heads, v_heads, dk, dv;
  int64_t Key(int64_t t, int64_t h) const { return (t * k_heads + h / (v_heads / k_heads)) * dk; }
  int64_t Value(int64_t t, int64_t h) const { return (t * v_heads + h) * dv; }
  int64_t Gate(int64_t t, int64_t h) const { return t * v_heads + h; }
};

// One token of value head h: S = exp(g) from; u = S^T k; delta = beta (v - u); S += k delta^T; out = S^T q unless
// out is null. `from` may be S. u and delta [dv] are scratch.
template <typename T>
void Step(const Rows& r, const T* q, const T* k, const T* v, const T* g, const T* beta, int64_t t, int64_t h,
          const T* from, T* S, T* u, T* delta, T* out) {
  const int64_t dk = r.dk, dv = r.dv;
  const T* kt = k + r.Key(t, h);
  const T* vt = v + r.Value(t, h);
  const T e = std::exp(g[r.Gate(t, h)]), b = beta[r.Gate(t, h)];
  std::fill(u, u + dv, T(0));
  for (int64_t i = 0; i < dk; ++i) {
    const T* src = from + i * dv;
    T* row = S + i * dv;
    const T ki = kt[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] = e * src[j];
      u[j] += row[j] * ki;
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = b * (vt[j] - u[j]);
  if (!out) {
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * delta[j];
    return;
  }
  const T* qt = q + r.Key(t, h);
  T* o = out + r.Value(t, h);
  std::fill(o, o + dv, T(0));
  for (int64_t i = 0; i < dk; ++i) {
    T* row = S + i * dv;
    const T ki = kt[i], qi = qt[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      o[j] += row[j] * qi;
    }
  }
}

// The gradients that flow out of token t; the running state gradient dS (the gradient of S_t on entry) becomes
// that of S_{t-1}. prev = S_{t-1}; u, delta, ddelta [dv] scratch; dq, dk go to this value head's rows.
template <typename T>
struct TokenBackward {
  const Rows& r;
  const T *dout, *q, *k, *v, *g, *beta;
  T *dq_heads, *dk_heads, *dv_out, *dg, *dbeta;

  void operator()(int64_t t, int64_t h, const T* prev, T* dS, T* u, T* delta, T* ddelta) const {
    const int64_t n_dk = r.dk, n_dv = r.dv;
    const T* kt = k + r.Key(t, h);
    const T* qt = q + r.Key(t, h);
    const T* vt = v + r.Value(t, h);
    const T* dot = dout + r.Value(t, h);
    const T e = std::exp(g[r.Gate(t, h)]), b = beta[r.Gate(t, h)];
    T* dq_t = dq_heads + (t * r.v_heads + h) * n_dk;
    T* dk_t = dk_heads + (t * r.v_heads + h) * n_dk;
    // The forward's u and delta (P = e S_{t-1}).
    std::fill(u, u + n_dv, T(0));
    for (int64_t i = 0; i < n_dk; ++i)
      for (int64_t j = 0; j < n_dv; ++j) u[j] += e * prev[i * n_dv + j] * kt[i];
    for (int64_t j = 0; j < n_dv; ++j) delta[j] = b * (vt[j] - u[j]);
    // out = S_t^T q: dq = S_t dout, dS += q dout^T; then S_t = P + k delta^T: ddelta = dS^T k.
    std::fill(ddelta, ddelta + n_dv, T(0));
    for (int64_t i = 0; i < n_dk; ++i) {
      const T* p = prev + i * n_dv;
      T* ds = dS + i * n_dv;
      const T ki = kt[i], qi = qt[i];
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < n_dv; ++j) {
        acc += (e * p[j] + ki * delta[j]) * dot[j];
        ds[j] += qi * dot[j];
        ddelta[j] += ds[j] * ki;
      }
      dq_t[i] = acc;
    }
    // delta = beta (v - u): dv, dbeta; du = -beta ddelta.
    T db = 0;
    for (int64_t j = 0; j < n_dv; ++j) {
      db += (vt[j] - u[j]) * ddelta[j];
      dv_out[r.Value(t, h) + j] = b * ddelta[j];
      ddelta[j] *= -b;  // du from here on
    }
    dbeta[r.Gate(t, h)] = db;
    // dk = dS delta + P du (u = P^T k); dP = dS + k du^T; dg = sum(dP .* P); dS_{t-1} = e dP.
    const T* du = ddelta;
    T dgt = 0;
    for (int64_t i = 0; i < n_dk; ++i) {
      const T* p = prev + i * n_dv;
      T* ds = dS + i * n_dv;
      const T ki = kt[i];
      T acc = 0;
#pragma omp simd reduction(+ : acc, dgt)
      for (int64_t j = 0; j < n_dv; ++j) {
        const T pj = e * p[j];
        acc += ds[j] * delta[j] + pj * du[j];
        const T dp = ds[j] + ki * du[j];
        dgt += dp * pj;
        ds[j] = e * dp;
      }
      dk_t[i] = acc;
    }
    dg[r.Gate(t, h)] = dgt;
  }
};

}  // namespace

template <typename T>
void GdnGatesForward(const T* a, const T* b, const T* a_log, const T* dt_bias, int64_t n, int64_t heads, T* g,
                     T* beta) {
#pragma omp parallel for if (n * heads > 65536)
  for (int64_t i = 0; i < n * heads; ++i) {
    const int64_t h = i % heads;
    beta[i] = Sigmoid(b[i]);
    g[i] = -std::exp(a_log[h]) * Softplus(a[i] + dt_bias[h]);
  }
}

template <typename T>
void GdnGatesBackward(const T* dg, const T* dbeta, const T* a, const T* b, const T* a_log, const T* dt_bias, int64_t n,
                      int64_t heads, T* da, T* db, T* da_log, T* ddt_bias) {
#pragma omp parallel for if (n * heads > 65536)
  for (int64_t h = 0; h < heads; ++h) {
    const T A = -std::exp(a_log[h]);
    T sum_log = 0, sum_dt = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t i = t * heads + h;
      const T x = a[i] + dt_bias[h], s = Sigmoid(b[i]);
      db[i] = dbeta[i] * s * (T(1) - s);
      da[i] = dg[i] * A * (x > T(20) ? T(1) : Sigmoid(x));
      sum_dt += da[i];
      sum_log += dg[i] * A * Softplus(x);  // d g / d a_log = g
    }
    da_log[h] += sum_log;
    ddt_bias[h] += sum_dt;
  }
}

template <typename T>
void CopyOrZero(const T* src, int64_t count, T* dst) {
  if (src)
    std::copy(src, src + count, dst);
  else
    std::fill(dst, dst + count, T(0));
}

template <typename T>
void SumOverHeadGroups(const T* rows, int64_t n, int64_t groups, int64_t heads, int64_t width, T* dst) {
  const int64_t per = heads / groups;
#pragma omp parallel for if (n * heads * width > 65536)
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      T* out = dst + (t * groups + g) * width;
      const T* in = rows + (t * heads + g * per) * width;
      std::copy(in, in + width, out);
      for (int64_t r = 1; r < per; ++r)
        for (int64_t i = 0; i < width; ++i) out[i] += in[r * width + i];
    }
}

int64_t GatedDeltaWorkspaceElems(int64_t n, int64_t v_heads, int64_t dk, int64_t dv) {
  return GatedDeltaLayout(n, v_heads, dk, dv).elems;
}

template <typename T>
void GatedDeltaForward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* s0, int64_t n,
                       int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, T* out, T* s_final) {
  CheckGatedDeltaHeads(k_heads, v_heads, "gated_delta_forward");
  const Rows r{k_heads, v_heads, dk, dv};
  const int64_t state = dk * dv;
#pragma omp parallel if (n * v_heads * state > 16384)
  {
    std::vector<T> S(state), u(dv), delta(dv);
#pragma omp for
    for (int64_t h = 0; h < v_heads; ++h) {
      CopyOrZero(s0 ? s0 + h * state : nullptr, state, S.data());
      for (int64_t t = 0; t < n; ++t) Step(r, q, k, v, g, beta, t, h, S.data(), S.data(), u.data(), delta.data(), out);
      if (s_final) std::copy(S.begin(), S.end(), s_final + h * state);
    }
  }
}

template <typename T>
void GatedDeltaBackward(const T* dout, const T* ds_final, const T* q, const T* k, const T* v, const T* g, const T* beta,
                        const T* s0, int64_t n, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, T* dq,
                        T* dk_out, T* dv_out, T* dg, T* dbeta, T* ds0, T* workspace) {
  CheckGatedDeltaHeads(k_heads, v_heads, "gated_delta_backward");
  const Rows r{k_heads, v_heads, dk, dv};
  const GatedDeltaWorkspace w = GatedDeltaLayout(n, v_heads, dk, dv);
  const int64_t state = dk * dv;
  T* dq_heads = workspace + w.dq_heads;
  T* dk_heads = workspace + w.dk_heads;
  const TokenBackward<T> backward{r, dout, q, k, v, g, beta, dq_heads, dk_heads, dv_out, dg, dbeta};
#pragma omp parallel if (n * v_heads * state > 16384)
  {
    std::vector<T> u(dv), delta(dv), ddelta(dv);
#pragma omp for
    for (int64_t h = 0; h < v_heads; ++h) {
      T* checkpoints = workspace + w.checkpoints + h * w.blocks * state;
      T* states = workspace + w.block_states + h * w.block * state;
      T* dS = workspace + w.state_grad + h * state;
      // The state at the start of every block.
      if (w.blocks > 0) CopyOrZero(s0 ? s0 + h * state : nullptr, state, checkpoints);
      for (int64_t b = 0; b + 1 < w.blocks; ++b) {
        T* next = checkpoints + (b + 1) * state;
        for (int64_t t = b * w.block; t < (b + 1) * w.block; ++t)
          Step(r, q, k, v, g, beta, t, h, t == b * w.block ? checkpoints + b * state : next, next, u.data(),
               delta.data(), static_cast<T*>(nullptr));
      }
      // Blocks last to first: the states before each token recomputed, then walked backward.
      CopyOrZero(ds_final ? ds_final + h * state : nullptr, state, dS);
      for (int64_t b = w.blocks - 1; b >= 0; --b) {
        const int64_t t0 = b * w.block, t1 = std::min(n, t0 + w.block);
        std::copy(checkpoints + b * state, checkpoints + (b + 1) * state, states);
        for (int64_t t = t0; t + 1 < t1; ++t)
          Step(r, q, k, v, g, beta, t, h, states + (t - t0) * state, states + (t - t0 + 1) * state, u.data(),
               delta.data(), static_cast<T*>(nullptr));
        for (int64_t t = t1 - 1; t >= t0; --t)
          backward(t, h, states + (t - t0) * state, dS, u.data(), delta.data(), ddelta.data());
      }
      if (ds0) std::copy(dS, dS + state, ds0 + h * state);
    }
  }
  SumOverHeadGroups(dq_heads, n, k_heads, v_heads, dk, dq);
  SumOverHeadGroups(dk_heads, n, k_heads, v_heads, dk, dk_out);
}

#define SG_INSTANTIATE(T)                                                                                             \
  template void CopyOrZero<T>(const T*, int64_t, T*);                                                                 \
  template void SumOverHeadGroups<T>(const T*, int64_t, int64_t, int64_t, int64_t, T*);                               \
  template void GdnGatesForward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, T*, T*);                 \
  template void GdnGatesBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t, T*, \
                                    T*, T*, T*);                                                                      \
  template void GatedDeltaForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                     int64_t, int64_t, int64_t, T*, T*);                                              \
  template void GatedDeltaBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, \
                                      int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*, T*, T*, T*, T*, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
