#include "core/model.h"

#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace sg {

DType Model::activation_dtype() {
  for (const Param& p : params())
    if (p.value.dtype() == DType::kBF16) return DType::kBF16;
  return dtype();
}

Tensor Model::NewRows(int64_t rows) {
  return Tensor::Empty(&memory(), MemCategory::kActivations, activation_dtype(), {rows, hidden_size()});
}

Tensor Model::NewGradRows(int64_t rows) {
  return Tensor::Empty(&memory(), MemCategory::kActivations, dtype(), {rows, hidden_size()});
}

void Model::StoreRows(Tensor& dst, Chunk c, const Tensor& src) {
  Tensor rows = dst.Rows(c.begin, c.end);
  if (dst.dtype() == src.dtype()) {
    CopyTensor(rows, src);  // on the tensors' device; meta: nothing
    return;
  }
  if (dst.dtype() != DType::kBF16 || src.dtype() != DType::kF32)
    throw std::logic_error(
        absl::StrCat("StoreRows: ", DTypeName(src.dtype()), " rows into a ", DTypeName(dst.dtype()), " tensor"));
  OpsFor<float>(src.device()).f32_to_bf16(src.data<float>(), src.numel(), rows.data<uint16_t>());
}

Tensor Model::ReadRows(const Tensor& src, Chunk c) {
  Tensor rows = src.Rows(c.begin, c.end);
  if (src.dtype() == dtype()) return rows;
  Tensor wide = Tensor::Empty(&memory(), MemCategory::kActivations, dtype(), rows.shape());
  OpsFor<float>(src.device()).bf16_to_f32(rows.data<uint16_t>(), rows.numel(), wide.data<float>());
  return wide;
}

Tensor Model::KeepRows(const Tensor& x) {
  if (activation_dtype() == x.dtype()) return x;
  Tensor kept = NewRows(x.dim(0));
  StoreRows(kept, {0, x.dim(0)}, x);
  return kept;
}

}  // namespace sg
