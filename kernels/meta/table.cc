#include <cstdint>
#include <type_traits>

#include "kernels/meta/meta_ops.h"

namespace sg::meta {
namespace {

// The no-op of an op table entry's function-pointer type: returns a zero of its result type.
template <typename F>
struct Nop;
template <typename R, typename... Args>
struct Nop<R (*)(Args...)> {
  static R Call(Args...) {
    if constexpr (!std::is_void_v<R>) return R{};
  }
};

// Every entry of kernels/ops.inc a no-op, bf16 storage's included (planned like the CPU backend, which has it).
template <typename T>
OpTable<T> MakeTable() {
  OpTable<T> t{};
#define SG_OP(name, Kernel, ret, params) t.name = &Nop<decltype(t.name)>::Call;
#include "kernels/ops.inc"
  t.attention_workspace_elems = CpuOps<T>().attention_workspace_elems;  // sizes only: reads no tensor
  t.gated_delta_workspace_elems = CpuOps<T>().gated_delta_workspace_elems;
  t.ssd_workspace_elems = CpuOps<T>().ssd_workspace_elems;
  return t;
}

}  // namespace

template <typename T>
const OpTable<T>& MetaOps() {
  static const OpTable<T> table = MakeTable<T>();
  return table;
}
template const OpTable<float>& MetaOps<float>();
template const OpTable<double>& MetaOps<double>();

CopyEngine MetaCopyEngine() {
  CopyEngine e;
  e.alloc_host = [](size_t) { return MetaAddress(); };
  e.free_host = [](void*) {};
  e.copy_async = [](void*, const void*, size_t, int) {};
  e.wait = [](int) {};
  return e;
}

DeviceBackend MetaBackend() {
  DeviceBackend b;
  b.f32 = &MetaOps<float>();
  b.f64 = &MetaOps<double>();
  b.synchronize = [] {};
  b.name = [] { return std::string("meta (no storage, no compute: memory planning)"); };
  b.copies = MetaCopyEngine();
  return b;
}

}  // namespace sg::meta
