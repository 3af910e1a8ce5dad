#include "kernels/cpu/isa.h"

#include <oneapi/dnnl/dnnl.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace sg::cpu {
namespace {

Isa Detect() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Isa::kGeneric;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return Isa::kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
}

Isa Choose() {
  Isa isa = Detect();
  if (const char* want = std::getenv("SG_CPU_ISA"); want && *want) {
    const std::string_view w(want);
    Isa cap;
    if (w == "generic") cap = Isa::kGeneric;
    else if (w == "avx2") cap = Isa::kAvx2;
    else if (w == "avx512") cap = Isa::kAvx512;
    else if (w == "avx512_bf16") cap = Isa::kAvx512Bf16;
    else {
      std::fprintf(stderr, "error: SG_CPU_ISA=%s: expected generic, avx2, avx512 or avx512_bf16\n", want);
      std::exit(2);
    }
    if (cap < isa) isa = cap;
  }
  // oneDNN dispatches on its own; cap it to the same level (it accepts this only before its first primitive).
  dnnl_cpu_isa_t dnnl_cap = dnnl_cpu_isa_all;
  if (isa == Isa::kGeneric) dnnl_cap = dnnl_cpu_isa_sse41;
  else if (isa == Isa::kAvx2) dnnl_cap = dnnl_cpu_isa_avx2;
  else if (isa == Isa::kAvx512) dnnl_cap = dnnl_cpu_isa_avx512_core;
  dnnl_set_max_cpu_isa(dnnl_cap);
  return isa;
}

}  // namespace

Isa ActiveIsa() {
  static const Isa isa = Choose();
  return isa;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

}  // namespace sg::cpu
