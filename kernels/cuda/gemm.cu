// GEMM through cuBLAS. The table is row-major, cuBLAS column-major: a row-major X[r][c] with leading dimension ld
// is the column-major X^T with the same ld, so row-major C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T,
// i.e. cuBLAS called with the operands (and m, n) swapped.
//
// cuBLAS gives bit-identical results run to run on one GPU model with one stream per handle (ours: Stream()).
//
// bf16 storage (--dtype=bf16, GemmMixed): cuBLASLt with bf16 A and B, f32 or bf16 C, fp32 compute (tensor cores).
// cuBLASLt multiplies bf16 by bf16 only, so an f32 operand (an activation times a bf16 weight) is first rounded to
// bf16 into device scratch, the rounding the tensor cores would apply to it anyway.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/bf16.cuh"
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

// ---- bf16 storage through cuBLASLt ----

void CheckLt(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string("gemm_mixed: ") + what + " failed: " + cublasGetStatusString(s));
}

cublasLtHandle_t LtHandle() {
  struct Handle {
    cublasLtHandle_t h = nullptr;
    ~Handle() {
      if (h) cublasLtDestroy(h);
    }
  };
  thread_local Handle handle;
  if (!handle.h) CheckLt(cublasLtCreate(&handle.h), "cublasLtCreate");
  return handle.h;
}

// Descriptors of one call, destroyed when it returns (also when it throws).
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

constexpr size_t kLtWorkspace = size_t(4) << 20;  // room for the split-K algorithms the heuristic may pick

cudaDataType LtType(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

// The largest power of two up to 256 dividing p's address: the alignment cuBLASLt's heuristic may assume.
uint32_t Alignment(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

// dst (packed, rows x cols) = the row-major f32 matrix src (leading dimension ld) rounded to bf16.
__global__ void RoundToBf16Kernel(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst) {
  SG_CUDA_LOOP(e, rows * cols) dst[e] = ToBf16(src[(e / cols) * ld + e % cols]);
}

// C = beta C over a row-major rows x cols matrix (k == 0: an empty product); beta == 0 does not read C.
template <typename S>
__global__ void ScaleMatrixKernel(S* c, int64_t rows, int64_t cols, int64_t ld, float beta) {
  SG_CUDA_LOOP(e, rows * cols) {
    S* x = c + (e / cols) * ld + e % cols;
    Narrow(x, beta == 0.0f ? 0.0f : beta * Widen(*x));
  }
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

void GemmMixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, DType a_type, const void* a,
               int64_t lda, DType b_type, const void* b, int64_t ldb, float beta, DType c_type, void* c,
               int64_t ldc) {
  const char* op = "gemm_mixed";
  for (const auto& [t, name] : {std::pair{a_type, "A"}, std::pair{b_type, "B"}, std::pair{c_type, "C"}})
    if (t != DType::kF32 && t != DType::kBF16)
      throw CudaError(std::string(op) + ": " + name + " is " + DTypeName(t) + "; only f32 and bf16 are supported");
  if (a_type == DType::kF32 && b_type == DType::kF32 && c_type == DType::kF32) {
    Gemm<float>(ta, tb, m, n, k, alpha, static_cast<const float*>(a), lda, static_cast<const float*>(b), ldb, beta,
                static_cast<float*>(c), ldc);
    return;
  }
  BlasArgs g;
  if (!Prepare(ta, tb, m, n, k, lda, ldb, ldc, &g)) return;
  if (k == 0) {
    if (c_type == DType::kBF16)
      ScaleMatrixKernel<uint16_t><<<Blocks(m * n, 256), 256, 0, Stream()>>>(static_cast<uint16_t*>(c), m, n, ldc, beta);
    else
      ScaleMatrixKernel<float><<<Blocks(m * n, 256), 256, 0, Stream()>>>(static_cast<float*>(c), m, n, ldc, beta);
    End(op);
    return;
  }
  // Stored (row-major) shapes: A is m x k (k x m transposed), B is k x n (n x k transposed). An f32 operand is
  // rounded into packed bf16 scratch.
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  auto as_bf16 = [&](DType t, const void* x, int64_t rows, int64_t cols, int* ld, int slot) -> const void* {
    if (t == DType::kBF16) return x;
    auto* dst = static_cast<uint16_t*>(Scratch(rows * cols * sizeof(uint16_t), slot, op));
    RoundToBf16Kernel<<<Blocks(rows * cols, 256), 256, 0, Stream()>>>(static_cast<const float*>(x), rows, cols, *ld,
                                                                        dst);
    *ld = ToInt(cols, "k or n");
    return dst;
  };
  const void* a16 = as_bf16(a_type, a, a_rows, a_cols, &g.lda, kSlotWork0);
  const void* b16 = as_bf16(b_type, b, b_rows, b_cols, &g.ldb, kSlotWork1);

  // Column-major, operands swapped (top of file): D (n x m) = op(B^T) op(A^T).
  LtCall call;
  CheckLt(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const int32_t op_b = g.op_first, op_a = g.op_second;
  CheckLt(cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)), "TRANSA");
  CheckLt(cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)), "TRANSB");
  CheckLt(cublasLtMatrixLayoutCreate(&call.a, CUDA_R_16BF, b_cols, b_rows, g.ldb), "the layout of B");
  CheckLt(cublasLtMatrixLayoutCreate(&call.b, CUDA_R_16BF, a_cols, a_rows, g.lda), "the layout of A");
  CheckLt(cublasLtMatrixLayoutCreate(&call.c, LtType(c_type), n, m, g.ldc), "the layout of C");
  CheckLt(cublasLtMatmulPreferenceCreate(&call.pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace_bytes = kLtWorkspace;
  CheckLt(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof(workspace_bytes)),
          "the workspace preference");
  const uint32_t align_a = Alignment(b16), align_b = Alignment(a16), align_c = Alignment(c);
  CheckLt(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                               sizeof(align_a)), "the alignment of B");
  CheckLt(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                               sizeof(align_b)), "the alignment of A");
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CheckLt(cublasLtMatmulPreferenceSetAttribute(call.pref, attr, &align_c, sizeof(align_c)), "the alignment of C");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  CheckLt(cublasLtMatmulAlgoGetHeuristic(LtHandle(), call.desc, call.a, call.b, call.c, call.c, call.pref, 1,
                                         &heuristic, &found),
          "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) throw CudaError(std::string(op) + ": cuBLASLt has no algorithm for this shape and alignment");
  void* workspace = heuristic.workspaceSize > 0 ? Scratch(heuristic.workspaceSize, kSlotWork2, op) : nullptr;
  CheckLt(cublasLtMatmul(LtHandle(), call.desc, &alpha, b16, call.a, a16, call.b, &beta, c, call.c, c, call.c,
                         &heuristic.algo, workspace, heuristic.workspaceSize, Stream()),
          "cublasLtMatmul");
  End(op);
}

template void Gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void Gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);

}  // namespace sg::cuda
