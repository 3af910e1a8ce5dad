// bf16 storage on the CPU: row conversions and a GEMM over f32/bf16 operands that accumulates in fp32, and the
// --matmul mode of f32 products.
//
// --matmul=fp32 (the default): no operand is rounded. bf16 x bf16 runs in oneDNN's bf16 matmul (AVX512_BF16 dot
// products or AMX, fp32 accumulation: bf16 products are exact in fp32, so this is the same contract) where the CPU
// has bf16 instructions, outside parallel regions. Otherwise — and whenever one operand is f32 — bf16 operands are
// converted tile by tile into per-thread fp32 buffers (a few hundred KB, never a whole tensor) and each tile product
// runs in sgemm; a bf16 C is accumulated in an fp32 tile and rounded once.
//
// --matmul=bf16: every f32 operand is rounded to bf16 (PyTorch's bf16 autocast numerics: bf16 inputs, fp32
// accumulation) in blocks, and the product runs in oneDNN's bf16 matmul, also per thread inside parallel regions
// (attention's per-page products). Without AVX512_BF16 the rounded operands multiply in sgemm: the same numerics up
// to summation order.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"

namespace sg::cpu {

void BF16ToF32Row(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = BF16ToF32(src[i]);
}

namespace {

// F32ToBF16's bit arithmetic (round to nearest even, NaN kept quiet) 16 lanes at a time: the same bits as the
// scalar loop, denormals included (AVX512_BF16's vcvtneps2bf16 would flush them). Under --matmul=bf16 attention
// rounds each P and dS tile, as many values as a tile product has multiply-adds / head_dim.
__attribute__((target("avx512f,avx512bw"))) void F32ToBF16RowAvx512(const float* src, int64_t count,
                                                                      uint16_t* dst) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i u = _mm512_loadu_si512(src + i);
    const __m512i high = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(high, one))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_or_epi32(r, nan, high, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < count; ++i) dst[i] = F32ToBF16(src[i]);
}

}  // namespace

void F32ToBF16Row(const float* src, int64_t count, uint16_t* dst) {
  if (ActiveIsa() >= Isa::kAvx512) {
    F32ToBF16RowAvx512(src, count, dst);
    return;
  }
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

std::atomic<bool> round_to_bf16{false};

// Tile sizes of the sgemm path: an fp32 tile set is (256 x 512) x 2 + 256 x 256 floats = 1.25 MB per thread, and a
// converted element feeds 2 x 256 flops, so conversion is a small fraction of the work.
constexpr int64_t kTileM = 256, kTileN = 256, kTileK = 512;

// rows x cols of a row-major f32 or bf16 matrix (leading dimension ld) starting at (r0, c0): a pointer to them as
// fp32 with its leading dimension. bf16 is widened into buf; f32 is used in place, or rounded through bf16 into buf
// when round is set.
const float* TileF32(DType t, const void* src, int64_t ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                     bool round, std::vector<float>& buf, int64_t* tile_ld) {
  if (t == DType::kF32 && !round) {
    *tile_ld = ld;
    return static_cast<const float*>(src) + r0 * ld + c0;
  }
  buf.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = buf.data() + r * cols;
    if (t == DType::kBF16) {
      BF16ToF32Row(static_cast<const uint16_t*>(src) + (r0 + r) * ld + c0, cols, out);
    } else {
      const float* in = static_cast<const float*>(src) + (r0 + r) * ld + c0;
      for (int64_t c = 0; c < cols; ++c) out[c] = BF16ToF32(F32ToBF16(in[c]));
    }
  }
  *tile_ld = cols;
  return buf.data();
}

// The same block as bf16: in place when the matrix is bf16, rounded into buf when it is f32 (over the threads
// outside parallel regions).
const uint16_t* TileBF16(DType t, const void* src, int64_t ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                         std::vector<uint16_t>& buf, int64_t* tile_ld) {
  if (t == DType::kBF16) {
    *tile_ld = ld;
    return static_cast<const uint16_t*>(src) + r0 * ld + c0;
  }
  buf.resize(rows * cols);
  const float* s = static_cast<const float*>(src);
  uint16_t* out = buf.data();
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16) && !omp_in_parallel())
  for (int64_t r = 0; r < rows; ++r) F32ToBF16Row(s + (r0 + r) * ld + c0, cols, out + r * cols);
  *tile_ld = cols;
  return out;
}

