// bf16 storage on the CPU: row conversions and a GEMM over f32/bf16 operands that accumulates in fp32.
// bf16 x bf16 runs in oneDNN's bf16 matmul (AVX512_BF16 dot products or AMX, fp32 accumulation: bf16 products are
// exact in fp32, so this is the same contract) where the CPU has bf16 instructions. Otherwise — and whenever one
// operand is f32, which must not be rounded — bf16 operands are converted tile by tile into per-thread fp32 buffers
// (a few hundred KB, never a whole tensor) and each tile product runs in sgemm (Debian's OpenBLAS 0.3.21 does not
// export cblas_sbgemm); a bf16 C is accumulated in an fp32 tile and rounded once.
//
// SG_BF16_MATMUL=autocast (opt-in) changes one case: an f32 A times a bf16 weight B into an f32 C (activations x
// weights) rounds A to bf16, tile by tile, and runs the bf16 matmul: PyTorch's bf16 autocast numerics (inputs in
// bf16, fp32 accumulation). The bf16 matmul ran 1.2-2x oneDNN's sgemm on 4096-row products in a micro-benchmark;
// bench-cpu's step, which attention dominates, did not get faster with it.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string_view>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"

namespace sg::cpu {

void BF16ToF32Row(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = BF16ToF32(src[i]);
}

void F32ToBF16Row(const float* src, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = F32ToBF16(src[i]);
}

void RoundBF16(float* x, int64_t count, uint16_t* half) {
#pragma omp parallel for schedule(static) if (count >= (int64_t{1} << 16) && !omp_in_parallel())
  for (int64_t i = 0; i < count; ++i) {
    half[i] = F32ToBF16(x[i]);
    x[i] = BF16ToF32(half[i]);
  }
}

namespace {

// Tile sizes: an fp32 tile set is (256 x 512) x 2 + 256 x 256 floats = 1.25 MB per thread, and a converted
// element feeds 2 x 256 flops, so conversion is a small fraction of the work.
constexpr int64_t kTileM = 256, kTileN = 256, kTileK = 512;

// rows x cols of a row-major f32 or bf16 matrix (leading dimension ld) starting at (r0, c0): a pointer to them
// as fp32 with its leading dimension, converted into buf when the matrix is bf16.
const float* Tile(DType t, const void* src, int64_t ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                  std::vector<float>& buf, int64_t* tile_ld) {
  if (t == DType::kF32) {
    *tile_ld = ld;
    return static_cast<const float*>(src) + r0 * ld + c0;
  }
  buf.resize(rows * cols);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (int64_t r = 0; r < rows; ++r) BF16ToF32Row(s + (r0 + r) * ld + c0, cols, buf.data() + r * cols);
  *tile_ld = cols;
  return buf.data();
}

// C (f32) = alpha op(A) op(B) + beta C with A and B bf16, in oneDNN's matmul. Primitives are kept per shape
// (a run has a few dozen).
void MatmulBF16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
                const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  using dnnl::memory;
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float>;
  struct Entry {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul prim;
  };
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  static std::mutex mu;
  static std::map<Key, Entry> cache;
  const Key key{ta, tb, m, n, k, lda, ldb, ldc, alpha, beta};
  Entry* e;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) {
      const memory::desc ad({m, k}, memory::data_type::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
      const memory::desc bd({k, n}, memory::data_type::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
      const memory::desc cd({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
      dnnl::primitive_attr attr;
      if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
      if (beta != 0.0f) {
        dnnl::post_ops po;
        po.append_sum(beta);
        attr.set_post_ops(po);
      }
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, engine);
      it = cache.emplace(key, Entry{pd, dnnl::matmul(pd)}).first;
    }
    e = &it->second;
  }
  dnnl::stream stream(engine);
  memory am(e->pd.src_desc(), engine, const_cast<uint16_t*>(a));
  memory bm(e->pd.weights_desc(), engine, const_cast<uint16_t*>(b));
  memory cm(e->pd.dst_desc(), engine, c);
  e->prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
}

// bf16 x bf16 in oneDNN's bf16 matmul: where the CPU has bf16 dot products, outside parallel regions (attention's
// per-page products are small and run per thread) and for products big enough to pay for a primitive call.
bool UseMatmulBF16(int64_t m, int64_t n, int64_t k) {
  return k > 0 && ActiveIsa() >= Isa::kAvx512Bf16 && !omp_in_parallel() && m * n * k >= (int64_t{1} << 18);
}

bool AutocastMatmul() {
  static const bool on = [] {
    const char* v = std::getenv("SG_BF16_MATMUL");
    if (!v || !*v) return false;
    if (std::string_view(v) == "autocast") return true;
    std::fprintf(stderr, "error: SG_BF16_MATMUL=%s: expected autocast (or unset)\n", v);
    std::exit(2);
  }();
  return on;
}

}  // namespace

void GemmMixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
               int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
               int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (a_type == DType::kF32 && b_type == DType::kF32 && c_type == DType::kF32) {
    Gemm<float>(ta, tb, m, n, k, alpha, static_cast<const float*>(a), lda, static_cast<const float*>(b), ldb, beta,
                static_cast<float*>(c), ldc);
    return;
  }
  if (a_type == DType::kF32 && b_type == DType::kBF16 && c_type == DType::kF32 && AutocastMatmul() &&
      UseMatmulBF16(m, n, k)) {
    // Rows of op(A) rounded to bf16 a block of at most 8 MB at a time (A itself is [k][m] when transposed).
    static thread_local std::vector<uint16_t> a_rows;
    const float* af = static_cast<const float*>(a);
    const int64_t block = std::max<int64_t>(kTileM, (int64_t{4} << 20) / k);
    for (int64_t i0 = 0; i0 < m; i0 += block) {
      const int64_t mi = std::min(block, m - i0);
      a_rows.resize(mi * k);
      if (ta) {
        for (int64_t p = 0; p < k; ++p) F32ToBF16Row(af + p * lda + i0, mi, a_rows.data() + p * mi);
      } else {
        for (int64_t r = 0; r < mi; ++r) F32ToBF16Row(af + (i0 + r) * lda, k, a_rows.data() + r * k);
      }
      MatmulBF16(ta, tb, mi, n, k, alpha, a_rows.data(), ta ? mi : k, static_cast<const uint16_t*>(b), ldb, beta,
                 static_cast<float*>(c) + i0 * ldc, ldc);
    }
    return;
  }
  if (a_type == DType::kBF16 && b_type == DType::kBF16 && UseMatmulBF16(m, n, k)) {
    const uint16_t* a16 = static_cast<const uint16_t*>(a);
    const uint16_t* b16 = static_cast<const uint16_t*>(b);
    if (c_type == DType::kF32) {
      MatmulBF16(ta, tb, m, n, k, alpha, a16, lda, b16, ldb, beta, static_cast<float*>(c), ldc);
      return;
    }
    // A bf16 C: an fp32 block of rows at a time (widened first when beta reads it), rounded once.
    static thread_local std::vector<float> c_rows;
    uint16_t* c16 = static_cast<uint16_t*>(c);
    for (int64_t i0 = 0; i0 < m; i0 += kTileM) {
      const int64_t mi = std::min(kTileM, m - i0);
      c_rows.resize(mi * n);
      if (beta != 0)
        for (int64_t r = 0; r < mi; ++r) BF16ToF32Row(c16 + (i0 + r) * ldc, n, c_rows.data() + r * n);
      MatmulBF16(ta, tb, mi, n, k, alpha, ta ? a16 + i0 : a16 + i0 * lda, lda, b16, ldb, beta, c_rows.data(), n);
      for (int64_t r = 0; r < mi; ++r) F32ToBF16Row(c_rows.data() + r * n, n, c16 + (i0 + r) * ldc);
    }
    return;
  }
  const int64_t m_tiles = (m + kTileM - 1) / kTileM, n_tiles = (n + kTileN - 1) / kTileN;
  // With one tile, sgemm itself is multi-threaded; inside the parallel region it runs on one thread.
#pragma omp parallel if (m_tiles * n_tiles > 1)
  {
    // Per thread and kept between calls: attention calls this once per page.
    static thread_local std::vector<float> a_buf, b_buf, c_buf;
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t it = 0; it < m_tiles; ++it)
      for (int64_t jt = 0; jt < n_tiles; ++jt) {
        const int64_t i0 = it * kTileM, mi = std::min(kTileM, m - i0);
        const int64_t j0 = jt * kTileN, nj = std::min(kTileN, n - j0);
        float* ct;
        int64_t ct_ld;
        if (c_type == DType::kF32) {
          ct = static_cast<float*>(c) + i0 * ldc + j0;
          ct_ld = ldc;
        } else if (beta != 0) {
          ct = const_cast<float*>(Tile(c_type, c, ldc, i0, j0, mi, nj, c_buf, &ct_ld));
        } else {
          c_buf.assign(mi * nj, 0.0f);
          ct = c_buf.data();
          ct_ld = nj;
        }
        float tile_beta = beta;
        // k == 0 still scales C by beta (one pass with an empty product).
        for (int64_t k0 = 0; k0 < std::max<int64_t>(k, 1); k0 += kTileK) {
          const int64_t kk = std::min(kTileK, k - k0);
          int64_t at_ld, bt_ld;
          // op(A) rows [i0, i0 + mi) x cols [k0, k0 + kk); A itself is [k][m] when transposed.
          const float* at = ta ? Tile(a_type, a, lda, k0, i0, kk, mi, a_buf, &at_ld)
                               : Tile(a_type, a, lda, i0, k0, mi, kk, a_buf, &at_ld);
          const float* bt = tb ? Tile(b_type, b, ldb, j0, k0, nj, kk, b_buf, &bt_ld)
                               : Tile(b_type, b, ldb, k0, j0, kk, nj, b_buf, &bt_ld);
          Gemm<float>(ta, tb, mi, nj, kk, alpha, at, std::max<int64_t>(at_ld, 1), bt, std::max<int64_t>(bt_ld, 1),
                      tile_beta, ct, ct_ld);
          tile_beta = 1.0f;
        }
        if (c_type == DType::kBF16) {
          uint16_t* cb = static_cast<uint16_t*>(c);
          for (int64_t r = 0; r < mi; ++r) F32ToBF16Row(ct + r * ct_ld, nj, cb + (i0 + r) * ldc + j0);
        }
      }
  }
}

}  // namespace sg::cpu
