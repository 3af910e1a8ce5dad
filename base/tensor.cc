#include "base/tensor.h"

#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/checked.h"
#include "base/host_cache.h"

namespace sg {

namespace {
// Allocations at least this large first check that the host has the memory: overcommit would otherwise grant them
// and the OOM killer end the process when the pages are touched. Smaller ones are not worth reading /proc for.
constexpr int64_t kCheckedAllocationBytes = int64_t{64} << 20;

[[noreturn]] void ThrowOutOfMemory(const std::string& what, int64_t bytes, MemCategory cat, Device device,
                                   int64_t available) {
  throw OutOfMemory(absl::StrCat("out of memory: ", what, " ", bytes, " bytes of ", MemCategoryName(cat), " asked on ",
                                 device == Device::kCPU ? "the host" : "the device", ", ",
                                 available < 0 ? std::string("unknown") : absl::StrCat(available), " bytes available"));
}
}  // namespace

Tensor Tensor::Empty(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape) {
  const Device device = tracker ? tracker->device() : Device::kCPU;
  absl::StatusOr<int64_t> checked = CheckedBytes(dtype, shape);
  if (!checked.ok()) throw OutOfMemory(absl::StrCat("out of memory: ", checked.status().message()));
  const int64_t bytes = *checked;
  if (device == Device::kCPU && bytes >= kCheckedAllocationBytes) {
    // Cached host blocks count as available: the cache frees them before it lets the process pass its peak.
    int64_t available = HostAvailableBytes();
    if (available >= 0) available += GetHostCacheStats().cached_bytes;
    if (available >= 0 && bytes > available)
      ThrowOutOfMemory(absl::StrCat("a tensor of shape ", ShapeText(shape), " needs"), bytes, cat, device, available);
  }
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.category_ = cat;
  t.numel_ = bytes / static_cast<int64_t>(DTypeSize(dtype));
  t.shape_ = std::move(shape);
  const DeviceAllocator& a = DeviceAllocatorOf(device);
  if (!a.alloc)
    throw std::runtime_error("no allocator for the model's device (this build lacks its backend: --config=cuda)");
  if (tracker) tracker->Add(cat, bytes);  // first: over the limit, nothing is allocated
  void* p;
  try {
    p = a.alloc(static_cast<size_t>(bytes));
  } catch (const std::bad_alloc&) {
    if (tracker) tracker->Sub(cat, bytes);
    ThrowOutOfMemory("the allocator refused", bytes, cat, device, device == Device::kCPU ? HostAvailableBytes() : -1);
  } catch (...) {
    if (tracker) tracker->Sub(cat, bytes);
    throw;
  }
  void (*release)(void*) = a.free;
  t.storage_ = std::shared_ptr<void>(p, [tracker, cat, bytes, release](void* q) {
    release(q);
    if (tracker) tracker->Sub(cat, bytes);
  });
  return t;
}

Tensor Tensor::Zeros(MemoryTracker* tracker, MemCategory cat, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Empty(tracker, cat, dtype, std::move(shape));
  t.SetZero();
  return t;
}

Tensor Tensor::Adopt(void* p, void (*free)(void*), Device device, MemCategory cat, DType dtype,
                     std::vector<int64_t> shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.category_ = cat;
  t.numel_ = 1;
  for (int64_t d : shape) t.numel_ *= d;
  t.shape_ = std::move(shape);
  t.storage_ = std::shared_ptr<void>(p, free);
  return t;
}

Tensor Tensor::Rows(int64_t begin, int64_t end) const {
  Tensor t = *this;
  const int64_t row = shape_.empty() || shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.shape_[0] = end - begin;
  t.numel_ = (end - begin) * row;
  t.storage_ = std::shared_ptr<void>(storage_, static_cast<char*>(storage_.get()) + begin * row * DTypeSize(dtype_));
  return t;
}

void CopyToHost(const Tensor& t, void* dst) {
  if (t.defined()) CopyToHost(t.device(), dst, t.raw(), t.nbytes());
}
void CopyFromHost(const Tensor& t, const void* src) {
  if (t.defined()) CopyFromHost(t.device(), t.raw(), src, t.nbytes());
}
void CopyTensor(const Tensor& dst, const Tensor& src) {
  if (dst.device() != src.device() || dst.nbytes() != src.nbytes())
    throw std::invalid_argument(absl::StrCat("CopyTensor: ", src.nbytes(), " bytes on device ",
                                             static_cast<int>(src.device()), " into ", dst.nbytes(),
                                             " bytes on device ", static_cast<int>(dst.device())));
  if (dst.defined()) CopyOnDevice(dst.device(), dst.raw(), src.raw(), dst.nbytes());
}
const void* HostBytes(const Tensor& t, std::vector<std::vector<char>>* copies) {
  if (HostAddressable(t.device())) return t.raw();
  copies->emplace_back(t.nbytes());
  CopyToHost(t, copies->back().data());
  return copies->back().data();
}

absl::Status FillFromHost(const Tensor& t, const std::function<absl::Status(void*)>& fill) {
  if (HostAddressable(t.device())) return fill(t.raw());
  std::vector<char> host(t.nbytes());
  if (absl::Status s = fill(host.data()); !s.ok()) return s;
  CopyFromHost(t, host.data());
  return absl::OkStatus();
}

absl::Status WithHostBytes(const Tensor& t, bool write_back, const std::function<absl::Status(void*)>& f) {
  if (HostAddressable(t.device())) return f(t.raw());
  std::vector<char> host(t.nbytes());
  CopyToHost(t, host.data());
  if (absl::Status s = f(host.data()); !s.ok()) return s;
  if (write_back) CopyFromHost(t, host.data());
  return absl::OkStatus();
}

void Tensor::SetZero() {
  if (storage_) DeviceAllocatorOf(device_).memset_zero(storage_.get(), nbytes());
}

}  // namespace sg
