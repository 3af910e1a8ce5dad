// Plain C++ header shared by cuda_smoke.cu and C++ code: proves cuda_library deps pass
// their headers and defines (SG_SMOKE_BLOCK comes from the cc_library's `defines`) to nvcc.
#pragma once

#ifndef SG_SMOKE_BLOCK
#error "SG_SMOKE_BLOCK must come from //tests/toolchain:smoke_defs"
#endif

namespace sg::toolchain {
constexpr int kSmokeBlock = SG_SMOKE_BLOCK;
}  // namespace sg::toolchain
