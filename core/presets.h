// Built-in model presets for demos, tests and benchmarks.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model_config.h"

namespace sg {

// "tiny" (3 layers, GQA, for tests and gradcheck), "tiny-qwen2" (biases, tied head), "demo" (the main job's
// default), "bench-cpu" (d 256, 4 layers, 4 heads, 2 KV heads, ffn 688, vocab 512); real models' shapes (config
// only, no weights; for plans on the meta device and GPU benchmarks): "llama-3.1-8b", "qwen2.5-7b", "qwen2.5-32b", and
// "llama-1b-shape", "qwen2.5-7b-shape" (= qwen2.5-7b).
absl::StatusOr<TransformerConfig> TransformerPreset(const std::string& name);
std::vector<std::string> TransformerPresetNames();

// Mamba-1 presets: "tiny-ssm" (vocab 97, d 16, state 4, 3 layers, expand 2, conv 4, dt_rank 2; tests and gradcheck),
// "bench-ssm" (vocab 512, d 256, state 16, 4 layers, expand 2, conv 4; a few MB, for benchmarks), "mamba-2.8b"
// (state-spaces/mamba-2.8b-hf's shape, config only).
absl::StatusOr<MambaConfig> MambaPreset(const std::string& name);
std::vector<std::string> MambaPresetNames();

}  // namespace sg
