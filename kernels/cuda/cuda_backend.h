// Host-side controls of the CUDA backend (no CUDA headers needed): linking //kernels/cuda registers the backend
// (OpsFor<T>(Device::kCUDA), the caching device-memory allocator, KV offload's copy engine) at start-up.
#pragma once

namespace sg::cuda {

// How the f32 GEMMs multiply: exact f32, TF32 tensor cores, or BF16 tensor cores (inputs rounded to bf16,
// products accumulated in f32: the usual mixed-precision training matmul). f64 GEMMs are always f64.
enum class GemmMath { kF32, kTF32, kBF16 };
void SetGemmMath(GemmMath math);
GemmMath GetGemmMath();

}  // namespace sg::cuda
