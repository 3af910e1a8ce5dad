// GEMM. f32 (--matmul=fp32; bf16.cc has --matmul=bf16): oneDNN's sgemm, whose JIT kernels follow the CPU's vector
// ISA (AVX-512 where present, capped by SG_CPU_ISA); measured 1.5-2x Debian's OpenBLAS 0.3.21 on this engine's
// shapes on an AVX-512 CPU, where OpenBLAS runs its Haswell (AVX2) kernels. SG_GEMM=openblas keeps f32 in OpenBLAS
// (for comparison). f64 stays in OpenBLAS dgemm: the exactness reference does not change. Both run single-threaded
// inside an OpenMP parallel region.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"

namespace sg::cpu {
namespace {

bool F32InOpenBlas() {
  static const bool openblas = [] {
    const char* v = std::getenv("SG_GEMM");
    return v && std::string_view(v) == "openblas";
  }();
  return openblas;
}

}  // namespace

template <>
void Gemm<float>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (MatmulRoundsToBF16()) {
    GemmMixed(ta, tb, m, n, k, alpha, DType::kF32, a, lda, DType::kF32, b, ldb, beta, DType::kF32, c, ldc);
    return;
  }
  Sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (F32InOpenBlas()) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
                lda, b, ldb, beta, c, ldc);
    return;
  }
  if (k == 0) {  // C = beta C, as BLAS defines it (beta 0: zeros, whatever C held); dnnl_sgemm leaves C untouched
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  ActiveIsa();  // caps oneDNN's ISA before its first call
  // dnnl_sgemm is row-major, like the rest of the engine.
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (st != dnnl_success)
    throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(static_cast<int>(st)));
}

template <>
void Gemm<double>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                  const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
              lda, b, ldb, beta, c, ldc);
}

}  // namespace sg::cpu
