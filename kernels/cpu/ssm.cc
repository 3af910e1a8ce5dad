// State-space model ops (Mamba-1): causal depthwise conv1d with a carried tail, the selective scan with a carried
// state, and the element-wise SiLU / softplus around them. OpenMP over channels.
#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {

// xx = tail[k-1] ++ x[n]: row r of xx for one channel c.
template <typename T>
static inline T ConvInput(const T* x, const T* tail, int64_t r, int64_t ch, int64_t k, int64_t c) {
  return r < k - 1 ? (tail ? tail[r * ch + c] : T(0)) : x[(r - (k - 1)) * ch + c];
}

template <typename T>
void Conv1dForward(const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch, int64_t k, T* y,
                   T* tail_out) {
#pragma omp parallel for if (n * ch * k > 65536)
  for (int64_t c = 0; c < ch; ++c) {
    const T* wc = w + c * k;
    for (int64_t t = 0; t < n; ++t) {
      T acc = b ? b[c] : T(0);
      for (int64_t j = 0; j < k; ++j) acc += wc[j] * ConvInput(x, tail_in, t + j, ch, k, c);
      y[t * ch + c] = acc;
    }
    if (tail_out)
      for (int64_t r = 0; r < k - 1; ++r) tail_out[r * ch + c] = ConvInput(x, tail_in, n + r, ch, k, c);
  }
}

template <typename T>
void Conv1dBackward(const T* dy, const T* dtail_out, const T* x, const T* tail_in, const T* w, int64_t n, int64_t ch,
                    int64_t k, T* dx, T* dtail_in, T* dw, T* db) {
  const int64_t rows = n + k - 1;
#pragma omp parallel if (n * ch * k > 65536)
  {
    std::vector<T> dxx(rows);
#pragma omp for
    for (int64_t c = 0; c < ch; ++c) {
      std::fill(dxx.begin(), dxx.end(), T(0));
      // The output tail is rows [n, n + k - 1) of xx.
      if (dtail_out)
        for (int64_t r = 0; r < k - 1; ++r) dxx[n + r] += dtail_out[r * ch + c];
      const T* wc = w + c * k;
      T* dwc = dw + c * k;
      T dbc = 0;
      for (int64_t t = 0; t < n; ++t) {
        const T g = dy[t * ch + c];
        dbc += g;
        for (int64_t j = 0; j < k; ++j) {
          dxx[t + j] += wc[j] * g;
          dwc[j] += g * ConvInput(x, tail_in, t + j, ch, k, c);
        }
      }
      if (db) db[c] += dbc;
      for (int64_t r = 0; r < k - 1; ++r)
        if (dtail_in) dtail_in[r * ch + c] = dxx[r];
      for (int64_t t = 0; t < n; ++t) dx[t * ch + c] = dxx[t + k - 1];
    }
  }
}

// Per-thread partial sums of an array of `count` (dB and dC sum over channels): each thread accumulates into its
// own, and SumInto adds them in thread order (deterministic); a thread the runtime did not start adds nothing.
template <typename T>
class ThreadPartials {
 public:
  ThreadPartials(int threads, int64_t count) : parts_(threads), count_(count) {}
  std::vector<T>& Mine() {
    std::vector<T>& p = parts_[omp_get_thread_num()];
    p.assign(count_, T(0));
    return p;
  }
  void SumInto(T* out) const {
    for (int64_t i = 0; i < count_; ++i) {
      T sum = 0;
      for (const std::vector<T>& p : parts_)
        if (!p.empty()) sum += p[i];
      out[i] = sum;
    }
  }

 private:
  std::vector<std::vector<T>> parts_;
  int64_t count_;
};

