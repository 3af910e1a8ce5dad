// The transformer family (Llama, Qwen2, Qwen3; the Qwen3-Next / Qwen3.5 hybrids) behind core/models/family.h.
#include "core/models/family.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/models/transformer/config.h"
#include "core/models/transformer/transformer.h"
#include "core/tensor_parallel.h"

namespace sg {
namespace {

class TransformerSpec final : public ModelSpec {
 public:
  explicit TransformerSpec(TransformerConfig config) : c_(std::move(config)) {}

  std::string architecture() const override { return c_.architecture; }
  bool tied_embeddings() const override { return c_.tie_word_embeddings; }
  std::string HFConfigJson() const override { return io::TransformerConfigToHFJson(c_); }
  absl::StatusOr<ModelFootprint> Footprint(DType dtype) const override { return sg::Footprint(c_, dtype); }
  absl::StatusOr<std::unique_ptr<Model>> Create(DType dtype, Device device, const TensorParallel& tp, bool frozen_base,
                                                bool offload_experts) const override {
    return AsModel(CreateTransformer(c_, dtype, device, tp, frozen_base, offload_experts));
  }

  // Hybrids, as transformers initialises them: zero-centred norms 0 (they multiply by 1 + w), dt_bias 1, A_log
  // spread over log 1 .. log 16; Mamba-2's A_log log 1 .. log heads, dt_bias and D 1 (Bamba's).
  void InitRandom(Model& model, uint64_t seed) const override {
    ModelSpec::InitRandom(model, seed);
    if (model.memory().device() == Device::kMeta) return;  // meta tensors hold no values
    if (c_.mamba_family()) return InitMamba2(model);
    if (!c_.hybrid()) return;
    for (Param& p : model.params()) {
      const std::string& n = p.name;
      if (EndsWith(n, "linear_attn.dt_bias")) {
        SetFromHost(p.value, [](int64_t) { return 1.0; });
      } else if (EndsWith(n, "linear_attn.A_log")) {
        const int64_t heads = p.value.numel();
        SetFromHost(p.value, [&](int64_t h) { return std::log(1.0 + 15.0 * h / std::max<int64_t>(1, heads - 1)); });
      } else if (EndsWith(n, "layernorm.weight") || EndsWith(n, "q_norm.weight") || EndsWith(n, "k_norm.weight") ||
                 n == c_.prefix() + "norm.weight") {
        SetFromHost(p.value, [](int64_t) { return 0.0; });
      }
    }
  }
  std::vector<std::string> CarriedTensors() const override {
    if (!c_.hybrid()) return {};
    return {"model.visual.", "mtp."};  // transformers' Qwen3.5 / Qwen3-Next causal LMs skip these too
  }
  std::string RequiredCarriedTensors() const override { return c_.conditional ? "model.visual." : ""; }
  // MoE layers: the experts one by one (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE: experts.{e}.gate_proj / up_proj /
  // down_proj; Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2, and its router block_sparse_moe.gate).
  std::vector<StoredPiece> StoredLayout(const std::string& param) const override {
    if (c_.moe_layers.empty()) return {};
    const MoeConfig& m = c_.moe;
    const int64_t I = m.intermediate, d = c_.hidden_size;
    const bool mixtral = c_.architecture == "mixtral";
    auto strip = [&](const std::string& suffix) -> std::optional<std::string> {
      if (param.size() < suffix.size() || param.compare(param.size() - suffix.size(), suffix.size(), suffix) != 0)
        return std::nullopt;
      return param.substr(0, param.size() - suffix.size()) + (mixtral ? "block_sparse_moe." : "mlp.");
    };
    std::vector<StoredPiece> pieces;
    if (std::optional<std::string> p = strip("mlp.experts.gate_up_proj")) {
      for (int64_t e = 0; e < m.experts; ++e) {
        const std::string expert = absl::StrCat(*p, "experts.", e, ".");
        pieces.push_back({expert + (mixtral ? "w1" : "gate_proj") + ".weight", 2 * I * e, I});
        pieces.push_back({expert + (mixtral ? "w3" : "up_proj") + ".weight", 2 * I * e + I, I});
      }
    } else if (std::optional<std::string> p = strip("mlp.experts.down_proj")) {
      for (int64_t e = 0; e < m.experts; ++e)
        pieces.push_back({absl::StrCat(*p, "experts.", e, ".", mixtral ? "w2" : "down_proj", ".weight"), d * e, d});
    } else if (std::optional<std::string> p = strip("mlp.gate.weight"); p && mixtral) {
      pieces.push_back({*p + "gate.weight", 0, m.experts});
    }
    return pieces;
  }

