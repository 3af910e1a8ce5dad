#include "core/model_io.h"

#include <sys/stat.h>

#include <fstream>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/io/hf_config.h"
#include "core/io/safetensors.h"
#include "core/memory.h"
#include "core/model_config.h"
#include "core/lora.h"
#include "core/presets.h"
#include "kernels/backend.h"

namespace sg {
namespace {
bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Refuses, before anything is allocated, a configuration whose sizes overflow or whose parameters (values and
// gradients) do not fit in the memory the device has free. `what` names the config's source for errors.
template <typename Config>
absl::Status CheckModelSize(const Config& config, DType dtype, Device device, const std::string& what) {
  absl::StatusOr<ModelFootprint> f = Footprint(config, dtype);
  if (!f.ok()) return absl::Status(f.status().code(), absl::StrCat(what, ": ", f.status().message()));
  int64_t available = -1;
  if (device == Device::kCPU) {
    available = HostAvailableBytes();
  } else if (const DeviceBackend* b = FindBackend(device); b && b->memory_info) {
    int64_t total = 0;
    b->memory_info(&available, &total);
  }
  return CheckFootprintFits(*f, available, what);
}

std::string ConfigSource(const std::string& spec) { return IsDirectory(spec) ? spec + "/config.json" : spec; }
}  // namespace

// Every parameter by name, checking shapes; tensors the model does not use are an error. A tied head may be
// stored anyway.
static absl::Status LoadParams(Model& model, const std::string& dir, bool tied, const std::string& architecture) {
  absl::StatusOr<io::ShardedSafetensors> files = io::ShardedSafetensors::OpenDir(dir);
  if (!files.ok()) return files.status();
  std::set<std::string> expected;
  const LoraInfo* lora = model.lora();
  for (size_t i = 0; i < model.params().size(); ++i) {
    Param& p = model.params()[i];
    if (lora && lora->AdapterOfParam(static_cast<int>(i))) continue;  // adapters are no part of an HF model
    expected.insert(p.name);
    if (!files->Find(p.name))
      return absl::NotFoundError(absl::StrCat(files->source(), ": tensor '", p.name, "' is missing"));
    if (absl::Status s = files->ReadInto(p.name, p.value.shape(), p.value.dtype(), p.value.raw()); !s.ok()) return s;
  }
  std::vector<std::string> unknown;
  for (const std::string& name : files->TensorNames()) {
    if (expected.count(name)) continue;
    // Buffers some exporters keep, and the duplicate head of tied checkpoints, carry no parameters of ours.
    if (absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && tied) continue;
    unknown.push_back(name);
  }
  if (!unknown.empty())
    return absl::InvalidArgumentError(absl::StrCat(files->source(), ": tensors not used by a ",
                                                   architecture, " model: ", absl::StrJoin(unknown, ", ")));
  return absl::OkStatus();
}

absl::Status LoadWeights(TransformerModel& model, const std::string& dir) {
  return LoadParams(model, dir, model.config().tie_word_embeddings, model.config().architecture);
}

absl::Status LoadWeights(MambaModel& model, const std::string& dir) {
  return LoadParams(model, dir, model.config().tie_word_embeddings, "mamba");
}

absl::StatusOr<std::unique_ptr<Model>> LoadAnyModel(const std::string& spec, DType dtype, uint64_t seed,
                                                     Device device) {
  std::optional<MambaConfig> config;
  if (!IsDirectory(spec)) {
    if (absl::StatusOr<MambaConfig> preset = MambaPreset(spec); preset.ok()) config = *preset;
  } else {
    absl::StatusOr<std::pair<std::string, std::string>> text = io::ReadConfigJson(spec);
    if (!text.ok()) return text.status();
    absl::StatusOr<std::string> family = io::ConfigFamily(text->first, text->second);
    if (!family.ok()) return family.status();
    if (*family == "ssm") {
      absl::StatusOr<MambaConfig> parsed = io::ParseMambaConfig(text->first, text->second);
      if (!parsed.ok()) return parsed.status();
      config = *parsed;
    }
  }
  if (config && dtype == DType::kBF16)
    return absl::UnimplementedError("--dtype=bf16: Mamba (ssm) models run in f32 or f64 only so far");
  if (!config) {
    absl::StatusOr<std::unique_ptr<TransformerModel>> t = LoadModel(spec, dtype, seed, device);
    if (!t.ok()) return t.status();
    return std::unique_ptr<Model>(std::move(*t));
  }
  if (absl::Status s = CheckModelSize(*config, dtype, device, ConfigSource(spec)); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<MambaModel>> model = CreateMamba(*config, dtype, device);
  if (!model.ok()) return model.status();
  if (IsDirectory(spec)) {
    if (absl::Status s = LoadWeights(**model, spec); !s.ok()) return s;
  } else {
    InitOptions init;
    init.seed = seed;
    InitRandom(**model, init);
    InitMambaScan(**model, seed);
  }
  return std::unique_ptr<Model>(std::move(*model));
}

absl::StatusOr<std::unique_ptr<TransformerModel>> LoadModel(const std::string& spec, DType dtype, uint64_t seed,
                                                            Device device) {
  if (!IsDirectory(spec)) {
    absl::StatusOr<TransformerConfig> preset = TransformerPreset(spec);
    if (!preset.ok()) return preset.status();
    if (absl::Status s = CheckModelSize(*preset, dtype, device, spec); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<TransformerModel>> model = CreateTransformer(*preset, dtype, device);
    if (!model.ok()) return model.status();
    InitOptions init;
    init.seed = seed;
    InitRandom(**model, init);
    return model;
  }
  absl::StatusOr<TransformerConfig> config = io::LoadTransformerConfig(spec);
  if (!config.ok()) return config.status();
  if (absl::Status s = CheckModelSize(*config, dtype, device, ConfigSource(spec)); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<TransformerModel>> model = CreateTransformer(*config, dtype, device);
  if (!model.ok())
    return absl::Status(model.status().code(), absl::StrCat(spec, "/config.json: ", model.status().message()));
  if (absl::Status s = LoadWeights(**model, spec); !s.ok()) return s;
  return model;
}

absl::Status SaveModel(Model& model, const std::string& dir) {
  auto* transformer = dynamic_cast<TransformerModel*>(&model);
  auto* mamba = dynamic_cast<MambaModel*>(&model);
  if (!transformer && !mamba)
    return absl::InvalidArgumentError(absl::StrCat("cannot save a '", model.family(), "' model in HF format"));
  const bool tied = transformer ? transformer->config().tie_word_embeddings : mamba->config().tie_word_embeddings;
  if (!IsDirectory(dir) && mkdir(dir.c_str(), 0755) != 0)
    return absl::InternalError(absl::StrCat(dir, ": cannot create directory"));
  std::vector<io::TensorToWrite> tensors;
  // A LoRA model is written merged: W + (alpha / r) B A for adapted weights, no adapter tensors.
  const LoraInfo* lora = model.lora();
  std::vector<std::vector<char>> merged;
  merged.reserve(model.params().size());
  for (size_t i = 0; i < model.params().size(); ++i) {
    Param& p = model.params()[i];
    if (tied && p.name == "lm_head.weight") continue;
    const void* data = p.value.raw();
    if (lora) {
      if (lora->AdapterOfParam(static_cast<int>(i))) continue;
      if (const LoraAdapter* ad = lora->AdapterOfWeight(static_cast<int>(i))) {
        merged.emplace_back(p.value.nbytes());
        MergedWeight(model, *ad, merged.back().data());
        data = merged.back().data();
      }
    }
    tensors.push_back({p.name, p.value.dtype(), p.value.shape(), data});
  }
  if (absl::Status s = io::WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}); !s.ok())
    return s;
  const std::string config_path = dir + "/config.json";
  std::ofstream out(config_path);
  out << (transformer ? io::TransformerConfigToHFJson(transformer->config())
                      : io::MambaConfigToHFJson(mamba->config()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(config_path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace sg
