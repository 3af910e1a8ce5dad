// LoRA (Hu et al. 2021) on the linear layers of either model family, in Hugging Face PEFT's convention: a module
// with weight W [out][in] computes y = x W^T + (alpha / r) * dropout(x) A^T B^T with lora_A.weight A [r][in]
// (Kaiming-uniform, bound 1/sqrt(in), as PEFT) and lora_B.weight B [out][r] (zeros). The adapters are ordinary
// parameters of the model (named "<module>.lora_A.weight", e.g. "model.layers.0.self_attn.q_proj.lora_A.weight")
// and live inside the layers' linear ops, so every strategy trains them unchanged. Enabling LoRA freezes every base
// parameter: their gradients are released, so the engine's grads category and the optimizer's moments hold the
// adapters only.
//
// Dropout acts on the adapter's input only. Its mask is a hash of (the sequence's seed, the module, the absolute
// position, the feature; kernels/dropout_mask.h): every pass over the same position of the same sequence (seco's and
// streambp's recomputation, ckpt's replay) draws the same mask, so chunked strategies stay exact against full
// backprop. The backends apply it in a kernel (OpTable::lora_dropout): the same bits on every device. The
// seed is StrategyOptions::seed, which the Trainer derives per step and sequence; passes without gradients
// (evaluation, log-prob passes) use no dropout.
//
// Expert weights (a MoE layer's mlp.experts.gate_up_proj [E][2I][d] and mlp.experts.down_proj [E][d][I]) take
// LoRA as PEFT 0.21's target_parameters does (lora.ParamWrapper; transformers 5 fuses the experts into these 3-D
// parameters, so target_modules cannot reach a single expert): for a weight [E][out][in], lora_A.weight is
// [E r][in] and lora_B.weight [out][r E], and expert e's weight is W_e + (alpha / r) B_e A_e with A_e = rows
// [e r, e r + r) of A and B_e [out][r] = columns k E + e (k < r) of B, i.e. PEFT's einsum("o r e, e r i -> e o i").
// PEFT refuses lora_dropout != 0 there (the delta is added to the weight), and so does the engine. Two adapted
// parameters of one module nest: the first in the module's order (gate_up_proj) is the inner wrapper, named
// "<module>.base_layer.lora_A.weight", the other "<module>.lora_A.weight".
//
// Files: core/lora_io.h saves and loads adapters as PEFT files; SaveModel (core/model_io.h) writes the merged
// weights W + (alpha / r) B A of a LoRA model, i.e. a plain HF model.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dropout_mask.h"  // the dropout mask: LoraRowKey, LoraKeep

