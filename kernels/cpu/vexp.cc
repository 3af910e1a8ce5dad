#include "kernels/cpu/vexp.h"

namespace sg::cpu {

// The same loops compiled for three ISAs. (target_clones("arch=...") would dispatch on the CPU model, not its
// features, and miss newer CPUs; and SG_CPU_ISA must be able to pick a lower build.)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,prefer-vector-width=512")
namespace avx512 {
#include "kernels/cpu/row_ops.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "kernels/cpu/row_ops.inc"
}  // namespace avx2
#pragma GCC pop_options

namespace generic {
#include "kernels/cpu/row_ops.inc"
}  // namespace generic

const RowOps& RowOpsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return avx512::kOps;
    case Isa::kAvx2:
      return avx2::kOps;
    case Isa::kGeneric:
      break;
  }
  return generic::kOps;
}

}  // namespace sg::cpu