// One channel's forward recurrence; writes h_t into hs[t][N] when hs is given.
template <typename T>
static void ScanChannel(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* h0, int64_t n,
                        int64_t dim, int64_t N, int64_t d, T* h, T* hs, T* y, T Dd) {
  const T* Ad = A + d * N;
  for (int64_t s = 0; s < N; ++s) h[s] = h0 ? h0[d * N + s] : T(0);
  for (int64_t t = 0; t < n; ++t) {
    const T dt = delta[t * dim + d], ut = u[t * dim + d];
    T acc = 0;
    for (int64_t s = 0; s < N; ++s) {
      h[s] = std::exp(dt * Ad[s]) * h[s] + dt * B[t * N + s] * ut;
      acc += C[t * N + s] * h[s];
    }
    if (hs) std::copy(h, h + N, hs + t * N);
    if (y) y[t * dim + d] = acc + Dd * ut;
  }
}

template <typename T>
void SelectiveScanForward(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D, const T* h0,
                          int64_t n, int64_t dim, int64_t N, T* y, T* h_final) {
#pragma omp parallel if (n * dim * N > 16384)
  {
    std::vector<T> h(N);
#pragma omp for
    for (int64_t d = 0; d < dim; ++d) {
      ScanChannel(u, delta, A, B, C, h0, n, dim, N, d, h.data(), static_cast<T*>(nullptr), y, D ? D[d] : T(0));
      if (h_final) std::copy(h.begin(), h.end(), h_final + d * N);
    }
  }
}

template <typename T>
void SelectiveScanBackward(const T* dy, const T* dh_final, const T* u, const T* delta, const T* A, const T* B,
                           const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, T* du, T* ddelta,
                           T* dA, T* dB, T* dC, T* dD, T* dh0) {
  // dB and dC sum over channels: each thread keeps its own and they are added in thread order (deterministic).
  const int threads = (n * dim * N > 16384) ? omp_get_max_threads() : 1;
  ThreadPartials<T> dB_t(threads, n * N), dC_t(threads, n * N);
#pragma omp parallel num_threads(threads)
  {
    std::vector<T>& dBl = dB_t.Mine();
    std::vector<T>& dCl = dC_t.Mine();
    std::vector<T> h(N), hs(n * N), g(N);
#pragma omp for schedule(static)
    for (int64_t d = 0; d < dim; ++d) {
      const T Dd = D ? D[d] : T(0);
      ScanChannel(u, delta, A, B, C, h0, n, dim, N, d, h.data(), hs.data(), static_cast<T*>(nullptr), Dd);
      const T* Ad = A + d * N;
      T* dAd = dA + d * N;
      for (int64_t s = 0; s < N; ++s) g[s] = dh_final ? dh_final[d * N + s] : T(0);
      T dDd = 0;
      for (int64_t t = n - 1; t >= 0; --t) {
        const T dt = delta[t * dim + d], ut = u[t * dim + d], gy = dy[t * dim + d];
        const T* ht = hs.data() + t * N;
        const T* Bt = B + t * N;
        const T* Ct = C + t * N;
        T du_t = Dd * gy, ddt = 0;
        dDd += gy * ut;
        for (int64_t s = 0; s < N; ++s) {
          const T prev = t > 0 ? hs[(t - 1) * N + s] : (h0 ? h0[d * N + s] : T(0));
          const T e = std::exp(dt * Ad[s]);
          g[s] += gy * Ct[s];
          dCl[t * N + s] += gy * ht[s];
          dBl[t * N + s] += g[s] * dt * ut;
          du_t += g[s] * dt * Bt[s];
          ddt += g[s] * (Bt[s] * ut + Ad[s] * e * prev);
          dAd[s] += g[s] * dt * e * prev;
          g[s] *= e;
        }
        du[t * dim + d] = du_t;
        ddelta[t * dim + d] = ddt;
      }
      if (dD) dD[d] += dDd;
      if (dh0)
        for (int64_t s = 0; s < N; ++s) dh0[d * N + s] = g[s];
    }
  }
  dB_t.SumInto(dB);
  dC_t.SumInto(dC);
}

