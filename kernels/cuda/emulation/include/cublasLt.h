// Stand-in for <cublasLt.h> in the CPU emulation of the CUDA backend: the part of cuBLASLt the backend's bf16 GEMM
// uses (gemm.cu, GemmMixed), on host memory. Column-major D = alpha op(A) op(B) + beta C with the type combinations
// cuBLASLt supports for CUBLAS_COMPUTE_32F with f32 scales: A and B both f32, or both bf16; C and D of one type,
// f32 or bf16 (bf16 C/D only over bf16 A/B). Products are accumulated in double, D rounded once to its type.
// Argument checks as cuBLASLt makes them: null handle or descriptor, leading dimension < rows, shapes of A, B, C, D
// that do not agree under the transposes (INVALID_VALUE), type combinations it lacks (NOT_SUPPORTED), a workspace
// smaller than the algorithm asked for. Header-only, so that the emulation's runtime library stays as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "base/dtype.h"
#include "cublas_v2.h"
#include "cuda_runtime.h"
#include "library_types.h"

typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
} cublasLtMatmulDescAttributes_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
} cublasLtMatmulPreferenceAttributes_t;

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType scale;
  int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
};

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                               cudaDataType_t scale) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                                     const void* buf, size_t size) {
  if (!desc || !buf || size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t v;
  std::memcpy(&v, buf, sizeof(v));
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (v != CUBLAS_OP_N && v != CUBLAS_OP_T && v != CUBLAS_OP_C) return CUBLAS_STATUS_INVALID_VALUE;
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? desc->trans_a : desc->trans_b) = v;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      desc->compute = static_cast<cublasComputeType_t>(v);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      desc->scale = static_cast<cudaDataType>(v);
      return CUBLAS_STATUS_SUCCESS;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                                 uint64_t cols, int64_t ld) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                           cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                           size_t size) {
  if (!pref || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&pref->max_workspace, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return size == sizeof(uint32_t) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

namespace sg_emu::lt {

// The checks cublasLtMatmul and the heuristic share: descriptors present, supported types, consistent shapes.
inline cublasStatus_t Validate(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!desc || !a || !b || !c || !d) return CUBLAS_STATUS_INVALID_VALUE;
  if (desc->compute != CUBLAS_COMPUTE_32F || desc->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ab_f32 = a->type == CUDA_R_32F && b->type == CUDA_R_32F;
  const bool ab_bf16 = a->type == CUDA_R_16BF && b->type == CUDA_R_16BF;
  if (!(ab_f32 || ab_bf16) || c->type != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!(c->type == CUDA_R_32F || (ab_bf16 && c->type == CUDA_R_16BF))) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (cublasLtMatrixLayout_t l : {a, b, c, d})
    if (l->ld < static_cast<int64_t>(l->rows < 1 ? 1 : l->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  const bool na = desc->trans_a == CUBLAS_OP_N, nb = desc->trans_b == CUBLAS_OP_N;
  const uint64_t m = d->rows, n = d->cols, k = na ? a->cols : a->rows;
  if ((na ? a->rows : a->cols) != m || (nb ? b->rows : b->cols) != k || (nb ? b->cols : b->rows) != n ||
      c->rows != m || c->cols != n)
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

inline double Load(cudaDataType t, const void* p, int64_t i) {
  return t == CUDA_R_32F ? static_cast<const float*>(p)[i] : sg::BF16ToF32(static_cast<const uint16_t*>(p)[i]);
}
inline void Store(cudaDataType t, void* p, int64_t i, double v) {
  if (t == CUDA_R_32F) static_cast<float*>(p)[i] = static_cast<float>(v);
  else static_cast<uint16_t*>(p)[i] = sg::F32ToBF16(static_cast<float>(v));
}

}  // namespace sg_emu::lt

inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                                     cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                     cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                     cublasLtMatmulPreference_t pref, int requested,
                                                     cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!pref || requested < 1 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  if (const cublasStatus_t s = sg_emu::lt::Validate(h, desc, a, b, c, d); s != CUBLAS_STATUS_SUCCESS) return s;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].algo.data[0] = 1;  // the emulation's one algorithm; needs no workspace
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                                     cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b,
                                     const void* beta, const void* C, cublasLtMatrixLayout_t c, void* D,
                                     cublasLtMatrixLayout_t d, const cublasLtMatmulAlgo_t* algo, void*,
                                     size_t, cudaStream_t) {
  if (const cublasStatus_t s = sg_emu::lt::Validate(h, desc, a, b, c, d); s != CUBLAS_STATUS_SUCCESS) return s;
  if (!alpha || !beta || (algo && algo->data[0] != 1)) return CUBLAS_STATUS_INVALID_VALUE;
  // D may be C (in place) only with the same layout, as cuBLASLt requires.
  if (C == D && (c->ld != d->ld || c->type != d->type)) return CUBLAS_STATUS_INVALID_VALUE;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  sg_emu::DeviceAccess access;  // the matmul reads and writes device memory, as a kernel does
  const bool na = desc->trans_a == CUBLAS_OP_N, nb = desc->trans_b == CUBLAS_OP_N;
  const int64_t m = static_cast<int64_t>(d->rows), n = static_cast<int64_t>(d->cols);
  const int64_t k = static_cast<int64_t>(na ? a->cols : a->rows);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0;
      if (al != 0.0f)
        for (int64_t p = 0; p < k; ++p)
          acc += sg_emu::lt::Load(a->type, A, na ? i + p * a->ld : p + i * a->ld) *
                 sg_emu::lt::Load(b->type, B, nb ? p + j * b->ld : j + p * b->ld);
      const double prior = be == 0.0f ? 0.0 : static_cast<double>(be) * sg_emu::lt::Load(c->type, C, i + j * c->ld);
      sg_emu::lt::Store(d->type, D, i + j * d->ld, static_cast<double>(al) * acc + prior);
    }
  return CUBLAS_STATUS_SUCCESS;
}
