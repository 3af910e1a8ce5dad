// Gated DeltaNet on CUDA: the gated delta rule over a chunk, forward and backward with the checkpointed states of
// kernels/gated_delta_workspace.h (its gates are in pointwise.cu). Same math as kernels/cpu/gated_delta.cc, and the
// same order of every sum over the state rows i.
//
// A thread owns one column j of a value head's state S [dk][dv]: u = S^T k, the update S += k delta^T and
// out = S^T q read only that column, so the forward is one thread per (value head, column), without barriers. The
// backward is one block per value head, a thread per column: dq and dk sum over the columns (a warp's by shuffles,
// then the warps in order through shared memory), dbeta and dg with BlockSum. The states live in device memory
// (scratch, the workspace), each column touched by its thread only. No atomics: deterministic.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"
#include "kernels/gated_delta_workspace.h"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
// The backward runs a thread per value dim in one block: at most 512, so that its registers fit a block on every
// GPU (64K registers; ptx_test.sh checks the kernel's count against this bound).
constexpr int kMaxBackwardThreads = 512;

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
// Where one token's rows lie for value head h; its key head is h / (v_heads / k_heads).
struct Rows {
  int64_t k_heads, v_heads, dk, dv;
  __device__ int64_t Key(int64_t t, int64_t h) const { return (t * k_heads + h / (v_heads / k_heads)) * dk; }
  __device__ int64_t Value(int64_t t, int64_t h) const { return (t * v_heads + h) * dv; }
  __device__ int64_t Gate(int64_t t, int64_t h) const { return t * v_heads + h; }
};

// Token t on column j of value head h's state (col[i * dv], i < dk), from the column `from` (may be col): S =
// exp(g) from; u = S^T k; delta = beta (v - u); S += k delta^T. Returns out_j = (S^T q)_j, or 0 when q is null.
template <typename T>
__device__ T StepColumn(const Rows& r, const T* q, const T* k, const T* v, const T* g, const T* beta, int64_t t,
                        int64_t h, int64_t j, const T* from, T* col) {
  const int64_t dk = r.dk, dv = r.dv;
  const T* kt = k + r.Key(t, h);
  const T e = Exp(g[r.Gate(t, h)]), b = beta[r.Gate(t, h)];
  T u = 0;
  for (int64_t i = 0; i < dk; ++i) {
    const T s = e * from[i * dv];
    col[i * dv] = s;
    u += s * kt[i];
  }
  const T delta = b * (v[r.Value(t, h) + j] - u);
  if (!q) {
    for (int64_t i = 0; i < dk; ++i) col[i * dv] += kt[i] * delta;
    return T(0);
  }
  const T* qt = q + r.Key(t, h);
  T out = 0;
  for (int64_t i = 0; i < dk; ++i) {
    const T s = col[i * dv] + kt[i] * delta;
    col[i * dv] = s;
    out += s * qt[i];
  }
  return out;
}

// col[i * dv] = src[i * dv] (src null: zeros), i < dk.
template <typename T>
__device__ void CopyColumn(const T* src, int64_t dk, int64_t dv, T* col) {
  for (int64_t i = 0; i < dk; ++i) col[i * dv] = src ? src[i * dv] : T(0);
}

// One thread per (value head, column); state [v_heads][dk][dv] is scratch.
template <typename T>
__global__ void GatedDeltaForwardKernel(Rows r, const T* q, const T* k, const T* v, const T* g, const T* beta,
                                        const T* s0, int64_t n, T* state, T* out, T* s_final) {
  SG_CUDA_LOOP(c, r.v_heads * r.dv) {
    const int64_t h = c / r.dv, j = c % r.dv, at = h * r.dk * r.dv + j;
    T* col = state + at;
    CopyColumn(s0 ? s0 + at : nullptr, r.dk, r.dv, col);
    for (int64_t t = 0; t < n; ++t) {
      const T o = StepColumn(r, q, k, v, g, beta, t, h, j, col, col);
      out[r.Value(t, h) + j] = o;
    }
    if (s_final) CopyColumn(col, r.dk, r.dv, s_final + at);
  }
}