// The pair steps t in [t0, t1) of a block of kBlock positions that are all active, with the decay products and
// state gradients in registers: kN (the state size) fixed at compile time, compiled for AVX2 + FMA where the CPU
// has them (dispatch by feature, as in vexp.cc).
constexpr int kBlock = 4;

template <typename T, int kN>
inline __attribute__((always_inline)) void SweepBlockBody(const T* decay, const T* g, const T* C, const T* later_C,
                                                          int64_t n, int64_t t0, int64_t t1, T* prod, T* dh) {
  T p[kBlock][kN], q[kBlock][kN];
  for (int k = 0; k < kBlock; ++k)
    for (int s = 0; s < kN; ++s) {
      p[k][s] = prod[k * kN + s];
      q[k][s] = dh[k * kN + s];
    }
  for (int64_t t = t0; t < t1; ++t) {
    const T* et = decay + t * kN;
    const T* Ct = t < n ? C + t * kN : later_C + (t - n) * kN;
    T gc[kN];
    for (int s = 0; s < kN; ++s) gc[s] = g[t] * Ct[s];
    for (int k = 0; k < kBlock; ++k)
      for (int s = 0; s < kN; ++s) {
        p[k][s] *= et[s];
        q[k][s] += gc[s] * p[k][s];
      }
  }
  for (int k = 0; k < kBlock; ++k)
    for (int s = 0; s < kN; ++s) {
      prod[k * kN + s] = p[k][s];
      dh[k * kN + s] = q[k][s];
    }
}

template <typename T, int kN>
__attribute__((target("avx2,fma"))) void SweepBlockAvx2(const T* decay, const T* g, const T* C, const T* later_C,
                                                        int64_t n, int64_t t0, int64_t t1, T* prod, T* dh) {
  SweepBlockBody<T, kN>(decay, g, C, later_C, n, t0, t1, prod, dh);
}

template <typename T, int kN>
void SweepBlockBase(const T* decay, const T* g, const T* C, const T* later_C, int64_t n, int64_t t0, int64_t t1,
                    T* prod, T* dh) {
  SweepBlockBody<T, kN>(decay, g, C, later_C, n, t0, t1, prod, dh);
}

// False when N has no compiled sweep: the caller steps pair by pair.
template <typename T>
bool SweepBlock(int64_t N, const T* decay, const T* g, const T* C, const T* later_C, int64_t n, int64_t t0,
                int64_t t1, T* prod, T* dh) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (N) {
    case 16:
      (avx2 ? SweepBlockAvx2<T, 16> : SweepBlockBase<T, 16>)(decay, g, C, later_C, n, t0, t1, prod, dh);
      return true;
    case 8:
      (avx2 ? SweepBlockAvx2<T, 8> : SweepBlockBase<T, 8>)(decay, g, C, later_C, n, t0, t1, prod, dh);
      return true;
    default:
      return false;
  }
}

