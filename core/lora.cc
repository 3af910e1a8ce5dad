#include "core/lora.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/model.h"

namespace sg {

absl::Status Model::EnableLora(const LoraOptions&) {
  return absl::UnimplementedError(absl::StrCat("LoRA is not supported for '", family(), "' models"));
}

const LoraAdapter* LoraInfo::AdapterOfParam(int index) const {
  for (const LoraAdapter& a : adapters)
    if (a.a == index || a.b == index) return &a;
  return nullptr;
}

const LoraAdapter* LoraInfo::AdapterOfWeight(int index) const {
  for (const LoraAdapter& a : adapters)
    if (a.weight == index) return &a;
  return nullptr;
}

LoraKind LoraKind::Of(const Model& model) { return {model.family(), model.architecture()}; }

namespace {
// PEFT 0.21's Mamba model types (tuners_utils' mamba_model_types), where it refuses LoRA on out_proj and conv1d.
bool PeftMambaType(const LoraKind& kind) {
  static const std::set<std::string> types = {"mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h"};
  return kind.family == "ssm" || types.count(kind.architecture) > 0;
}

// Why a module that the engine could adapt, or one of a Mamba mixer, is refused (PEFT 0.21, transformers 5.x), or
// null.
const char* Refusal(const std::string& module, const LoraKind& kind) {
  if (PeftMambaType(kind) && (module == "out_proj" || module == "conv1d"))
    return "PEFT refuses LoRA on out_proj and conv1d of Mamba model types ('incompatible with Mamba-based models'), "
           "so the adapter could not be loaded there";
  if (kind.family == "ssm" && module == "dt_proj")
    return "transformers' Mamba multiplies dt_proj.weight directly instead of calling dt_proj, so PeftModel would "
           "ignore an adapter there (it would count only after merge_and_unload)";
  if (kind.family == "transformer" && module == "conv1d")
    return "the engine adapts linear layers only, and transformers' Mamba-2 mixers read conv1d.weight directly "
           "instead of calling conv1d, so PeftModel would ignore an adapter there";
  return nullptr;
}
}  // namespace

std::vector<std::string> LoraTargetModules(const LoraKind& kind) {
  if (kind.family == "ssm") return {"in_proj", "x_proj"};
  // Attention and the MLP, the Gated DeltaNet projections of the hybrids (Qwen3.5's, Qwen3-Next's fused ones) and
  // the Mamba-2 mixers' (out_proj: both kinds of mixer), less what PEFT refuses for the architecture.
  std::vector<std::string> out;
  for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                        "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "in_proj", "out_proj"})
    if (!Refusal(m, kind)) out.push_back(m);
  return out;
}

std::vector<std::string> LoraTargetParameters(const LoraKind& kind) {
  if (kind.family == "ssm") return {};
  return {"experts.gate_up_proj", "experts.down_proj"};
}

bool IsLoraTargetParameter(const std::string& target) { return target.find('.') != std::string::npos; }

std::string LoraParameterTarget(const std::string& name) {
  const size_t last = name.rfind('.');
  if (last == std::string::npos || last == 0) return name;
  const size_t before = name.rfind('.', last - 1);
  return before == std::string::npos ? name : name.substr(before + 1);
}

std::string LoraExpertWrapper(const std::vector<std::string>& names, size_t i) {
  auto module_of = [](const std::string& name) { return name.substr(0, name.rfind('.')); };
  std::string path = module_of(names[i]);
  for (size_t j = i + 1; j < names.size(); ++j)
    if (module_of(names[j]) == module_of(names[i])) path += ".base_layer";
  return path;
}

std::string DefaultLoraTargets(const LoraKind& kind) {
  if (kind.family == "ssm") return "in_proj,x_proj";
  if (kind.architecture == "mamba2") return "in_proj";  // its only target (PEFT has no default for it)
  if (kind.architecture == "nemotron_h") return "q_proj,k_proj,v_proj,o_proj";  // PEFT's default
  return "q_proj,v_proj";
}

absl::StatusOr<std::vector<std::string>> ParseLoraTargets(const std::string& text, const LoraKind& kind) {
  if (text == "all") return LoraTargetModules(kind);
  if (absl::EqualsIgnoreCase(text, "all-linear")) {
    if (PeftMambaType(kind))
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_targets: 'all-linear' on a ", kind.family == "ssm" ? "Mamba" : kind.architecture,
          " model includes out_proj", kind.family == "ssm" ? " and dt_proj, which PEFT refuses or ignores" :
          ", which PEFT refuses", "; use 'all' (", absl::StrJoin(LoraTargetModules(kind), ","), ")"));
    return LoraTargetModules(kind);
  }
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::string name(absl::StripAsciiWhitespace(part));
    if (name.empty())
      return absl::InvalidArgumentError(absl::StrCat("--lora_targets: empty module name in '", text, "'"));
    out.push_back(name);
  }
  LoraOptions o;
  o.rank = 1;
  o.targets = out;
  if (absl::Status s = ValidateLoraOptions(o, kind); !s.ok()) return s;
  return out;
}

