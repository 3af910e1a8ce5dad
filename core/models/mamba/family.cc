// The Mamba-1 family (HF MambaForCausalLM) behind core/models/family.h.
#include "core/models/family.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/models/mamba/config.h"
#include "core/models/mamba/mamba.h"
#include "core/tensor_parallel.h"

namespace sg {
namespace {

class MambaSpec final : public ModelSpec {
 public:
  explicit MambaSpec(MambaConfig config) : c_(config) {}

  std::string architecture() const override { return "mamba"; }
  bool tied_embeddings() const override { return c_.tie_word_embeddings; }
  std::string HFConfigJson() const override { return io::MambaConfigToHFJson(c_); }
  absl::StatusOr<ModelFootprint> Footprint(DType dtype) const override { return sg::Footprint(c_, dtype); }
  absl::StatusOr<std::unique_ptr<Model>> Create(DType dtype, Device device, const TensorParallel& tp, bool frozen_base,
                                                bool offload_experts) const override {
    if (offload_experts)
      return absl::InvalidArgumentError("--offload_experts: this mamba model has no mixture-of-experts layers");
    return AsModel(CreateMamba(c_, dtype, device, tp, frozen_base));
  }
  // The matrices as every family's, then the scan's own initialisation (InitMambaScan).
  void InitRandom(Model& model, uint64_t seed) const override {
    ModelSpec::InitRandom(model, seed);
    InitMambaScan(static_cast<MambaModel&>(model), seed);
  }

  int64_t MatmulParams() const override {
    const int64_t d = c_.hidden_size, di = c_.intermediate_size, r = c_.time_step_rank, n = c_.state_size;
    const int64_t per_layer = 2 * di * d + (r + 2 * n) * di + di * r + d * di;  // in, x, dt, out projections
    return c_.num_layers * per_layer + c_.vocab_size * d;
  }
  int64_t StepFlops(int64_t seq_len) const override { return 6 * MatmulParams() * seq_len; }
  // The scan and the conv: about 6 x d_inner x state + 2 x conv_kernel x d_inner per token and layer.
  double MixingForwardFlops(int64_t T) const override {
    return (6.0 * c_.state_size + 2.0 * c_.conv_kernel) * c_.intermediate_size * T * c_.num_layers;
  }
  std::string Description() const override {
    return absl::StrFormat("mamba, d=%d, layers=%d, d_inner=%d, state=%d, conv=%d, dt_rank=%d, vocab=%d",
                           c_.hidden_size, c_.num_layers, c_.intermediate_size, c_.state_size, c_.conv_kernel,
                           c_.time_step_rank, c_.vocab_size);
  }
  std::vector<Field> Fields() const override {
    return {{"architecture", std::string("mamba")},
            {"vocab_size", c_.vocab_size},
            {"hidden_size", c_.hidden_size},
            {"num_layers", c_.num_layers},
            {"intermediate_size", c_.intermediate_size},
            {"state_size", c_.state_size},
            {"conv_kernel", c_.conv_kernel},
            {"time_step_rank", c_.time_step_rank}};
  }

 private:
  MambaConfig c_;
};

class MambaFamily final : public ModelFamily {
 public:
  std::string name() const override { return "ssm"; }
  std::vector<std::string> PresetNames() const override { return MambaPresetNames(); }
  std::unique_ptr<ModelSpec> Preset(const std::string& name) const override {
    absl::StatusOr<MambaConfig> c = MambaPreset(name);
    return c.ok() ? std::make_unique<MambaSpec>(*c) : nullptr;
  }
  // model_type "mamba"; a config without one, by its architectures.
  bool Reads(const std::optional<std::string>& model_type,
             const std::vector<std::string>& architectures) const override {
    if (model_type) return *model_type == "mamba";
    return std::find(architectures.begin(), architectures.end(), "MambaForCausalLM") != architectures.end();
  }
  absl::StatusOr<std::unique_ptr<ModelSpec>> ParseConfig(const std::string& json_text,
                                                         const std::string& source_name) const override {
    return AsSpec<MambaSpec>(io::ParseMambaConfig(json_text, source_name));
  }
};

}  // namespace

std::unique_ptr<ModelSpec> MambaModel::spec() const { return std::make_unique<MambaSpec>(config()); }

const ModelFamily& MambaModelFamily() {
  static const MambaFamily family;
  return family;
}

}  // namespace sg