// The backward of one value head per block (blockIdx.x), thread j = column j (threads past dv only join the sums).
// Shared memory: the per-warp sums of dq and dk [warps][dk] each. dq_heads, dk_heads [n][v_heads][dk] get this
// head's rows.
template <typename T>
__global__ void GatedDeltaBackwardKernel(Rows r, GatedDeltaWorkspace w, int64_t n, const T* dout, const T* ds_final,
                                         const T* q, const T* k, const T* v, const T* g, const T* beta, const T* s0,
                                         T* dv_out, T* dg, T* dbeta, T* ds0, T* workspace) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ T block_sum[32];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* warp_dq = reinterpret_cast<T*>(smem);
  T* warp_dk = warp_dq + warps * r.dk;
  const int64_t h = blockIdx.x, j = threadIdx.x, dk = r.dk, dv = r.dv, state = dk * dv;
  const bool active = j < dv;
  const int64_t jj = active ? j : 0;  // a valid column for the idle threads' addresses
  T* checkpoints = workspace + w.checkpoints + h * w.blocks * state + jj;
  T* states = workspace + w.block_states + h * w.block * state + jj;
  T* dS = workspace + w.state_grad + h * state + jj;
  T* dq_heads = workspace + w.dq_heads;
  T* dk_heads = workspace + w.dk_heads;
  if (active) {
    // The state at the start of every block.
    if (w.blocks > 0) CopyColumn(s0 ? s0 + h * state + j : nullptr, dk, dv, checkpoints);
    for (int64_t b = 0; b + 1 < w.blocks; ++b) {
      T* next = checkpoints + (b + 1) * state;
      for (int64_t t = b * w.block; t < (b + 1) * w.block; ++t)
        StepColumn<T>(r, nullptr, k, v, g, beta, t, h, j, t == b * w.block ? checkpoints + b * state : next, next);
    }
    CopyColumn(ds_final ? ds_final + h * state + j : nullptr, dk, dv, dS);
  }
  for (int64_t b = w.blocks - 1; b >= 0; --b) {
    const int64_t t0 = b * w.block, t1 = t0 + w.block < n ? t0 + w.block : n;
    if (active) {
      CopyColumn(checkpoints + b * state, dk, dv, states);
      for (int64_t t = t0; t + 1 < t1; ++t)
        StepColumn<T>(r, nullptr, k, v, g, beta, t, h, j, states + (t - t0) * state, states + (t - t0 + 1) * state);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const T* prev = states + (t - t0) * state;
      const T* kt = k + r.Key(t, h);
      const T* qt = q + r.Key(t, h);
      const T e = Exp(g[r.Gate(t, h)]), bt = beta[r.Gate(t, h)];
      const T vj = active ? v[r.Value(t, h) + j] : T(0), dout_j = active ? dout[r.Value(t, h) + j] : T(0);
      // The forward's u and delta (P = e S_{t-1}).
      T u = 0;
      if (active)
        for (int64_t i = 0; i < dk; ++i) u += e * prev[i * dv] * kt[i];
      const T delta = bt * (vj - u);
      // out = S_t^T q: dq = S_t dout, dS += q dout^T; then S_t = P + k delta^T: ddelta = dS^T k.
      T ddelta = 0;
      for (int64_t i = 0; i < dk; ++i) {
        T part = 0;
        if (active) {
          part = (e * prev[i * dv] + kt[i] * delta) * dout_j;
          const T ds = dS[i * dv] + qt[i] * dout_j;
          dS[i * dv] = ds;
          ddelta += ds * kt[i];
        }
        part = WarpSum(part);
        if (lane == 0) warp_dq[warp * dk + i] = part;
      }
      // delta = beta (v - u): dv, dbeta; du = -beta ddelta.
      const T dbeta_part = (vj - u) * ddelta, du = -bt * ddelta;
      if (active) dv_out[r.Value(t, h) + j] = bt * ddelta;
      // dk = dS delta + P du (u = P^T k); dP = dS + k du^T; dg = sum(dP .* P); dS_{t-1} = e dP.
      T dg_part = 0;
      for (int64_t i = 0; i < dk; ++i) {
        T part = 0;
        if (active) {
          const T p = e * prev[i * dv], ds = dS[i * dv];
          part = ds * delta + p * du;
          const T dp = ds + kt[i] * du;
          dg_part += dp * p;
          dS[i * dv] = e * dp;
        }
        part = WarpSum(part);
        if (lane == 0) warp_dk[warp * dk + i] = part;
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
        T sum_q = 0, sum_k = 0;
        for (int ww = 0; ww < warps; ++ww) {
          sum_q += warp_dq[ww * dk + i];
          sum_k += warp_dk[ww * dk + i];
        }
        dq_heads[(t * r.v_heads + h) * dk + i] = sum_q;
        dk_heads[(t * r.v_heads + h) * dk + i] = sum_k;
      }
      // BlockSum's barriers also keep the next token from overwriting warp_dq before everyone has read it.
      const T dbeta_t = BlockSum(dbeta_part, block_sum);
      const T dg_t = BlockSum(dg_part, block_sum);
      if (threadIdx.x == 0) {
        dbeta[r.Gate(t, h)] = dbeta_t;
        dg[r.Gate(t, h)] = dg_t;
      }
    }
  }
  if (active && ds0) CopyColumn<T>(dS, dk, dv, ds0 + h * state + j);
}