  int64_t MatmulParams() const override {
    const int64_t d = c_.hidden_size, qd = c_.num_heads * c_.head_dim, kvd = c_.num_kv_heads * c_.head_dim;
    const int64_t attention = (c_.hybrid() ? 2 : 1) * qd * d + 2 * kvd * d + d * qd;
    const LinearAttentionConfig& a = c_.linear;
    const int64_t linear = (a.conv_dim() + 2 * a.value_dim() + 2 * a.value_heads) * d;
    const int64_t lin = LinearLayers();
    // A MoE layer multiplies each token by its router, top_k experts and the shared expert: the active parameters.
    const MoeConfig& m = c_.moe;
    const int64_t moe = (m.experts + 3 * m.top_k * m.intermediate + 3 * m.shared_intermediate + 1) * d;
    const int64_t moe_layers = MoeLayers();
    const int64_t mamba = (c_.mamba.in_proj_rows() + c_.mamba.intermediate()) * d;  // in_proj, out_proj
    const int64_t swiglu = c_.mlp_count(Mlp::kSwiGlu) - moe_layers, relu2 = c_.mlp_count(Mlp::kRelu2);
    return AttentionLayers() * attention + lin * linear + c_.mamba_layer_count() * mamba +
           (3 * swiglu + 2 * relu2) * c_.intermediate_size * d + moe_layers * moe + c_.vocab_size * d;
  }
  // 6 x matmul parameters x tokens, causal attention (QK^T and PV, 2 FLOPs per multiply-add, over the T (T + 1) / 2
  // pairs) and the linear layers' conv and gated delta rule, x3 for forward and backward.
  int64_t StepFlops(int64_t seq_len) const override {
    const int64_t T = seq_len, causal_pairs = T * (T + 1) / 2, A = AttentionLayers();
    return 6 * MatmulParams() * T + 3 * 4 * c_.head_dim * c_.num_heads * A * causal_pairs +
           3 * RecurrentMixingPerToken() * T;
  }
  double MixingForwardFlops(int64_t T) const override {
    const double per_layer = 2.0 * 2.0 * (static_cast<double>(T) * T / 2.0) * c_.num_heads * c_.head_dim;
    return per_layer * AttentionLayers() + static_cast<double>(RecurrentMixingPerToken()) * static_cast<double>(T);
  }
  std::string Description() const override {
    std::string linear = LinearLayers() > 0 ? absl::StrFormat(" (%d Gated DeltaNet, %d/%d heads)", LinearLayers(),
                                                              c_.linear.value_heads, c_.linear.key_heads)
                                            : "";
    if (const int64_t M = c_.mamba_layer_count(); M > 0)
      linear += absl::StrFormat(" (%d Mamba-2, %d heads of %d, state %d)", M, c_.mamba.heads, c_.mamba.head_dim,
                                c_.mamba.state);
    return absl::StrFormat("%s, d=%d, layers=%d%s, heads=%d/%d kv, ffn=%d, vocab=%d", c_.architecture, c_.hidden_size,
                           c_.num_layers, linear, c_.num_heads, c_.num_kv_heads, c_.intermediate_size, c_.vocab_size);
  }
  std::vector<Field> Fields() const override {
    return {{"architecture", c_.architecture}, {"vocab_size", c_.vocab_size},
            {"hidden_size", c_.hidden_size},   {"num_layers", c_.num_layers},
            {"num_heads", c_.num_heads},       {"num_kv_heads", c_.num_kv_heads},
            {"head_dim", c_.head_dim},         {"intermediate_size", c_.intermediate_size}};
  }

