// Tensors: dense, row-major, their storage on one device and counted by a MemoryTracker (base/memory.h), and the
// host code's access to them (whole-tensor copies, host views and fills).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "base/memory.h"

namespace sg {

// A dense, row-major tensor whose storage is owned (shared) and counted by a MemoryTracker.
class Tensor {
 public:
  Tensor() = default;
  // On the tracker's device (CPU without a tracker). Throws OutOfMemory when the size overflows or (CPU) exceeds
  // HostAvailableBytes(), before allocating, or when the allocation fails; MemoryLimitExceeded past the tracker's
  // limit.
  static Tensor Empty(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape);
  static Tensor Zeros(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape);
  // Storage allocated elsewhere, released by free(p) with the last reference and counted by no tracker (e.g. a
  // device model's weights kept in pinned host memory, device kCPU: core/expert_offload.h).
  static Tensor Adopt(void* p, void (*free)(void*), Device device, MemCategory cat, DType dtype,
                      std::vector<int64_t> shape);

  bool defined() const { return static_cast<bool>(storage_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  MemCategory category() const { return category_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }
  void* raw() const { return storage_.get(); }
  template <typename T>
  T* data() const {
    return static_cast<T*>(storage_.get());
  }
  void SetZero();
  void Reset() { storage_.reset(); }
  // Rows [begin, end) along the first dimension: a view that shares (and keeps alive) the storage, counted once.
  Tensor Rows(int64_t begin, int64_t end) const;

 private:
  std::shared_ptr<void> storage_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCPU;
  MemCategory category_ = MemCategory::kWorkspace;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
};

// Whole tensors: t.nbytes() bytes; CopyTensor needs equal sizes on one device.
void CopyToHost(const Tensor& t, void* dst);
void CopyFromHost(const Tensor& t, const void* src);
void CopyTensor(const Tensor& dst, const Tensor& src);
// The tensor's values as a host vector (T the tensor's element type).
template <typename T>
std::vector<T> HostCopy(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  CopyToHost(t, v.data());
  return v;
}
// The tensor's bytes for host code to read: its own memory when host-addressable, else a host copy appended to
// *copies (valid while it is).
const void* HostBytes(const Tensor& t, std::vector<std::vector<char>>* copies);
// Fills t from host code: fill(dst) writes t.nbytes() bytes at dst, which is t's own memory when host-addressable,
// else a host buffer copied into t when fill succeeds.
absl::Status FillFromHost(const Tensor& t, const std::function<absl::Status(void*)>& fill);
// dst[i] = v, stored as dtype's f32, f64 or bf16.
inline void StoreAs(DType dtype, void* dst, int64_t i, double v) {
  if (dtype == DType::kF64)
    static_cast<double*>(dst)[i] = v;
  else if (dtype == DType::kBF16)
    static_cast<uint16_t*>(dst)[i] = F32ToBF16(static_cast<float>(v));
  else
    static_cast<float*>(dst)[i] = static_cast<float>(v);
}
// t[i] = value(i) (a double, stored as t's f32, f64 or bf16) for every element, computed by host code in index
// order: in place on the CPU, else into a host buffer copied into t after.
template <typename F>
void SetFromHost(const Tensor& t, F value) {
  const bool direct = HostAddressable(t.device());
  std::vector<char> host(direct ? 0 : t.nbytes());
  char* dst = direct ? static_cast<char*>(t.raw()) : host.data();
  for (int64_t i = 0; i < t.numel(); ++i) StoreAs(t.dtype(), dst, i, value(i));
  if (!direct) CopyFromHost(t, host.data());
}
// Runs f on t's bytes in host memory: t's own when host-addressable, else a host copy of them, copied back into t
// when f succeeds and write_back is set (e.g. a collective over a device's tensor).
absl::Status WithHostBytes(const Tensor& t, bool write_back, const std::function<absl::Status(void*)>& f);

}  // namespace sg
