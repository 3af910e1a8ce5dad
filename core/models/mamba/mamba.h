// Mamba-1 state-space model (HF MambaForCausalLM) on the per-layer chunk primitives. The state a chunk carries to
// the next is, per layer, the scan state h [d_inner][state_size] and the conv tail (the last conv_kernel - 1 conv
// inputs) at the chunk boundary; its gradient is relayed back the same way, so full, ckpt, seco and streambp work
// unchanged. Packed documents (StateOptions::doc_starts, Mamba-2's seq_idx): a chunk runs its conv and scan
// document by document, each document from the zero state; no state or gradient crosses a document start, and
// adjoint sharding's pairs (t, i) stay inside a document.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/models/mamba/config.h"
#include "core/tensor_parallel.h"

namespace sg {

class MambaModel : public Model {
 public:
  virtual const MambaConfig& config() const = 0;
  std::unique_ptr<ModelSpec> spec() const override;  // family.cc
};

// The family in the registry (core/models/family.h).
class ModelFamily;
const ModelFamily& MambaModelFamily();

// Mamba-1 presets: "tiny-ssm" (vocab 97, d 16, state 4, 3 layers, expand 2, conv 4, dt_rank 2; tests and gradcheck),
// "bench-ssm" (vocab 512, d 256, state 16, 4 layers, expand 2, conv 4; a few MB, for benchmarks), "mamba-2.8b"
// (state-spaces/mamba-2.8b-hf's shape, config only).
absl::StatusOr<MambaConfig> MambaPreset(const std::string& name);
std::vector<std::string> MambaPresetNames();

// Validates the config (errors name the HF field) and allocates zero-initialised parameters: f32 or f64, or bf16
// (CPU and meta: in_proj, x_proj, dt_proj, out_proj, embeddings and LM head stored in bf16 over f32 compute).
// With tp.size > 1 the model is rank tp.rank's part of a tensor-parallel split of the d_inner channels
// (core/tensor_parallel.h; the model is also a TensorParallelModel): its parameters are that rank's blocks.
// frozen_base: the parameters get no gradients (LoRA's adapters will; ParamStore::SetFrozenBase).
absl::StatusOr<std::unique_ptr<MambaModel>> CreateMamba(const MambaConfig& config, DType dtype,
                                                        Device device = Device::kCPU, const TensorParallel& tp = {},
                                                        bool frozen_base = false);

// Mamba's initialisation of the scan (as HF MambaPreTrainedModel): A_log = log(1..state_size), D = 1, dt_proj
// weights uniform in +-dt_rank^-1/2 and dt_proj biases such that softplus(bias) is log-uniform in [1e-3, 1e-1]: a
// slowly decaying state, so that a fresh model has long memory. Other parameters are left as they are.
void InitMambaScan(MambaModel& model, uint64_t seed);

}  // namespace sg