 private:
  static bool EndsWith(const std::string& n, const std::string& suffix) {
    return n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  void InitMamba2(Model& model) const {
    for (Param& p : model.params()) {
      if (EndsWith(p.name, ".A_log")) {
        SetFromHost(p.value, [](int64_t h) { return std::log(1.0 + static_cast<double>(h)); });
      } else if (EndsWith(p.name, ".dt_bias") || EndsWith(p.name, ".D")) {
        SetFromHost(p.value, [](int64_t) { return 1.0; });
      }
    }
  }
  int64_t MoeLayers() const { return c_.moe_layer_count(); }
  int64_t LinearLayers() const { return c_.linear_layer_count(); }
  // Forward FLOPs of one token in a Gated DeltaNet layer: the conv, and per value head the state's decay, S^T k,
  // its rank-1 update and S^T q.
  int64_t LinearMixingPerToken() const {
    const LinearAttentionConfig& a = c_.linear;
    return 2 * a.conv_dim() * a.conv_kernel + 7 * a.value_heads * a.key_head_dim * a.value_head_dim;
  }
  // Forward FLOPs of one token in a Mamba-2 layer: the conv, and per head the state's decay, its update dt x B^T and
  // S C.
  int64_t Mamba2MixingPerToken() const {
    const Mamba2Config& m = c_.mamba;
    return 2 * m.conv_dim() * m.conv_kernel + 5 * m.heads * m.head_dim * m.state;
  }
  int64_t RecurrentMixingPerToken() const {
    return LinearLayers() * LinearMixingPerToken() + c_.mamba_layer_count() * Mamba2MixingPerToken();
  }
  int64_t AttentionLayers() const { return c_.attention_layer_count(); }
  TransformerConfig c_;
};

class TransformerFamily final : public ModelFamily {
 public:
  std::string name() const override { return "transformer"; }
  std::vector<std::string> PresetNames() const override { return TransformerPresetNames(); }
  std::unique_ptr<ModelSpec> Preset(const std::string& name) const override {
    absl::StatusOr<TransformerConfig> c = TransformerPreset(name);
    return c.ok() ? std::make_unique<TransformerSpec>(*c) : nullptr;
  }
  bool Reads(const std::optional<std::string>& model_type,
             const std::vector<std::string>& architectures) const override {
    static const std::set<std::string> types = {
        "llama",      "qwen2",        "qwen3",      "qwen3_moe",        "mixtral",
        "qwen3_next", "qwen3_5_text", "qwen3_5",    "qwen3_5_moe_text", "qwen3_5_moe",
        "mamba2",     "bamba",        "nemotron_h", "falcon_h1"};
    static const std::set<std::string> classes = {"LlamaForCausalLM",      "Qwen2ForCausalLM",
                                                  "Qwen3ForCausalLM",      "Qwen3MoeForCausalLM",
                                                  "MixtralForCausalLM",    "Qwen3NextForCausalLM",
                                                  "Qwen3_5ForCausalLM",    "Qwen3_5ForConditionalGeneration",
                                                  "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                                                  "Mamba2ForCausalLM",     "BambaForCausalLM",
                                                  "NemotronHForCausalLM",  "FalconH1ForCausalLM"};
    if (model_type) return types.count(*model_type) > 0;
    for (const std::string& a : architectures)
      if (classes.count(a)) return true;
    return false;
  }
  absl::StatusOr<std::unique_ptr<ModelSpec>> ParseConfig(const std::string& json_text,
                                                         const std::string& source_name) const override {
    return AsSpec<TransformerSpec>(io::ParseTransformerConfig(json_text, source_name));
  }
};

}  // namespace

std::unique_ptr<ModelSpec> TransformerModel::spec() const { return std::make_unique<TransformerSpec>(config()); }

const ModelFamily& TransformerModelFamily() {
  static const TransformerFamily family;
  return family;
}

}  // namespace sg
