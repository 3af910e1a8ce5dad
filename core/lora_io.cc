#include "core/lora_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/errno_status.h"
#include "core/io/file.h"
#include "core/io/peft.h"
#include "core/io/safetensors.h"

namespace sg {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::Status MakeDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(dir, ": exists and is not a directory"));
  }
  if (mkdir(dir.c_str(), 0755) != 0) return ErrnoStatus(errno, absl::StrCat(dir, ": cannot create directory"));
  return absl::OkStatus();
}

// An adapter tensor's name as the engine calls it: transformers 5.23 holds Nemotron-H under model.* in memory, where
// PEFT names its adapters, and saves it under backbone.*, the engine's names (PeftModel loads either).
std::string EngineTensorName(const Model& model, const std::string& name) {
  const std::string in_memory = absl::StrCat(io::kPeftTensorPrefix, "model.");
  if (model.architecture() != "nemotron_h" || !absl::StartsWith(name, in_memory)) return name;
  return absl::StrCat(io::kPeftTensorPrefix, "backbone.", name.substr(in_memory.size()));
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  absl::StatusOr<io::LockedTemporary> temp = io::LockedTemporary::Create(path);
  if (!temp.ok()) return temp.status();
  const std::string& tmp = temp->path();
  const int fd = open(tmp.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat(path, ": cannot create ", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      close(fd);
      unlink(tmp.c_str());
      return ErrnoStatus(err, absl::StrCat(path, ": write failed"));
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat(path, ": flush failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat(path, ": cannot rename ", tmp, " over it"));
  }
  return absl::OkStatus();
}

absl::Status SaveLoraAdapter(Model& model, const std::string& dir, const std::string& base_model_name_or_path) {
  const LoraInfo* lora = model.lora();
  if (!lora) return absl::FailedPreconditionError("cannot save LoRA adapters: LoRA is not enabled on this model");
  if (absl::Status s = MakeDirectory(dir); !s.ok()) return s;
  std::vector<io::TensorToWrite> tensors;
  std::vector<std::vector<char>> host_copies;  // of a device's tensors
  for (const LoraAdapter& ad : lora->adapters)
    for (int idx : {ad.a, ad.b}) {
      const Param& p = model.params()[idx];
      tensors.push_back(
          {io::kPeftTensorPrefix + p.name, p.value.dtype(), p.value.shape(), HostBytes(p.value, &host_copies)});
    }
  if (absl::Status s = io::WriteSafetensors(absl::StrCat(dir, "/", io::kPeftWeightsFile), tensors, {{"format", "pt"}});
      !s.ok())
    return s;
  io::PeftLoraConfig config;
  config.r = lora->options.rank;
  config.lora_alpha = lora->options.alpha;
  config.lora_dropout = lora->options.dropout;
  for (const std::string& t : lora->options.targets)
    (IsLoraTargetParameter(t) ? config.target_parameters : config.target_modules).push_back(t);
  config.base_model_name_or_path = base_model_name_or_path;
  return WriteFileAtomically(absl::StrCat(dir, "/", io::kPeftConfigFile), io::PeftLoraConfigToJson(config));
}

absl::StatusOr<LoraOptions> ReadLoraAdapterConfig(const std::string& dir, const LoraKind& kind) {
  const std::string path = absl::StrCat(dir, "/", io::kPeftConfigFile);
  absl::StatusOr<io::PeftLoraConfig> config = io::ReadPeftLoraConfig(path);
  if (!config.ok()) return config.status();
  LoraOptions o;
  o.rank = config->r;
  o.alpha = config->lora_alpha;
  o.dropout = config->lora_dropout;
  o.targets.clear();
  // PEFT matches a target against the end of a module's path and writes the list in any order, possibly as paths
  // (after "all-linear"): the engine keeps the set of module names. An adapter on only some layers' modules is
  // refused when its tensors are loaded (the other layers' tensors are missing).
  absl::StatusOr<std::vector<std::string>> all = ParseLoraTargets("all-linear", kind);
  if (config->all_linear && !all.ok())
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", absl::StrReplaceAll(all.status().message(), {{"--lora_targets", "target_modules"}})));
  for (const std::string& t : config->all_linear ? *all : config->target_modules) {
    const std::string leaf = t.substr(t.rfind('.') + 1);
    if (std::find(o.targets.begin(), o.targets.end(), leaf) == o.targets.end()) o.targets.push_back(leaf);
  }
  // PEFT matches a target parameter against the end of a parameter's path: "mlp.experts.gate_up_proj" and
  // "gate_up_proj" both name the engine's experts.gate_up_proj (the only parameters so named).
  const std::vector<std::string> parameters = LoraTargetParameters(kind);
  for (const std::string& t : config->target_parameters) {
    auto known = std::find_if(parameters.begin(), parameters.end(), [&](const std::string& p) {
      return t == p || absl::EndsWith(t, "." + p) || absl::EndsWith(p, "." + t);
    });
    if (known == parameters.end())
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": target_parameters: '", t, "' is not supported (the engine adapts the expert weights ",
          parameters.empty() ? "of transformers' MoE layers only" : absl::StrJoin(parameters, " and "), ")"));
    if (std::find(o.targets.begin(), o.targets.end(), *known) == o.targets.end()) o.targets.push_back(*known);
  }
  if (absl::Status s = ValidateLoraOptions(o, kind); !s.ok())
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", absl::StrReplaceAll(s.message(), {{"--lora_targets", "target_modules"}})));
  return o;
}

