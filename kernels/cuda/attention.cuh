// What the attention kernels share: the scalar ones (attention.cu: f32, f64) and the tensor-core ones over bf16
// KV pages (attention_tc.cu): the call's geometry on the device, key lookup through the page table, D = rowsum(dO O)
// of the backward, the head-dim dispatch and launch helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"

namespace sg::cuda {
namespace {

constexpr int kMaxHeadDim = 256;

// The call's geometry and the (device-staged) page table of the forward view; T computes, KV is stored. Keys
// [key_begin, kv_total) are visible (packed documents: the queries' document starts at key_begin).
template <typename T, typename KV = T>
struct Args {
  int64_t n, pos0, heads, kv_heads, hd, group, page_size, page_stride, key_begin, kv_total;
  T scale;
  const KV* k_pool;
  const KV* v_pool;
  const int32_t* table;  // device copy
  const uint8_t* mask;   // device copy; null = every page selected
};

__host__ __device__ inline int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Pool offset of key j's row for kv head g, or -1 when the key is outside [key_begin, kv_total) or its page is
// unselected/absent. Key tiles start at key_begin; the check keeps an earlier document's keys unread regardless.
template <typename A>
__device__ inline int64_t KeyOffset(const A& a, int64_t j, int g) {
  if (j < a.key_begin || j >= a.kv_total) return -1;
  const int64_t lp = j / a.page_size;
  if ((a.mask && !a.mask[lp]) || a.table[lp] < 0) return -1;
  return a.table[lp] * a.page_stride + (j - lp * a.page_size) * a.kv_heads * a.hd + g * a.hd;
}

// Offset of key j's row for kv head g in the gradient pages (gtable, gstride), or -1 when the key is unread (koff,
// its KeyOffset, < 0) or nobody wants its page's gradient.
template <typename A>
__device__ inline int64_t GradOffset(const A& a, int64_t j, int g, int64_t koff, const int32_t* gtable,
                                     int64_t gstride) {
  if (koff < 0) return -1;
  const int64_t lp = j / a.page_size;
  if (gtable[lp] < 0) return -1;
  return gtable[lp] * gstride + (j - lp * a.page_size) * a.kv_heads * a.hd + g * a.hd;
}

// D[h][i] = dO[i][h] . O[i][h], one warp per (i, h). Every lane of a warp runs the same iterations (the loop bound
// is a multiple of 32), so the full-warp shuffle is safe.
template <typename T>
__global__ void RowDotKernel(const T* dout, const T* out, int64_t n, int64_t heads, int64_t hd, T* D) {
  SG_CUDA_LOOP(t, n * heads * 32) {
    const int64_t w = t / 32, i = w / heads, h = w % heads;
    const int lane = static_cast<int>(t % 32);
    const int64_t base = (i * heads + h) * hd;
    T acc = 0;
    for (int64_t d = lane; d < hd; d += 32) acc += dout[base + d] * out[base + d];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) D[h * n + i] = acc;
  }
}

// Calls f(std::integral_constant<int, HD>) with the smallest supported HD >= head_dim.
template <typename F>
void DispatchHeadDim(int64_t hd, const char* op, F&& f) {
  if (hd <= 16) f(std::integral_constant<int, 16>{});
  else if (hd <= 32) f(std::integral_constant<int, 32>{});
  else if (hd <= 64) f(std::integral_constant<int, 64>{});
  else if (hd <= 128) f(std::integral_constant<int, 128>{});
  else if (hd <= kMaxHeadDim) f(std::integral_constant<int, 256>{});
  else throw CudaError(std::string(op) + ": head_dim " + std::to_string(hd) + " is past the kernels' limit of 256");
}

template <typename T, typename KV>
Args<T, KV> MakeArgs(const AttentionShape& s, const PagedKV<KV>& kv, const char* op) {
  if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0 || kv.page_size <= 0 || s.head_dim <= 0 || s.key_begin < 0 ||
      s.key_begin > s.pos0)
    throw CudaError(std::string(op) + ": bad attention shape (heads % kv_heads, page_size, head_dim, key_begin " +
                    std::to_string(s.key_begin) + " outside [0, pos0 " + std::to_string(s.pos0) + "])");
  Args<T, KV> a;
  a.n = s.n;
  a.pos0 = s.pos0;
  a.heads = s.heads;
  a.kv_heads = s.kv_heads;
  a.hd = s.head_dim;
  a.group = s.heads / s.kv_heads;
  a.page_size = kv.page_size;
  a.page_stride = kv.page_stride;
  a.key_begin = s.key_begin;
  a.kv_total = s.pos0 + s.n;
  a.scale = static_cast<T>(s.scale);
  a.k_pool = kv.k_pool;
  a.v_pool = kv.v_pool;
  const int64_t pages = (a.kv_total + kv.page_size - 1) / kv.page_size;
  a.table = Stage(kv.page_table, pages, kSlotPageTable, op);
  a.mask = Stage(kv.page_mask, pages, kSlotPageMask, op);
  return a;
}

// The backward's D = rowsum(dO * O), [heads][n], in the workspace (or device scratch without one).
template <typename T>
T* LaunchRowDot(const AttentionShape& s, const T* dout, const T* out, T* workspace, const char* op) {
  T* D = workspace ? workspace : static_cast<T*>(Scratch(s.n * s.heads * sizeof(T), kSlotWork0, op));
  RowDotKernel<T><<<Blocks(s.n * s.heads * 32, 256), 256, 0, Stream()>>>(dout, out, s.n, s.heads, s.head_dim, D);
  return D;
}

// Opts the kernel into `bytes` of dynamic shared memory (over 48 KiB needs it) and returns bytes.
template <typename K>
size_t SharedMemory(K kernel, size_t bytes, const char* op) {
  Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
        "setting the shared memory size");
  return bytes;
}

inline unsigned Tiles(int64_t rows, int tile) { return static_cast<unsigned>((rows + tile - 1) / tile); }

}  // namespace
}  // namespace sg::cuda