// Adjoint sharding: the state gradient of position i is the sum of independent vector-Jacobian products over the
// pairs (t, i), i <= t < i + window, dh_i = sum_t dy_t lambda^{t,i} with lambda^{t,i} = C_t exp(A sum_{i<j<=t}
// delta_j), accumulated from lambda^{t,t} = C_t one factor exp(delta_j A) at a time. Positions t past the chunk
// come from later_* (the cotangents, deltas and C of the `later` tokens right after it). Per channel, the states
// h_{i-1} are recomputed forward from h0, so every pair needs one state vector and nothing grows with the sequence.
template <typename T>
int64_t SelectiveScanBackwardPairs(const T* dy, const T* u, const T* delta, const T* A, const T* B, const T* C,
                                   const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, const T* later_dy,
                                   const T* later_delta, const T* later_C, int64_t later, int64_t window, T* du,
                                   T* ddelta, T* dA, T* dB, T* dC, T* dD) {
  const int64_t span = std::min(n + later, n - 1 + window);  // positions any pair of this chunk reads
  auto row = [&](const T* here, const T* after, int64_t t, int64_t width, int64_t col) {
    return t < n ? here[t * width + col] : after[(t - n) * width + col];
  };
  int64_t pairs = 0;
  for (int64_t i = 0; i < n; ++i) pairs += std::min(span, i + window) - i;
  const int threads = (pairs * dim * N > 16384) ? omp_get_max_threads() : 1;
  ThreadPartials<T> dB_t(threads, n * N), dC_t(threads, n * N);
#pragma omp parallel num_threads(threads)
  {
    std::vector<T>& dBl = dB_t.Mine();
    std::vector<T>& dCl = dC_t.Mine();
    // Positions go in blocks of kBlock: their pair loops over t are independent chains (the decay products),
    // which the CPU overlaps; one chain alone waits on its multiply latency.
    std::vector<T> decay(span * N), g(span), h(N), prev(kBlock * N), prod(kBlock * N), dh(kBlock * N);
#pragma omp for schedule(static)
    for (int64_t d = 0; d < dim; ++d) {
      const T* Ad = A + d * N;
      T* dAd = dA + d * N;
      for (int64_t t = 0; t < span; ++t) {
        g[t] = row(dy, later_dy, t, dim, d);
        const T dt = row(delta, later_delta, t, dim, d);
        for (int64_t s = 0; s < N; ++s) decay[t * N + s] = std::exp(dt * Ad[s]);
      }
      for (int64_t s = 0; s < N; ++s) h[s] = h0 ? h0[d * N + s] : T(0);
      const T Dd = D ? D[d] : T(0);
      T dDd = 0;
      // One step of pair (t, i_k): the product picks up exp(delta_t A), and dy_t C_t (product) joins dh_{i_k}.
      auto pair = [&](int k, int64_t t) {
        T* __restrict pk = prod.data() + k * N;
        T* __restrict dk = dh.data() + k * N;
        const T* __restrict et = decay.data() + t * N;
        const T* __restrict Ct = t < n ? C + t * N : later_C + (t - n) * N;
        const T gt = g[t];
        for (int64_t s = 0; s < N; ++s) {
          pk[s] *= et[s];
          dk[s] += gt * Ct[s] * pk[s];
        }
      };
      for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
        const int block = static_cast<int>(std::min<int64_t>(kBlock, n - i0));
        int64_t end[kBlock];
        for (int k = 0; k < block; ++k) {
          const int64_t i = i0 + k;
          const T dt = delta[i * dim + d], ut = u[i * dim + d];
          const T* Bi = B + i * N;
          const T* ei = decay.data() + i * N;
          const T* Ci = C + i * N;
          for (int64_t s = 0; s < N; ++s) {
            prev[k * N + s] = h[s];
            h[s] = ei[s] * h[s] + dt * Bi[s] * ut;
            dCl[i * N + s] += g[i] * h[s];  // the C term is local: y_i reads h_i only
            prod[k * N + s] = T(1);         // lambda^{i,i} = C_i
            dh[k * N + s] = g[i] * Ci[s];
          }
          end[k] = std::min(span, i + window);
        }
        // The pairs (t, i_k), t in (i_k, end_k), t increasing for each k: while the block's later positions start,
        // then all of the block together (end_0 is the earliest end), then the longer windows of the later ones.
        const int64_t together = i0 + block;
        for (int64_t t = i0 + 1; t < together; ++t)
          for (int k = 0; k < block; ++k)
            if (i0 + k < t && t < end[k]) pair(k, t);
        if (block == kBlock) {
          if (!SweepBlock(N, decay.data(), g.data(), C, later_C, n, together, end[0], prod.data(), dh.data()))
            for (int64_t t = together; t < end[0]; ++t)
              for (int k = 0; k < kBlock; ++k) pair(k, t);
        } else {
          for (int64_t t = together; t < end[0]; ++t)
            for (int k = 0; k < block; ++k) pair(k, t);
        }
        for (int k = 1; k < block; ++k)
          for (int64_t t = std::max(together, end[0]); t < end[k]; ++t) pair(k, t);
        // The VJP of step i with cotangent dh_i: h_i = exp(delta_i A) h_{i-1} + delta_i B_i u_i.
        for (int k = 0; k < block; ++k) {
          const int64_t i = i0 + k;
          const T dt = delta[i * dim + d], ut = u[i * dim + d];
          const T* Bi = B + i * N;
          const T* ei = decay.data() + i * N;
          const T* dk = dh.data() + k * N;
          const T* pv = prev.data() + k * N;
          T du_i = Dd * g[i], ddt = 0;
          dDd += g[i] * ut;
          for (int64_t s = 0; s < N; ++s) {
            dBl[i * N + s] += dk[s] * dt * ut;
            du_i += dk[s] * dt * Bi[s];
            ddt += dk[s] * (Bi[s] * ut + Ad[s] * ei[s] * pv[s]);
            dAd[s] += dk[s] * dt * ei[s] * pv[s];
          }
          du[i * dim + d] = du_i;
          ddelta[i * dim + d] = ddt;
        }
      }
      if (dD) dD[d] += dDd;
    }
  }
  dB_t.SumInto(dB);
  dC_t.SumInto(dC);
  return pairs;
}

