// Model families behind one interface. Beyond the per-layer primitives that strategies schedule (core/model.h), the
// engine asks a family for its presets, how it reads and writes Hugging Face config.json, its size, how to create
// a model (whole or one rank's blocks of a tensor-parallel split), its random initialisation and its FLOPs. Each
// family is one folder under core/models/ and one line in ModelFamilies() (family.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "core/model.h"
#include "core/models/footprint.h"

namespace sg {

struct TensorParallel;  // core/tensor_parallel.h

// One configuration of a family: what a model is created from, and what reports and saves say about it.
class ModelSpec {
 public:
  virtual ~ModelSpec() = default;
  // What error messages call a model of this config: its architecture ("llama", "qwen2", "qwen3", "mamba").
  virtual std::string architecture() const = 0;
  // The LM head shares the embedding matrix (its checkpoints may hold no lm_head.weight, or a duplicate).
  virtual bool tied_embeddings() const = 0;
  // A config.json that transformers loads as this model; the family's parser reads it back unchanged.
  virtual std::string HFConfigJson() const = 0;
  // The parameters and bytes a model of this config takes once created (core/models/footprint.h).
  virtual absl::StatusOr<ModelFootprint> Footprint(DType dtype) const = 0;
  // A model with zero weights (none on meta). With tp.size > 1, rank tp.rank's blocks of a tensor-parallel split
  // under the whole model's names (the model is then also a TensorParallelModel).
  // frozen_base: no parameter gets a gradient (a model for LoRA to adapt, or to score with). offload_experts: a
  // mixture of experts' expert weights made in host memory (--offload_experts; refused where there are none).
  virtual absl::StatusOr<std::unique_ptr<Model>> Create(DType dtype, Device device, const TensorParallel& tp,
                                                        bool frozen_base = false,
                                                        bool offload_experts = false) const = 0;
  // The family's random initialisation of a model created from this spec (by default sg::InitRandom's).
  virtual void InitRandom(Model& model, uint64_t seed) const;
  // Name prefixes of the tensors a checkpoint holds beside the model that the engine does not run (Qwen3.5's
  // vision tower and multi-token-prediction layers): loading skips them and a save copies them from the source
  // directory, so that transformers loads the saved model as it loaded the source.
  virtual std::vector<std::string> CarriedTensors() const { return {}; }
  // Of those, the prefix a save cannot do without (transformers would report its tensors missing); empty: none.
  virtual std::string RequiredCarriedTensors() const { return ""; }
  // How checkpoints store a parameter other than under its own name: the tensors that make it, each a block of rows
  // of the parameter seen as [rows][last dimension] (published MoE checkpoints name experts one by one, while the
  // engine holds a layer's experts in one tensor, as transformers 5 does in memory). Loading takes the parameter's
  // own name or a complete stored layout; saves write the stored layout, as transformers 5.23 saves. Empty: the
  // parameter is stored under its name.
  struct StoredPiece {
    std::string name;
    int64_t row0 = 0, rows = 0;
  };
  virtual std::vector<StoredPiece> StoredLayout(const std::string& param) const { return {}; }

  // Parameters that multiply activations in a matmul: the layers' projections and the LM head (not the embedding
  // lookup, the norms or the biases).
  virtual int64_t MatmulParams() const = 0;
  // The census's FLOPs of one gradient computation over seq_len tokens (core/census.h).
  virtual int64_t StepFlops(int64_t seq_len) const = 0;
  // Forward FLOPs over T tokens of the token mixing that MatmulParams does not count (attention's QK^T and PV, a
  // scan and its convolution), all layers: what the bench adds to its useful FLOPs, x3 for forward and backward.
  virtual double MixingForwardFlops(int64_t T) const = 0;
  // One line for reports ("llama, d=64, layers=2, ...") and the config fields reports list, in order.
  virtual std::string Description() const = 0;
  using Field = std::pair<std::string, std::variant<int64_t, std::string>>;
  virtual std::vector<Field> Fields() const = 0;
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  // Model::family() of its models: "transformer", "ssm".
  virtual std::string name() const = 0;
  virtual std::vector<std::string> PresetNames() const = 0;
  // The preset `name`, or null when the family has none of that name.
  virtual std::unique_ptr<ModelSpec> Preset(const std::string& name) const = 0;
  // Whether a config.json of this model_type (absent: with these architectures) describes one of its models.
  virtual bool Reads(const std::optional<std::string>& model_type,
                     const std::vector<std::string>& architectures) const = 0;
  // config.json's text; errors name source_name and the field.
  virtual absl::StatusOr<std::unique_ptr<ModelSpec>> ParseConfig(const std::string& json_text,
                                                                 const std::string& source_name) const = 0;
};

// What every family's spec and parser convert: a created model of the family's type, a parsed config.
template <typename FamilyModel>
absl::StatusOr<std::unique_ptr<Model>> AsModel(absl::StatusOr<std::unique_ptr<FamilyModel>> model) {
  if (!model.ok()) return model.status();
  return std::unique_ptr<Model>(*std::move(model));
}
template <typename Spec, typename Config>
absl::StatusOr<std::unique_ptr<ModelSpec>> AsSpec(absl::StatusOr<Config> config) {
  if (!config.ok()) return config.status();
  return std::unique_ptr<ModelSpec>(std::make_unique<Spec>(*std::move(config)));
}

// Every family, in the order config.json files are matched against them.
const std::vector<const ModelFamily*>& ModelFamilies();

// Every family's presets, in registry order.
std::vector<std::string> PresetNames();
// The preset `name` of whichever family has it; NotFound naming every preset otherwise.
absl::StatusOr<std::unique_ptr<ModelSpec>> PresetSpec(const std::string& name);
// The config.json text of a Hugging Face model, by the family its model_type names; errors name source_name.
absl::StatusOr<std::unique_ptr<ModelSpec>> ParseConfigSpec(const std::string& json_text,
                                                           const std::string& source_name);
// A directory's config.json (or that file), read and parsed as above.
absl::StatusOr<std::unique_ptr<ModelSpec>> LoadConfigSpec(const std::string& path);

}  // namespace sg
