// The device backends: CPU and meta always; CUDA registers itself when its library is linked in (--config=cuda).
#include <array>
#include <mutex>
#include <stdexcept>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/meta/meta_ops.h"

namespace sg {
namespace {

struct Registry {
  std::mutex mu;
  std::array<DeviceBackend, kNumDevices> backends{};
  std::array<bool, kNumDevices> present{};
};

Registry& TheRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    DeviceBackend cpu;
    cpu.f32 = &CpuOps<float>();
    cpu.f64 = &CpuOps<double>();
    cpu.copies = cpu::HostCopyEngine();
    cpu.set_matmul = cpu::SetMatmul;
    reg->backends[0] = cpu;
    reg->present[0] = true;
    reg->backends[static_cast<int>(Device::kMeta)] = meta::MetaBackend();
    reg->present[static_cast<int>(Device::kMeta)] = true;
    return reg;
  }();
  return *r;
}

const char* DeviceName(Device d) { return d == Device::kCUDA ? "cuda" : d == Device::kMeta ? "meta" : "cpu"; }

}  // namespace

void RegisterBackend(Device d, const DeviceBackend& b) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.backends[static_cast<int>(d)] = b;
  r.present[static_cast<int>(d)] = true;
}

const DeviceBackend* FindBackend(Device d) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  const int i = static_cast<int>(d);
  return r.present[i] ? &r.backends[i] : nullptr;
}

std::string DeviceUnavailableReason(Device d) {
  const DeviceBackend* b = FindBackend(d);
  if (!b) return std::string("this seqgrad was built without the ") + DeviceName(d) +
                " backend (build with --config=cuda)";
  return b->probe ? b->probe() : "";
}

template <typename T>
const OpTable<T>& OpsFor(Device d) {
  const DeviceBackend* b = FindBackend(d);
  const OpTable<T>* t = nullptr;
  if (b) {
    if constexpr (sizeof(T) == sizeof(double)) t = b->f64;
    else t = b->f32;
  }
  if (!t) throw std::runtime_error(std::string("no ") + DeviceName(d) + " op table for " +
                                   (sizeof(T) == sizeof(double) ? "f64" : "f32") + ": " + DeviceUnavailableReason(d));
  return *t;
}

template const OpTable<float>& OpsFor<float>(Device);
template const OpTable<double>& OpsFor<double>(Device);

}  // namespace sg
