// Models from presets or Hugging Face directories (config.json + safetensors), and back to disk.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"

namespace sg {

// `spec` is a preset name (random init from `seed`) or a directory holding config.json and model.safetensors
// or model.safetensors.index.json. Relative paths are taken as given (callers resolve them).
// The model lives on `device` (its tensors and ops; CUDA needs a --config=cuda build and a GPU).
absl::StatusOr<std::unique_ptr<TransformerModel>> LoadModel(const std::string& spec, DType dtype, uint64_t seed,
                                                            Device device = Device::kCPU);

// Any family: a transformer or Mamba preset, or a directory whose config.json model_type is llama, qwen2 or mamba
// (MambaForCausalLM). LoadModel above takes transformers only.
// frozen_base: no parameter gets a gradient (LoRA's adapters, added next, will; or the model only scores): the
// base's fp32 gradients are never allocated. offload_experts (with frozen_base): a mixture of experts' expert weights
// are made in host memory layer by layer (--offload_experts), so the device never holds them all.
absl::StatusOr<std::unique_ptr<Model>> LoadAnyModel(const std::string& spec, DType dtype, uint64_t seed,
                                                    Device device = Device::kCPU, bool frozen_base = false,
                                                    bool offload_experts = false);

// Loads HF weights into an existing model by parameter name, checking every shape.
absl::Status LoadWeights(Model& model, const std::string& dir);

// What SaveModel writes the weights in: nullopt (the default) as the model stores them, a bf16-storage model's
// matrices in bf16 (its norms and biases in f32, as trained: nothing is rounded); kF32 every tensor in f32 (a bf16
// model's matrices widened exactly, an f64 model's rounded); kBF16 only for a bf16 model (what it stores).
using SaveDType = std::optional<DType>;
// --save_dtype and the bindings' save_dtype: "" (as stored), "f32" or "bf16"; errors name `what`.
absl::StatusOr<SaveDType> ParseSaveDType(const std::string& name, const std::string& what = "--save_dtype");
// Whether `model` can be saved in `dtype` (checked by SaveModel; tools check it before training).
absl::Status CheckSaveDType(Model& model, SaveDType dtype, const std::string& what = "--save_dtype");

// Writes a Hugging Face model directory that transformers loads: model.safetensors in `dtype` (see SaveDType) and
// config.json labelled with it (torch_dtype and dtype: bfloat16 for a bf16 model saved as stored). `source` is the
// spec the model was loaded from: when it is a directory, config.json keeps every field of the source's that the
// engine does not write (bos / eos / pad token ids, ...) and generation_config.json, the tokenizer files and the
// chat template are copied over.
// Transformers and Mamba models alike. A LoRA model is written merged (W + alpha/r B A, no adapter tensors): a
// plain HF model; core/lora_io.h writes the adapters themselves.
// The save is all or nothing: everything is written into a directory beside `dir` first, so that when anything fails
// (a tokenizer file that cannot be read, a full disk) `dir` stays as it was. That directory then replaces `dir` in
// one rename, so `dir` holds exactly the new model (no stale shards or index). Where `dir` also holds entries that
// are no model files (e.g. train's checkpoint-N directories), they stay: the model's files are replaced one by one
// (each in one rename, config.json last), and an earlier sharded model there is refused, naming its file.
// Files it carries over must be regular files (at most 1 GiB, .json ones valid JSON) inside the source directory
// (or, for a snapshot of a Hugging Face hub cache, in the cache's blobs): a link out of it is refused, naming the file,
// so that nothing from elsewhere (a secret, another model) lands in a directory users upload. Every check of
// CheckModelSave runs before anything is written.
absl::Status SaveModel(Model& model, const std::string& dir, const std::string& source = "",
                       SaveDType dtype = std::nullopt);

// What SaveModel(model, dir, source) will need, checked without writing anything, so that tools refuse a save that
// cannot work before training rather than after: `dir` is a directory or absent (not a file, a link or a device
// such as /dev/null), its parent a directory that can be written, no earlier sharded model blocks an in-place save,
// and the source's config.json and carried files pass the checks above. Staging directories that killed saves left
// beside `dir` are removed (a live save's are locked and stay).
absl::Status CheckModelSave(const std::string& dir, const std::string& source = "");

// The same for a directory that files are written into directly (core/lora_io.h's adapters): a directory that can be
// written, or absent with a parent that can.
absl::Status CheckWritableTarget(const std::string& dir);

}  // namespace sg
