// GEMM through cuBLAS. The table is row-major, cuBLAS column-major: a row-major X[r][c] with leading dimension ld
// is the column-major X^T with the same ld, so row-major C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T,
// i.e. cuBLAS called with the operands (and m, n) swapped.
//
// cuBLAS gives bit-identical results run to run on one GPU model with one stream per handle (ours: Stream()).
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {

namespace {

void CheckBlas(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string("gemm: ") + what + " failed: " + cublasGetStatusString(s));
}

// One handle per thread (a cuBLAS handle must not be used by two threads at once), bound to the compute stream.
cublasHandle_t BlasHandle() {
  struct Handle {
    cublasHandle_t h = nullptr;
    ~Handle() {
      if (h) cublasDestroy(h);
    }
  };
  thread_local Handle handle;
  if (!handle.h) {
    cublasHandle_t h = nullptr;
    CheckBlas(cublasCreate(&h), "cublasCreate");
    handle.h = h;
    CheckBlas(cublasSetStream(h, Stream()), "cublasSetStream");
    // Default math: no TF32 unless a compute type asks for it (GemmMath::kTF32 / kBF16 below).
    CheckBlas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  return handle.h;
}

// cuBLAS takes int sizes; say which one does not fit rather than wrap around.
int ToInt(int64_t v, const char* name) {
  if (v < 0 || v > INT_MAX)
    throw CudaError(std::string("gemm: ") + name + " = " + std::to_string(v) + " is out of cuBLAS's int range");
  return static_cast<int>(v);
}

// The column-major call's arguments: operands swapped, as explained at the top.
struct BlasArgs {
  cublasOperation_t op_first, op_second;  // applied to b, then a
  int m, n, k, lda, ldb, ldc;
};

// Returns false when there is nothing to do (an empty C).
bool Prepare(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
             BlasArgs* args) {
  if (m < 0 || n < 0 || k < 0) ToInt(std::min({m, n, k}), "a matrix size");
  if (m == 0 || n == 0) return false;
  if (k == 0) {
    // A and B are not read (C = beta C), but cuBLAS still checks their leading dimensions against max(1, rows).
    lda = std::max<int64_t>(lda, std::max<int64_t>(m, 1));
    ldb = std::max<int64_t>(ldb, std::max<int64_t>(n, 1));
  }
  args->op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  args->op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  args->m = ToInt(n, "n");
  args->n = ToInt(m, "m");
  args->k = ToInt(k, "k");
  args->lda = ToInt(lda, "lda");
  args->ldb = ToInt(ldb, "ldb");
  args->ldc = ToInt(ldc, "ldc");
  return true;
}

}  // namespace

// A primary template with explicit instantiations (not specializations): table.cu sees only the declaration.
template <typename T>
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  BlasArgs g;
  if (!Prepare(ta, tb, m, n, k, lda, ldb, ldc, &g)) return;
  if constexpr (std::is_same_v<T, double>) {
    CheckBlas(cublasDgemm(BlasHandle(), g.op_first, g.op_second, g.m, g.n, g.k, &alpha, b, g.ldb, a, g.lda, &beta,
                          c, g.ldc),
              "cublasDgemm");
  } else {
    static_assert(std::is_same_v<T, float>);
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // exact f32 (FFMA), no TF32
    switch (GetGemmMath()) {
      case GemmMath::kF32: compute = CUBLAS_COMPUTE_32F; break;
      case GemmMath::kTF32: compute = CUBLAS_COMPUTE_32F_FAST_TF32; break;
      // Inputs rounded to bf16 inside cuBLAS, products accumulated in f32; A, B, C stay f32 in memory.
      case GemmMath::kBF16: compute = CUBLAS_COMPUTE_32F_FAST_16BF; break;
    }
    CheckBlas(cublasGemmEx(BlasHandle(), g.op_first, g.op_second, g.m, g.n, g.k, &alpha, b, CUDA_R_32F, g.ldb, a,
                           CUDA_R_32F, g.lda, &beta, c, CUDA_R_32F, g.ldc, compute, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
  }
  End("gemm");
}

template void Gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void Gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);

}  // namespace sg::cuda
