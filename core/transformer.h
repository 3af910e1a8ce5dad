// Transformer of the Llama / Qwen2 family on the per-layer chunk primitives.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/model_config.h"

namespace sg {

struct InitOptions {
  uint64_t seed = 0;
  double stddev = 0.02;
  // Tests: draw norm weights around 1 and biases around 0 so their gradients are exercised.
  bool perturb_norms_and_biases = false;
};

class TransformerModel : public Model {
 public:
  virtual const TransformerConfig& config() const = 0;
};

// Validates the config and allocates zero-initialised parameters (f32 or f64 compute) on the CPU.
absl::StatusOr<std::unique_ptr<TransformerModel>> CreateTransformer(const TransformerConfig& config, DType dtype,
                                                                    Device device = Device::kCPU);

// Random initialisation (normal(0, stddev) matrices, unit norms, zero biases).
void InitRandom(Model& model, const InitOptions& opts);

// RoPE inverse frequencies for head_dim, with Llama-3 scaling when enabled.
std::vector<double> RopeInverseFrequencies(const TransformerConfig& config);

}  // namespace sg
