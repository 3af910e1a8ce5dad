// LoRA adapters on disk as Hugging Face PEFT files (core/io/peft.h): a directory with adapter_config.json and
// adapter_model.safetensors that peft.PeftModel.from_pretrained(base_model, dir) loads, and back.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "core/lora.h"
#include "core/model.h"

namespace sg {

// Writes text to path atomically: a temporary file beside it, flushed to disk, renamed over it.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text);

// Writes the model's adapters (LoRA must be on) into `dir` (created if missing): adapter_model.safetensors in the
// model's dtype and adapter_config.json, each atomically (temporary file, fsync, rename).
// base_model_name_or_path goes into the config as PEFT records it (a hub id or the base model's directory).
absl::Status SaveLoraAdapter(Model& model, const std::string& dir, const std::string& base_model_name_or_path);

// The LoRA options of a saved adapter (rank, alpha, dropout, targets), checked against the model family
// ("transformer" or "ssm"). Errors name the file and the field.
absl::StatusOr<LoraOptions> ReadLoraAdapterConfig(const std::string& dir, const LoraKind& kind);

// Loads a saved adapter into `model`. LoRA off: enables it with the adapter's options first. LoRA on: its rank,
// alpha and targets must equal the adapter's (dropout may differ: it is a training setting). Every tensor of the
// file must be an adapter of this model with the model's shape, and every adapter of the model must be in the
// file; errors name the file, the tensor and both shapes ("an adapter for a different base model"). On error the
// adapter weights are left unchanged.
absl::Status LoadLoraAdapter(Model& model, const std::string& dir);

}  // namespace sg