// Per thread, at most this many primitives are kept: a fixed-shape run needs a few dozen, but each new sequence
// length brings new shapes (its chunk's rows, its last page), and every primitive holds JIT code.
constexpr size_t kMaxMatmulShapes = 256;
thread_local size_t t_matmul_shapes = 0;

// C (f32) = alpha op(A) op(B) + beta C with A and B bf16, in oneDNN's matmul. Each thread keeps its own primitives
// (one per shape, at most kMaxMatmulShapes: past that the thread's cache starts over), stream and scratchpad, so
// attention's threads call it at once without a lock. A primitive made inside a parallel region runs on one thread and one made outside on all (its scratchpad
// is sized for that), so which one is part of the key.
void MatmulBF16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
                const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  using dnnl::memory;
  using Key = std::tuple<bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float>;
  struct Entry {
    dnnl::matmul prim;
    memory a, b, c, scratch;
    size_t scratch_bytes;
  };
  struct Cache {
    dnnl::stream stream;
    std::map<Key, Entry> entries;
    std::vector<char> scratch;
  };
  constexpr size_t kAlign = 64;
  // Never destroyed: it outlives every thread's cache.
  static dnnl::engine& engine = *new dnnl::engine(dnnl::engine::kind::cpu, 0);
  thread_local Cache cache{dnnl::stream(engine), {}, {}};
  const Key key{omp_in_parallel() != 0, ta, tb, m, n, k, lda, ldb, ldc, alpha, beta};
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) {
    if (cache.entries.size() >= kMaxMatmulShapes) cache.entries.clear();
    const memory::desc ad({m, k}, memory::data_type::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
    const memory::desc bd({k, n}, memory::data_type::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    const memory::desc cd({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(beta);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, engine);
    it = cache.entries
             .emplace(key, Entry{dnnl::matmul(pd), memory(pd.src_desc(), engine, nullptr),
                                 memory(pd.weights_desc(), engine, nullptr), memory(pd.dst_desc(), engine, nullptr),
                                 memory(pd.scratchpad_desc(), engine, nullptr), pd.scratchpad_desc().get_size()})
             .first;
  }
  t_matmul_shapes = cache.entries.size();
  Entry& e = it->second;
  if (cache.scratch.size() < e.scratch_bytes + kAlign) cache.scratch.resize(e.scratch_bytes + kAlign);
  const uintptr_t base = reinterpret_cast<uintptr_t>(cache.scratch.data());
  e.a.set_data_handle(const_cast<uint16_t*>(a));
  e.b.set_data_handle(const_cast<uint16_t*>(b));
  e.c.set_data_handle(c);
  e.scratch.set_data_handle(reinterpret_cast<void*>((base + kAlign - 1) / kAlign * kAlign));
  e.prim.execute(cache.stream,
                 {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}, {DNNL_ARG_SCRATCHPAD, e.scratch}});
  cache.stream.wait();
}

// bf16 x bf16 under --matmul=fp32: oneDNN's bf16 matmul where the CPU has bf16 dot products, outside parallel
// regions and for products big enough to pay for a primitive call.
bool UseMatmulBF16(int64_t m, int64_t n, int64_t k) {
  return k > 0 && ActiveIsa() >= Isa::kAvx512Bf16 && !omp_in_parallel() && m * n * k >= (int64_t{1} << 18);
}

// --matmul=bf16 with bf16 dot products: operand blocks as bf16 (f32 ones rounded) multiplied in MatmulBF16.
// Outside parallel regions oneDNN runs each block over the threads and a block's rounded operands stay within
// 16 MB; attention's per-thread calls are one block each. A bf16 C sums in an fp32 block of rows, rounded once.
void GemmRounded(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
                 int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
                 int64_t ldc) {
  static thread_local std::vector<uint16_t> a_buf, b_buf;
  static thread_local std::vector<float> c_buf;
  const int64_t mb = c_type == DType::kF32 ? m : std::max<int64_t>(kTileM, (int64_t{4} << 20) / n);
  const int64_t kb = std::max<int64_t>(64, (int64_t{8} << 20) / (std::min(m, mb) + n));
  const bool threads = !omp_in_parallel();
  for (int64_t i0 = 0; i0 < m; i0 += mb) {
    const int64_t mi = std::min(mb, m - i0);
    float* cb;
    int64_t cb_ld;
    uint16_t* c16 = static_cast<uint16_t*>(c) + i0 * ldc;
    if (c_type == DType::kF32) {
      cb = static_cast<float*>(c) + i0 * ldc;
      cb_ld = ldc;
    } else {
      c_buf.resize(mi * n);
      cb = c_buf.data();
      cb_ld = n;
      if (beta != 0) {
#pragma omp parallel for schedule(static) if (threads)
        for (int64_t r = 0; r < mi; ++r) BF16ToF32Row(c16 + r * ldc, n, cb + r * n);
      }
    }
    float block_beta = beta;
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
      const int64_t kk = std::min(kb, k - k0);
      int64_t at_ld, bt_ld;
      // op(A) rows [i0, i0 + mi) x cols [k0, k0 + kk); A itself is [k][m] when transposed.
      const uint16_t* at = ta ? TileBF16(a_type, a, lda, k0, i0, kk, mi, a_buf, &at_ld)
                              : TileBF16(a_type, a, lda, i0, k0, mi, kk, a_buf, &at_ld);
      const uint16_t* bt = tb ? TileBF16(b_type, b, ldb, 0, k0, n, kk, b_buf, &bt_ld)
                              : TileBF16(b_type, b, ldb, k0, 0, kk, n, b_buf, &bt_ld);
      MatmulBF16(ta, tb, mi, n, kk, alpha, at, std::max<int64_t>(at_ld, 1), bt, std::max<int64_t>(bt_ld, 1),
                 block_beta, cb, cb_ld);
      block_beta = 1.0f;
    }
    if (c_type == DType::kBF16) {
#pragma omp parallel for schedule(static) if (threads)
      for (int64_t r = 0; r < mi; ++r) F32ToBF16Row(cb + r * n, n, c16 + r * ldc);
    }
  }
}

}  // namespace

