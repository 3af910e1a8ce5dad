// The backend table: every op the engine runs, as free functions over raw pointers with explicit sizes.
// The CPU backend (OpenMP; oneDNN for f32 and bf16 GEMMs, OpenBLAS for f64) fills it for float and double; the CUDA
// backend fills its own copy; the meta device's copy only allocates (plans).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "base/dtype.h"

namespace sg {

// A paged view of one layer's K and V (or dK and dV) for attention kernels. Page p (a pool index from
// page_table) holds page_size tokens: keys at k_pool + p * page_stride, laid out [page_size][kv_heads][head_dim],
// and values at v_pool + p * page_stride. This is the layout the CUDA backend uses too.
template <typename T>
struct PagedKV {
  T* k_pool = nullptr;
  T* v_pool = nullptr;
  // logical page i -> pool page; in a gradient view, -1 marks a page whose gradient nobody needs (backward
  // skips computing it)
  const int32_t* page_table = nullptr;
  int64_t page_size = 0;
  int64_t page_stride = 0;  // elements between consecutive pool pages
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  T* k_page(int64_t logical) const { return k_pool + page_table[logical] * page_stride; }
  T* v_page(int64_t logical) const { return v_pool + page_table[logical] * page_stride; }
  bool has_page(int64_t logical) const { return page_table[logical] >= 0; }
  // Page-level sparse attention (SeCOv2 §4.3): when set, attention reads (and backward writes dK/dV of) only
  // the logical pages with page_mask[i] != 0; null = every page (dense).
  const uint8_t* page_mask = nullptr;
  bool selected(int64_t logical) const { return page_mask == nullptr || page_mask[logical] != 0; }
};

// Geometry of one attention call: a chunk of n queries at absolute positions [pos0, pos0 + n), causal over
// keys [key_begin, pos0 + n) held in the paged cache. key_begin > 0 (<= pos0): the queries' document starts there
// (packed documents): keys before it are masked, and pages wholly before it are never read.
struct AttentionShape {
  int64_t n = 0;
  int64_t pos0 = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double scale = 0;  // softmax scale, 1/sqrt(head_dim)
  int64_t key_begin = 0;
};

// The table's entries, their signatures and contracts are listed once, in kernels/ops.inc.
template <typename T>
struct OpTable {
#define SG_OP(name, Kernel, ret, params) ret(*name) params = nullptr;
#include "kernels/ops.inc"
};

// A weight matrix as a model stores it: in the compute type, or in bf16 (bf16 storage over f32 compute).
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// gemm with B a weight: C = alpha op(A) op(W) + beta C, through gemm_mixed when W is bf16.
template <typename T>
void GemmWeight(const OpTable<T>& ops, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                int64_t lda, WeightView w, int64_t ldw, T beta, T* c, int64_t ldc) {
  if (w.dtype != DType::kBF16) {
    ops.gemm(trans_a, trans_b, m, n, k, alpha, a, lda, static_cast<const T*>(w.data), ldw, beta, c, ldc);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (ops.gemm_mixed) {
      ops.gemm_mixed(trans_a, trans_b, m, n, k, alpha, DType::kF32, a, lda, DType::kBF16, w.data, ldw, beta,
                     DType::kF32, c, ldc);
      return;
    }
  }
  throw std::invalid_argument("--dtype=bf16: this backend has no bf16 GEMM");
}

template <typename T>
const OpTable<T>& CpuOps();

// Asynchronous copies between a device's memory and pinned host memory, in lanes (CUDA: a stream per lane; CPU:
// a worker thread per lane), for KV offload. Copies issued to one lane run in order; wait(lane) returns once every
// copy issued to it has finished.
struct CopyEngine {
  void* (*alloc_host)(size_t bytes) = nullptr;  // pinned on CUDA
  void (*free_host)(void* p) = nullptr;
  void (*copy_async)(void* dst, const void* src, size_t bytes, int lane) = nullptr;
  void (*wait)(int lane) = nullptr;
};

// What a device backend registers (the CUDA library does so when linked in, built with --config=cuda).
struct DeviceBackend {
  const OpTable<float>* f32 = nullptr;
  const OpTable<double>* f64 = nullptr;
  // "" when a device is usable; otherwise why not (e.g. "no CUDA device: ...").
  std::string (*probe)() = nullptr;
  // Free and total device memory in bytes.
  void (*memory_info)(int64_t* free_bytes, int64_t* total_bytes) = nullptr;
  // Waits for the device's work (a step's end); throws naming the work that failed.
  void (*synchronize)() = nullptr;
  // Asynchronous backends, at the start of each pass of a chunk: reports (throws) a fault of earlier work that has
  // already shown, without waiting for the device, and labels the work that follows ("chunk [0, 512)") in error
  // messages. Null: nothing to do.
  void (*begin_chunk)(const std::string& label) = nullptr;
  // How f32 matmuls multiply: "fp32" (exact), "tf32" or "bf16" (tensor cores; bf16 inputs, f32 accumulation).
  // Returns "" or why the mode is refused. Null: "fp32" only.
  std::string (*set_matmul)(const std::string& mode) = nullptr;
  // The device's name and its peak dense matmul FLOP/s in the current mode (the denominator of MFU; 0 = unknown).
  std::string (*name)() = nullptr;
  double (*peak_flops)(bool f64) = nullptr;
  CopyEngine copies;
};
void RegisterBackend(Device d, const DeviceBackend& b);
// The registered backend of d (CPU always is); null when none (CUDA in a build without --config=cuda).
const DeviceBackend* FindBackend(Device d);
// Waits for d's work when its backend has any (a step's end); throws naming the work that failed.
inline void SynchronizeDevice(Device d) {
  if (const DeviceBackend* b = FindBackend(d); b && b->synchronize) b->synchronize();
}
// "" when d can run: CPU always; CUDA when the CUDA backend is linked in and a GPU is usable.
std::string DeviceUnavailableReason(Device d);
// The op table of d for T; throws std::runtime_error naming the device if it has none.
template <typename T>
const OpTable<T>& OpsFor(Device d);

}  // namespace sg
