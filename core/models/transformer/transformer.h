// Transformer of the Llama / Qwen2 / Qwen3 family on the per-layer chunk primitives.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/models/transformer/config.h"
#include "core/tensor_parallel.h"

namespace sg {

class TransformerModel : public Model {
 public:
  virtual const TransformerConfig& config() const = 0;
  std::unique_ptr<ModelSpec> spec() const override;  // family.cc
};

// The family in the registry (core/models/family.h).
class ModelFamily;
const ModelFamily& TransformerModelFamily();

// "tiny" (3 layers, GQA, for tests and gradcheck), "tiny-qwen2" (biases, tied head), "demo" (the main job's
// default), "bench-cpu" (d 256, 4 layers, 4 heads, 2 KV heads, ffn 688, vocab 512); real models' shapes (config
// only, no weights; for plans on the meta device and GPU benchmarks): "llama-3.1-8b", "qwen2.5-7b", "qwen2.5-32b", and
// "llama-1b-shape", "qwen2.5-7b-shape" (= qwen2.5-7b). NotFound names every family's presets.
absl::StatusOr<TransformerConfig> TransformerPreset(const std::string& name);
std::vector<std::string> TransformerPresetNames();

// Validates the config and allocates zero-initialised parameters (f32 or f64 compute) on the CPU. With tp.size > 1
// the model is rank tp.rank's part of a tensor-parallel split (core/tensor_parallel.h; the model is also a
// TensorParallelModel): its parameters are that rank's blocks, under the whole model's names.
// frozen_base: the parameters get no gradients (LoRA's adapters will; ParamStore::SetFrozenBase). offload_experts
// (with frozen_base, on MoE models): every MoE layer's expert weights are moved to host memory as it is created
// (core/expert_offload.h), so that the device never holds more than one layer's.
absl::StatusOr<std::unique_ptr<TransformerModel>> CreateTransformer(const TransformerConfig& config, DType dtype,
                                                                    Device device = Device::kCPU,
                                                                    const TensorParallel& tp = {},
                                                                    bool frozen_base = false,
                                                                    bool offload_experts = false);

// The rotary embedding of a sequence: the inverse frequencies of head_dim's pairs and the factor transformers
// multiplies cos and sin by (yarn's attention factor, else 1), for the config's rope_scaling.
struct RopeParameters {
  std::vector<double> inv_freq;
  double attention_factor = 1;
};
// Only the "dynamic" type depends on seq_len, the length of the whole sequence as transformers sees it (its
// input_ids, from which it recomputes the base as max(position_ids) + 1; the engine's positions are one fewer, the
// last token being only a label): every chunk of a sequence uses the same frequencies, so chunked strategies equal
// the whole-sequence computation. seq_len <= max_position_embeddings leaves the base unchanged.
RopeParameters RopeFor(const TransformerConfig& config, int64_t seq_len);

}  // namespace sg