absl::Status LoadLoraAdapter(Model& model, const std::string& dir) {
  absl::StatusOr<LoraOptions> options = ReadLoraAdapterConfig(dir, LoraKind::Of(model));
  if (!options.ok()) return options.status();
  const std::string config_path = absl::StrCat(dir, "/", io::kPeftConfigFile);
  const std::string weights_path = absl::StrCat(dir, "/", io::kPeftWeightsFile);
  if (const LoraInfo* on = model.lora()) {
    const LoraOptions& m = on->options;
    std::vector<std::string> differ;
    if (m.rank != options->rank) differ.push_back(absl::StrCat("r ", options->rank, " vs ", m.rank));
    if (m.alpha != options->alpha) differ.push_back(absl::StrCat("lora_alpha ", options->alpha, " vs ", m.alpha));
    // The model's LoRA lists the targets it has; the file's ("all-linear" among them) may name others.
    std::set<std::string> file_targets;
    for (const std::string& t : options->targets)
      for (const Param& p : model.params())
        if (absl::EndsWith(p.name, "." + t + ".weight") || LoraParameterTarget(p.name) == t) {
          file_targets.insert(t);
          break;
        }
    if (std::set<std::string>(m.targets.begin(), m.targets.end()) != file_targets)
      differ.push_back(absl::StrCat("target_modules [", absl::StrJoin(file_targets, ", "), "] vs [",
                                    absl::StrJoin(m.targets, ", "), "]"));
    if (!differ.empty())
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": the adapter differs from the model's LoRA (",
                                                     absl::StrJoin(differ, "; "), ", file vs model)"));
  }
  absl::StatusOr<io::SafetensorsFile> file = io::SafetensorsFile::Open(weights_path);
  if (!file.ok()) return file.status();

  // The adapter tensors this model has (or would have with the adapter's options), by PEFT name: the A and B of
  // every "<module>.weight" whose module name is a target.
  struct Wanted {
    std::string param;
    std::vector<int64_t> shape;
  };
  std::map<std::string, Wanted> wanted;
  std::vector<std::string> experts;  // the adapted expert weights' names and shapes, in the model's order
  std::vector<std::vector<int64_t>> expert_shapes;
  for (const Param& p : model.params()) {
    const std::string target = LoraParameterTarget(p.name);
    if (p.value.shape().size() == 3 && IsLoraTargetParameter(target) &&
        std::find(options->targets.begin(), options->targets.end(), target) != options->targets.end())
      experts.push_back(p.name), expert_shapes.push_back(p.value.shape());
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    const std::vector<int64_t>& shape = expert_shapes[i];  // [E][out][in]
    const std::string wrapper = LoraExpertWrapper(experts, i);
    wanted[absl::StrCat(io::kPeftTensorPrefix, wrapper, ".lora_A.weight")] = {wrapper + ".lora_A.weight",
                                                                                {shape[0] * options->rank, shape[2]}};
    wanted[absl::StrCat(io::kPeftTensorPrefix, wrapper, ".lora_B.weight")] = {wrapper + ".lora_B.weight",
                                                                                {shape[1], options->rank * shape[0]}};
  }
  for (const Param& p : model.params()) {
    if (!absl::EndsWith(p.name, ".weight") || p.value.shape().size() < 2) continue;
    const std::string module = p.name.substr(0, p.name.size() - 7);
    const std::string leaf = module.substr(module.rfind('.') + 1);
    if (std::find(options->targets.begin(), options->targets.end(), leaf) == options->targets.end()) continue;
    const int64_t out = p.value.dim(0), in = p.value.numel() / out;
    wanted[absl::StrCat(io::kPeftTensorPrefix, module, ".lora_A.weight")] = {module + ".lora_A.weight",
                                                                               {options->rank, in}};
    wanted[absl::StrCat(io::kPeftTensorPrefix, module, ".lora_B.weight")] = {module + ".lora_B.weight",
                                                                               {out, options->rank}};
  }
  std::map<std::string, std::string> file_names;  // wanted's names as the file spells them
  for (const io::TensorInfo& t : file->tensors()) {
    auto it = wanted.find(EngineTensorName(model, t.name));
    if (it != wanted.end()) file_names[it->first] = t.name;
    if (it == wanted.end())
      return absl::InvalidArgumentError(absl::StrCat(
          weights_path, ": tensor '", t.name, "' ", ShapeString(t.shape),
          absl::StartsWith(t.name, io::kPeftTensorPrefix)
              ? " is no LoRA adapter of this model's target modules (an adapter for a different base model?)"
              : absl::StrCat(" is not a PEFT adapter tensor (names start with '", io::kPeftTensorPrefix, "')")));
    if (t.shape != it->second.shape)
      return absl::InvalidArgumentError(absl::StrCat(weights_path, ": tensor '", t.name, "' has shape ",
                                                     ShapeString(t.shape), " but this model needs ",
                                                     ShapeString(it->second.shape),
                                                     " (an adapter for a different base model?)"));
  }
  std::vector<std::string> missing;
  for (const auto& [name, w] : wanted)
    if (!file_names.count(name)) missing.push_back(name);
  if (!missing.empty())
    return absl::InvalidArgumentError(absl::StrCat(weights_path, ": ", missing.size(), " adapter tensor",
                                                   missing.size() > 1 ? "s are" : " is", " missing: ",
                                                   absl::StrJoin(missing, ", "),
                                                   " (the engine adapts a target module in every layer)"));
  // Read into temporaries first, so that a tensor failing to convert leaves the model as it was.
  const DType dtype = model.dtype();
  std::map<std::string, std::vector<char>> values;
  for (const auto& [name, w] : wanted) {
    int64_t numel = 1;
    for (int64_t dim : w.shape) numel *= dim;
    std::vector<char>& v = values[w.param];
    v.resize(static_cast<size_t>(numel) * DTypeSize(dtype));
    if (absl::Status s = file->ReadInto(file_names.at(name), w.shape, dtype, v.data()); !s.ok()) return s;
  }
  if (!model.lora())
    if (absl::Status s = model.EnableLora(*options); !s.ok())
      return absl::Status(s.code(), absl::StrCat(config_path, ": ", s.message()));
  for (const LoraAdapter& ad : model.lora()->adapters)
    for (int idx : {ad.a, ad.b}) {
      Param& p = model.params()[idx];
      CopyFromHost(p.value, values.at(p.name).data());
    }
  return absl::OkStatus();
}

}  // namespace sg