// dst[t][g][:] = sum over the heads of group g of rows[t][h][:], in head order (the CPU's).
template <typename T>
__global__ void SumOverHeadGroupsKernel(const T* rows, int64_t n, int64_t groups, int64_t heads, int64_t width,
                                        T* dst) {
  const int64_t per = heads / groups;
  SG_CUDA_LOOP(e, n * groups * width) {
    const int64_t i = e % width, row = e / width, g = row % groups, t = row / groups;
    const T* in = rows + (t * heads + g * per) * width + i;
    T acc = in[0];
    for (int64_t r = 1; r < per; ++r) acc += in[r * width];
    dst[e] = acc;
  }
}

}  // namespace

template <typename T>
void SumOverHeadGroups(const T* rows, int64_t n, int64_t groups, int64_t heads, int64_t width, T* dst) {
  if (n * groups * width > 0)
    SumOverHeadGroupsKernel<T>
        <<<Blocks(n * groups * width, kThreads), kThreads, 0, Stream()>>>(rows, n, groups, heads, width, dst);
}

int64_t GatedDeltaWorkspaceElems(int64_t n, int64_t v_heads, int64_t dk, int64_t dv) {
  return GatedDeltaLayout(n, v_heads, dk, dv).elems;
}

template <typename T>
void GatedDeltaForward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* s0, int64_t n,
                       int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, T* out, T* s_final) {
  const char* op = "gated_delta_forward";
  CheckGatedDeltaHeads(k_heads, v_heads, op);
  const int64_t columns = v_heads * dv;
  if (columns > 0) {
    T* state = static_cast<T*>(Scratch(v_heads * dk * dv * sizeof(T) + sizeof(T), kSlotWork0, op));
    GatedDeltaForwardKernel<T><<<Blocks(columns, kThreads), kThreads, 0, Stream()>>>(
        Rows{k_heads, v_heads, dk, dv}, q, k, v, g, beta, s0, n, state, out, s_final);
  }
  End(op);
}

template <typename T>
void GatedDeltaBackward(const T* dout, const T* ds_final, const T* q, const T* k, const T* v, const T* g, const T* beta,
                        const T* s0, int64_t n, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, T* dq,
                        T* dk_out, T* dv_out, T* dg, T* dbeta, T* ds0, T* workspace) {
  const char* op = "gated_delta_backward";
  CheckGatedDeltaHeads(k_heads, v_heads, op);
  const int threads = static_cast<int>((dv + 31) / 32 * 32);
  const int64_t shared = 2 * (threads / 32) * dk * static_cast<int64_t>(sizeof(T));
  if (dv > kMaxBackwardThreads || shared > kMaxSharedBytes)
    throw CudaError(std::string(op) + ": dk=" + std::to_string(dk) + ", dv=" + std::to_string(dv) +
                    " exceed the CUDA kernel's limits (dv <= " + std::to_string(kMaxBackwardThreads) +
                    " and 2 * ceil(dv / 32) * dk values in 48 KiB)");
  const GatedDeltaWorkspace w = GatedDeltaLayout(n, v_heads, dk, dv);
  if (v_heads > 0 && dv > 0) {
    GatedDeltaBackwardKernel<T><<<static_cast<unsigned>(v_heads), threads, shared, Stream()>>>(
        Rows{k_heads, v_heads, dk, dv}, w, n, dout, ds_final, q, k, v, g, beta, s0, dv_out, dg, dbeta, ds0, workspace);
  }
  SumOverHeadGroups(workspace + w.dq_heads, n, k_heads, v_heads, dk, dq);
  SumOverHeadGroups(workspace + w.dk_heads, n, k_heads, v_heads, dk, dk_out);
  End(op);
}

#define SG_INSTANTIATE(T)                                                                                             \
  template void SumOverHeadGroups<T>(const T*, int64_t, int64_t, int64_t, int64_t, T*);                               \
  template void GatedDeltaForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                     int64_t, int64_t, int64_t, T*, T*);                                              \
  template void GatedDeltaBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, \
                                      int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*, T*, T*, T*, T*, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