std::string SetMatmul(const std::string& mode) {
  if (mode == "fp32") round_to_bf16 = false;
  else if (mode == "bf16") round_to_bf16 = true;
  else if (mode == "tf32") return "the CPU has no tf32 products: --matmul=tf32 is for cuda; choose fp32 or bf16";
  else return "unknown matmul mode '" + mode + "' (choose fp32 or bf16 on the CPU)";
  return "";
}

bool MatmulRoundsToBF16() { return round_to_bf16.load(std::memory_order_relaxed); }

size_t MatmulShapesCached() { return t_matmul_shapes; }

void GemmMixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
               int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
               int64_t ldc) {
  if (m == 0 || n == 0) return;
  const bool round = MatmulRoundsToBF16();
  if (!round && a_type == DType::kF32 && b_type == DType::kF32 && c_type == DType::kF32) {
    Sgemm(ta, tb, m, n, k, alpha, static_cast<const float*>(a), lda, static_cast<const float*>(b), ldb, beta,
          static_cast<float*>(c), ldc);
    return;
  }
  if (round && k > 0 && ActiveIsa() >= Isa::kAvx512Bf16) {
    GemmRounded(ta, tb, m, n, k, alpha, a_type, a, lda, b_type, b, ldb, beta, c_type, c, ldc);
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
  // Tile by tile in sgemm, the f32 operands rounded through bf16 under --matmul=bf16.
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
          ct = const_cast<float*>(TileF32(c_type, c, ldc, i0, j0, mi, nj, false, c_buf, &ct_ld));
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
          const float* at = ta ? TileF32(a_type, a, lda, k0, i0, kk, mi, round, a_buf, &at_ld)
                               : TileF32(a_type, a, lda, i0, k0, mi, kk, round, a_buf, &at_ld);
          const float* bt = tb ? TileF32(b_type, b, ldb, j0, k0, nj, kk, round, b_buf, &bt_ld)
                               : TileF32(b_type, b, ldb, k0, j0, kk, nj, round, b_buf, &bt_ld);
          Sgemm(ta, tb, mi, nj, kk, alpha, at, std::max<int64_t>(at_ld, 1), bt, std::max<int64_t>(bt_ld, 1),
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