absl::Status ValidateLoraOptions(const LoraOptions& o, const LoraKind& kind) {
  if (o.rank <= 0) return absl::InvalidArgumentError(absl::StrCat("--lora_rank must be positive, got ", o.rank));
  if (!(o.alpha > 0) || !std::isfinite(o.alpha))
    return absl::InvalidArgumentError(absl::StrCat("--lora_alpha must be a positive number, got ", o.alpha));
  if (!(o.dropout >= 0 && o.dropout < 1))
    return absl::InvalidArgumentError(absl::StrCat("--lora_dropout must be in [0, 1), got ", o.dropout));
  if (o.targets.empty()) return absl::InvalidArgumentError("--lora_targets is empty");
  std::vector<std::string> known = LoraTargetModules(kind);
  for (const std::string& p : LoraTargetParameters(kind)) known.push_back(p);
  std::set<std::string> seen;
  for (const std::string& t : o.targets) {
    if (const char* why = Refusal(t, kind))
      return absl::InvalidArgumentError(absl::StrCat("--lora_targets: '", t, "' is not supported",
                                                     kind.architecture.empty() ? "" : " on " + kind.architecture,
                                                     ": ", why));
    if (std::find(known.begin(), known.end(), t) == known.end())
      return absl::InvalidArgumentError(absl::StrCat("--lora_targets: '", t, "' is not a linear module or expert ",
                                                     "weight of a ", kind.family == "ssm" ? "Mamba" : "transformer",
                                                     " model (known: ", absl::StrJoin(known, ", "), ")"));
    if (!seen.insert(t).second)
      return absl::InvalidArgumentError(absl::StrCat("--lora_targets: '", t, "' is listed twice"));
    if (o.dropout > 0 && IsLoraTargetParameter(t))
      return absl::InvalidArgumentError(absl::StrCat(
          "--lora_dropout ", o.dropout, " with the expert weight '", t, "' in --lora_targets: PEFT refuses "
          "lora_dropout != 0 on target_parameters (it adds B A to the weight, where the input cannot be dropped)"));
  }
  return absl::OkStatus();
}

absl::Status EnableLora(Model& model, const LoraOptions& o) { return model.EnableLora(o); }

LoraDisabled::LoraDisabled(const Model& model) : lora_(model.lora()) {
  if (!lora_) return;
  was_disabled_ = lora_->disabled;
  lora_->disabled = true;
}
LoraDisabled::~LoraDisabled() {
  if (lora_) lora_->disabled = was_disabled_;
}

namespace {
template <typename T>
void Merge(Model& model, const LoraAdapter& ad, void* dst) {
  const std::vector<Param>& params = model.params();
  const Tensor& base = params[ad.weight].value;  // bf16 under --dtype=bf16
  // Each on its own device: offloaded expert weights are in host memory beside adapters on the GPU.
  std::vector<uint16_t> base16;
  std::vector<T> base_t, a_copy, b_copy;
  const uint16_t* w16 = base.dtype() == DType::kBF16
                            ? HostReadable(base.device(), base.data<uint16_t>(), base.numel(), &base16) : nullptr;
  const T* wt = w16 ? nullptr : HostReadable(base.device(), base.data<T>(), base.numel(), &base_t);
  auto w = [&](int64_t i) -> double { return w16 ? BF16ToF32(w16[i]) : wt[i]; };
  const Tensor &a_w = params[ad.a].value, &b_w = params[ad.b].value;
  const T* a = HostReadable(a_w.device(), a_w.data<T>(), a_w.numel(), &a_copy);
  const T* b = HostReadable(b_w.device(), b_w.data<T>(), b_w.numel(), &b_copy);
  const int64_t r = model.lora()->options.rank, E = std::max<int64_t>(ad.experts, 1);
  const double s = model.lora()->scale();
  // B_e's (o, k) in B [out][r E] (an expert weight's, lora.h) or B [out][r].
  auto b_at = [&](int64_t e, int64_t o, int64_t k) { return ad.experts ? (o * r + k) * E + e : o * r + k; };
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < ad.out; ++o)
      for (int64_t i = 0; i < ad.in; ++i) {
        double ba = 0;
        for (int64_t k = 0; k < r; ++k) ba += static_cast<double>(b[b_at(e, o, k)]) * a[(e * r + k) * ad.in + i];
        const int64_t at = (e * ad.out + o) * ad.in + i;
        const double merged = w(at) + s * ba;
        if (base.dtype() == DType::kBF16) static_cast<uint16_t*>(dst)[at] = F32ToBF16(static_cast<float>(merged));
        else static_cast<T*>(dst)[at] = static_cast<T>(merged);
      }
}
}  // namespace

void MergedWeight(Model& model, const LoraAdapter& adapter, void* dst) {
  if (model.dtype() == DType::kF64) Merge<double>(model, adapter, dst);
  else Merge<float>(model, adapter, dst);
}

void RandomizeLoraB(Model& model, uint64_t seed, double stddev) {
  if (!model.lora()) return;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  for (const LoraAdapter& ad : model.lora()->adapters) {
    Param& p = model.params()[ad.b];
    std::vector<double> v64;
    std::vector<float> v32;
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      if (model.dtype() == DType::kF64) v64.push_back(normal(rng));
      else v32.push_back(static_cast<float>(normal(rng)));
    }
    CopyFromHost(p.value, model.dtype() == DType::kF64 ? static_cast<const void*>(v64.data()) : v32.data());
  }
}

}  // namespace sg