namespace sg {

class Model;

struct LoraOptions {
  int64_t rank = 0;    // r; 0 = LoRA off
  double alpha = 16;   // lora_alpha: the adapter's output is scaled by alpha / r
  double dropout = 0;  // lora_dropout, in [0, 1)
  // HF module names (the last component of the module path), a set: q_proj, k_proj, v_proj, o_proj, gate_proj,
  // up_proj, down_proj (Llama, Qwen2); in_proj, out_proj (Mamba-2 mixers, where PEFT allows); in_proj, x_proj
  // (Mamba: what PEFT accepts and applies, LoraTargetModules); and the expert weights of MoE layers by parameter
  // name: experts.gate_up_proj, experts.down_proj.
  std::vector<std::string> targets = {"q_proj", "v_proj"};
  uint64_t seed = 0;  // initialisation of A
};

// One adapted linear layer.
struct LoraAdapter {
  std::string module;  // HF module path, e.g. "model.layers.0.self_attn.q_proj"
  int weight = -1;     // index of "<module>.weight" in Model::params()
  int a = -1, b = -1;  // indices of "<module>.lora_A.weight" [rank][in] and "<module>.lora_B.weight" [out][rank]
  int64_t in = 0, out = 0;
  // > 0: weight is [experts][out][in] (an expert parameter; module is PEFT's wrapper path, e.g.
  // "model.layers.0.mlp.experts.base_layer"), A is [experts rank][in] and B [out][rank experts].
  int64_t experts = 0;
};

// A model's adapters (Model::lora()).
struct LoraInfo {
  LoraOptions options;
  std::vector<LoraAdapter> adapters;  // in the order of the model's modules
  double scale() const { return options.alpha / static_cast<double>(options.rank); }
  // Adapters skipped, the model computes as its base model (LoraDisabled): a switch, not part of the adapters.
  mutable bool disabled = false;
  // The adapter whose lora_A or lora_B is parameter `index`, or null.
  const LoraAdapter* AdapterOfParam(int index) const;
  // The adapter of base weight `index`, or null.
  const LoraAdapter* AdapterOfWeight(int index) const;
};

// Whose rules LoRA follows: a model's family ("transformer", "ssm") and architecture (Hugging Face's model_type,
// on which PEFT 0.21 keys some refusals, e.g. out_proj on mamba2 and nemotron_h). A family alone (tests; no model
// yet) takes the family's rules.
struct LoraKind {
  LoraKind(const char* family) : family(family) {}             // NOLINT: a family name reads as its kind
  LoraKind(std::string family, std::string architecture = "")  // NOLINT
      : family(std::move(family)), architecture(std::move(architecture)) {}
  static LoraKind Of(const Model& model);
  std::string family, architecture;
};

// The module names LoRA can target in a model of this kind: those whose adapters PEFT 0.21 loads and applies as
// the engine does. PEFT refuses out_proj and conv1d on its Mamba model types ("incompatible with Mamba-based
// models": mamba, mamba2, nemotron_h, falcon_h1), transformers' Mamba multiplies dt_proj.weight directly and its
// Mamba-2 mixers read conv1d.weight directly, so PeftModel would ignore an adapter there: ValidateLoraOptions refuses
// those, saying why.
std::vector<std::string> LoraTargetModules(const LoraKind& kind);
// The expert parameters LoRA can target (PEFT's target_parameters, written as the engine's --lora_targets names):
// experts.gate_up_proj and experts.down_proj for transformers, none for Mamba.
std::vector<std::string> LoraTargetParameters(const LoraKind& kind);
bool IsLoraTargetParameter(const std::string& target);  // "experts.gate_up_proj": a name with a '.'
// The target name of a parameter: its last two components ("model.layers.0.mlp.experts.down_proj": experts.down_proj).
std::string LoraParameterTarget(const std::string& param_name);
// PEFT's wrapper path of adapted expert parameter names[i] (names: every adapted expert parameter of the model, in
// the model's order): its module, plus ".base_layer" per adapted parameter of the same module after it.
std::string LoraExpertWrapper(const std::vector<std::string>& names, size_t i);

// The targets when none are given: "q_proj,v_proj" (transformers), PEFT's default where it has one for the
// architecture (nemotron_h: "q_proj,k_proj,v_proj,o_proj"), "in_proj" (mamba2), "in_proj,x_proj" (Mamba).
std::string DefaultLoraTargets(const LoraKind& kind);
// "q_proj,v_proj" -> {"q_proj", "v_proj"}; "all" = every module of the kind; "all-linear" (PEFT's shorthand, any
// case) = every linear layer but the LM head, i.e. "all" for transformers (refused for PEFT's Mamba model types,
// where it includes out_proj, and dt_proj on Mamba). Errors name --lora_targets.
absl::StatusOr<std::vector<std::string>> ParseLoraTargets(const std::string& text, const LoraKind& kind);
// Checks rank > 0, alpha finite and > 0, dropout in [0, 1) (0 with an expert parameter target, as PEFT), targets
// non-empty, known to the family and not repeated; errors name the flag (--lora_rank, ...) and, for a module PEFT
// cannot use, the reason.
absl::Status ValidateLoraOptions(const LoraOptions& o, const LoraKind& kind);

// Adds adapters to every module of `model` whose name is in o.targets and freezes every base parameter. Once per
// model. Restarts the memory tracker's peaks (the released base gradients are no part of what training needs).
absl::Status EnableLora(Model& model, const LoraOptions& o);

// While alive, `model` computes as its base model: every adapter is skipped (no-op when LoRA is off). The
// reference of dpo/grpo with LoRA (Trainer::set_reference_base_model): no second model, no copy of the weights.
class LoraDisabled {
 public:
  explicit LoraDisabled(const Model& model);
  ~LoraDisabled();
  LoraDisabled(const LoraDisabled&) = delete;
  LoraDisabled& operator=(const LoraDisabled&) = delete;

 private:
  const LoraInfo* lora_;
  bool was_disabled_ = false;
};

// The merged weight W + (alpha / r) B A of an adapted module, in W's storage dtype (bf16 under bf16 storage, the
// sum rounded once), into dst (numel of W elements). The model is not changed.
void MergedWeight(Model& model, const LoraAdapter& adapter, void* dst);

// Tests and gradient checks: B starts at zero, which makes every gradient of A zero; this draws B from
// normal(0, stddev) so that both are exercised.
void RandomizeLoraB(Model& model, uint64_t seed, double stddev);

}  // namespace sg