template <typename T>
void SiluForward(const T* x, int64_t count, T* y) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] / (T(1) + std::exp(-x[i]));
}

template <typename T>
void SiluBackward(const T* dy, const T* x, int64_t count, T* dx) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    const T s = T(1) / (T(1) + std::exp(-x[i]));
    dx[i] = dy[i] * s * (T(1) + x[i] * (T(1) - s));
  }
}

template <typename T>
void Relu2Forward(const T* x, int64_t count, T* y) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] > T(0) ? x[i] * x[i] : T(0);
}

template <typename T>
void Relu2Backward(const T* dy, const T* x, int64_t count, T* dx) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) dx[i] = x[i] > T(0) ? T(2) * x[i] * dy[i] : T(0);
}

// softplus as in torch (threshold 20: identity above it).
template <typename T>
void SoftplusForward(const T* x, int64_t count, T* y) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] > T(20) ? x[i] : std::log1p(std::exp(x[i]));
}

template <typename T>
void SoftplusBackward(const T* dy, const T* x, int64_t count, T* dx) {
#pragma omp parallel for if (count > 65536)
  for (int64_t i = 0; i < count; ++i) dx[i] = x[i] > T(20) ? dy[i] : dy[i] / (T(1) + std::exp(-x[i]));
}

#define SG_INSTANTIATE(T)                                                                                        \
  template void Conv1dForward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, T*);     \
  template void Conv1dBackward<T>(const T*, const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,   \
                                  T*, T*, T*, T*);                                                               \
  template void SelectiveScanForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*,    \
                                        int64_t, int64_t, int64_t, T*, T*);                                      \
  template void SelectiveScanBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*,   \
                                         const T*, const T*, int64_t, int64_t, int64_t, T*, T*, T*, T*, T*, T*,  \
                                         T*);                                                                    \
  template int64_t SelectiveScanBackwardPairs<T>(const T*, const T*, const T*, const T*, const T*, const T*,     \
                                                 const T*, const T*, int64_t, int64_t, int64_t, const T*,        \
                                                 const T*, const T*, int64_t, int64_t, T*, T*, T*, T*, T*, T*);  \
  template void SiluForward<T>(const T*, int64_t, T*);                                                           \
  template void SiluBackward<T>(const T*, const T*, int64_t, T*);                                                \
  template void Relu2Forward<T>(const T*, int64_t, T*);                                                          \
  template void Relu2Backward<T>(const T*, const T*, int64_t, T*);                                               \
  template void SoftplusForward<T>(const T*, int64_t, T*);                                                       \
  template void SoftplusBackward<T>(const T*, const T*, int64_t, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
