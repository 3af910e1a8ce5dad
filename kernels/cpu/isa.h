// Which vector instructions the CPU kernels use, picked once per process at run time: the best the CPU has, or
// lower when SG_CPU_ISA asks (avx2: AVX2 + FMA, as on CPUs without AVX-512; generic: the compiler's baseline).
// oneDNN's GEMMs are capped to the same level, so SG_CPU_ISA=avx2 measures an AVX2-only machine.
#pragma once

namespace sg::cpu {

enum class Isa { kGeneric, kAvx2, kAvx512, kAvx512Bf16 };

// The level in use (reads SG_CPU_ISA and the CPU's features on first call; an unknown SG_CPU_ISA value is an error
// that names the variable and exits).
Isa ActiveIsa();
const char* IsaName(Isa isa);

}  // namespace sg::cpu
