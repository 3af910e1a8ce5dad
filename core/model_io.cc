#include "core/model_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "base/tensor.h"
#include "core/io/file.h"
#include "core/io/safetensors.h"
#include "core/lora.h"
#include "core/lora_io.h"
#include "core/models/family.h"
#include "core/models/footprint.h"
#include "core/plan.h"
#include "kernels/backend.h"
#include "nlohmann/json.hpp"

namespace sg {
namespace {
bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Refuses, before anything is allocated, a configuration whose sizes overflow or whose parameters (values and
// gradients) do not fit in the memory the device has free. `what` names the config's source for errors.
// What the model takes where it lives: values and gradients, or values alone with a frozen base; the expert
// weights --offload_experts keeps in host memory are not the device's.
absl::Status CheckModelSize(const ModelSpec& spec, DType dtype, Device device, const std::string& what,
                            bool frozen_base, bool offload_experts) {
  absl::StatusOr<ModelFootprint> f = spec.Footprint(dtype);
  if (!f.ok()) return absl::Status(f.status().code(), absl::StrCat(what, ": ", f.status().message()));
  if (offload_experts && device != Device::kCPU) f->bytes -= f->expert_bytes;
  if (frozen_base) f->bytes /= 2;  // the counter's two copies alike
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

static bool StartsWithAny(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes)
    if (absl::StartsWith(name, p)) return true;
  return false;
}

// Every parameter by name, checking shapes; tensors the model does not use are an error, but for a tied head that
// is stored anyway and the tensors the spec carries (ModelSpec::CarriedTensors).
static absl::Status LoadParams(Model& model, const std::string& dir, const ModelSpec& spec) {
  const bool tied = spec.tied_embeddings();
  const std::vector<std::string> carried = spec.CarriedTensors();
  absl::StatusOr<io::ShardedSafetensors> files = io::ShardedSafetensors::OpenDir(dir);
  if (!files.ok()) return files.status();
  std::set<std::string> expected;
  const LoraInfo* lora = model.lora();
  for (size_t i = 0; i < model.params().size(); ++i) {
    Param& p = model.params()[i];
    if (lora && lora->AdapterOfParam(static_cast<int>(i))) continue;  // adapters are no part of an HF model
    expected.insert(p.name);
    if (files->Find(p.name)) {
      if (absl::Status s = FillFromHost(
              p.value, [&](void* dst) { return files->ReadInto(p.name, p.value.shape(), p.value.dtype(), dst); });
          !s.ok())
        return s;
      continue;
    }
    // Stored in pieces (ModelSpec::StoredLayout): each a block of rows of the parameter.
    const std::vector<ModelSpec::StoredPiece> pieces = spec.StoredLayout(p.name);
    if (pieces.empty() || !files->Find(pieces.front().name))
      return absl::NotFoundError(
          absl::StrCat(files->source(), ": tensor '", p.name, "' is missing",
                       pieces.empty() ? "" : absl::StrCat(" (nor '", pieces.front().name, "')")));
    const int64_t cols = p.value.shape().back();
    const size_t elem = DTypeSize(p.value.dtype());
    if (absl::Status s = FillFromHost(
            p.value,
            [&](void* dst) -> absl::Status {
              for (const ModelSpec::StoredPiece& piece : pieces) {
                expected.insert(piece.name);
                if (!files->Find(piece.name))
                  return absl::NotFoundError(absl::StrCat(files->source(), ": tensor '", piece.name,
                                                          "' is missing (a part of ", p.name, ", as ",
                                                          pieces.front().name, " is there)"));
                char* rows = static_cast<char*>(dst) + piece.row0 * cols * elem;
                if (absl::Status r = files->ReadInto(piece.name, {piece.rows, cols}, p.value.dtype(), rows); !r.ok())
                  return r;
              }
              return absl::OkStatus();
            });
        !s.ok())
      return s;
  }
  std::vector<std::string> unknown;
  for (const std::string& name : files->TensorNames()) {
    if (expected.count(name)) continue;
    // Buffers some exporters keep, and the duplicate head of tied checkpoints, carry no parameters of ours.
    if (absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && tied) continue;
    if (StartsWithAny(name, carried)) continue;
    unknown.push_back(name);
  }
  if (!unknown.empty())
    return absl::InvalidArgumentError(absl::StrCat(files->source(), ": tensors not used by a ", spec.architecture(),
                                                   " model: ", absl::StrJoin(unknown, ", ")));
  return absl::OkStatus();
}

absl::Status LoadWeights(Model& model, const std::string& dir) {
  std::unique_ptr<ModelSpec> spec = model.spec();
  return LoadParams(model, dir, *spec);
}

absl::StatusOr<std::unique_ptr<Model>> LoadAnyModel(const std::string& spec, DType dtype, uint64_t seed, Device device,
                                                    bool frozen_base, bool offload_experts) {
  const bool from_directory = IsDirectory(spec);
  absl::StatusOr<std::unique_ptr<ModelSpec>> config = from_directory ? LoadConfigSpec(spec) : PresetSpec(spec);
  if (!config.ok()) return config.status();
  if (absl::Status s = CheckModelSize(**config, dtype, device, ConfigSource(spec), frozen_base, offload_experts);
      !s.ok())
    return s;
  absl::StatusOr<std::unique_ptr<Model>> model = (*config)->Create(dtype, device, {}, frozen_base, offload_experts);
  if (!model.ok() && from_directory)
    return absl::Status(model.status().code(), absl::StrCat(spec, "/config.json: ", model.status().message()));
  if (!model.ok()) return model.status();
  if (from_directory) {
    if (absl::Status s = LoadWeights(**model, spec); !s.ok()) return s;
  } else {
    (*config)->InitRandom(**model, seed);
  }
  return model;
}

absl::StatusOr<std::unique_ptr<TransformerModel>> LoadModel(const std::string& spec, DType dtype, uint64_t seed,
                                                            Device device) {
  absl::StatusOr<std::unique_ptr<Model>> model = LoadAnyModel(spec, dtype, seed, device);
  if (!model.ok()) return model.status();
  if ((*model)->family() != TransformerModelFamily().name())
    return absl::InvalidArgumentError(
        absl::StrCat(spec, ": is a ", (*model)->family(), " model; LoadModel loads transformers (LoadAnyModel: any)"));
  return std::unique_ptr<TransformerModel>(static_cast<TransformerModel*>(model->release()));
}

namespace {

// What a save carries over from the source directory besides the weights and config.json: generation settings, the
// tokenizer and its chat template (tokenizer_config.json holds the template and the special tokens, or
// chat_template.jinja / .json beside it).
constexpr const char* kCarriedFiles[] = {"generation_config.json",
                                         "tokenizer.json",
                                         "tokenizer_config.json",
                                         "special_tokens_map.json",
                                         "added_tokens.json",
                                         "tokenizer.model",
                                         "vocab.json",
                                         "merges.txt",
                                         "vocab.txt",
                                         "chat_template.jinja",
                                         "chat_template.json"};
constexpr int64_t kMaxCarriedFileBytes = int64_t{1} << 30;

bool IsCarriedFile(const std::string& name) {
  for (const char* f : kCarriedFiles)
    if (name == f) return true;
  return false;
}

// The files of a Hugging Face model directory that a save replaces (every other file makes it refuse).
bool IsModelFile(const std::string& name) {
  return IsCarriedFile(name) || name == "config.json" || name == "model.safetensors.index.json" ||
         name == "pytorch_model.bin.index.json" ||
         (absl::StartsWith(name, "model") && absl::EndsWith(name, ".safetensors")) ||
         (absl::StartsWith(name, "pytorch_model") && absl::EndsWith(name, ".bin"));
}

const char* HFDtypeName(DType t) {
  switch (t) {
    case DType::kF64:
      return "float64";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "float32";
  }
}

// Removes a directory that holds plain files only (a staging directory, or the model directory it replaced).
void RemoveFlatDirectory(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") unlink((dir + "/" + name).c_str());
    }
    closedir(d);
  }
  rmdir(dir.c_str());
}

std::string WithoutTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// Staging directories are "<target>.seqgrad-save-XXXXXX", held under an exclusive flock by their save while it runs.
constexpr char kStagingInfix[] = ".seqgrad-save-";

// Removes the staging directories in `parent` that no live save holds: those of saves killed before they could
// remove them.
void RemoveStaleStaging(const std::string& parent) {
  io::RemoveUnlocked(parent, S_IFDIR, [](std::string_view name) {
    const size_t at = name.rfind(kStagingInfix);
    return at != std::string_view::npos && name.size() - at == sizeof(kStagingInfix) - 1 + 6;
  });
}

// A new staging directory beside `dir`, locked: returns its descriptor (close it after removing the directory).
absl::StatusOr<int> CreateStaging(const std::string& dir, std::string* staging) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    *staging = absl::StrCat(dir, kStagingInfix, "XXXXXX");
    if (!mkdtemp(staging->data()))
      return ErrnoStatus(errno, absl::StrCat(dir, ": cannot create a staging directory beside it"));
    const int fd = open(staging->c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0 && io::LockIfLinked(fd)) {
      chmod(staging->c_str(), 0755);
      return fd;
    }
    if (fd >= 0) close(fd);
  }
  return absl::InternalError(absl::StrCat(dir, ": cannot lock a staging directory beside it"));
}

// Whether `path` names `root` or something inside it.
bool IsInside(const std::string& path, const std::string& root) {
  return path == root || (absl::StartsWith(path, root) && (root == "/" || path[root.size()] == '/'));
}

// A file of the source directory that a save carries over (config.json or one of kCarriedFiles); nullopt when the
// source has none. Refused, naming the file: anything that does not resolve to a regular file inside the directory
// or, in a Hugging Face hub cache (<repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>), the repo's blobs; over
// kMaxCarriedFileBytes; a .json file that does not parse.
absl::StatusOr<std::optional<std::string>> ReadCarriedFile(const std::string& source_dir, const std::string& name) {
  const std::string path = absl::StrCat(source_dir, "/", name);
  auto refused = [&](absl::StatusCode code, absl::string_view why) {
    return absl::Status(code, absl::StrCat("cannot carry over ", path, ": ", why));
  };
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::nullopt;
    return refused(absl::StatusCode::kInvalidArgument, std::strerror(errno));
  }
  char resolved[PATH_MAX], root[PATH_MAX];
  if (!realpath(path.c_str(), resolved))
    return refused(absl::StatusCode::kInvalidArgument,
                   absl::StrCat("a link that leads nowhere (", std::strerror(errno), ")"));
  if (!realpath(source_dir.c_str(), root)) return ErrnoStatus(errno, absl::StrCat(source_dir, ": cannot resolve"));
  const std::string parent = io::ParentOf(root);
  const bool hub_blob = absl::EndsWith(parent, "/snapshots") && IsInside(resolved, io::ParentOf(parent) + "/blobs");
  if (!IsInside(resolved, root) && !hub_blob)
    return refused(absl::StatusCode::kInvalidArgument,
                   absl::StrCat("it links to ", resolved, ", outside the model directory (copy the file into it)"));
  absl::StatusOr<std::string> text = io::ReadRegularFile(resolved, kMaxCarriedFileBytes);
  if (!text.ok())
    return absl::Status(text.status().code(), absl::StrCat("cannot carry over ", text.status().message()));
  if (absl::EndsWith(name, ".json") && !nlohmann::json::accept(*text))
    return refused(absl::StatusCode::kInvalidArgument, "not valid JSON");
  return std::optional<std::string>(*std::move(text));
}

// Every file a save reads from the source directory, checked (empty source: none).
absl::Status CheckCarriedFiles(const std::string& source_dir) {
  if (source_dir.empty()) return absl::OkStatus();
  std::vector<std::string> names = {"config.json"};
  names.insert(names.end(), std::begin(kCarriedFiles), std::end(kCarriedFiles));
  for (const std::string& name : names)
    if (absl::StatusOr<std::optional<std::string>> text = ReadCarriedFile(source_dir, name); !text.ok())
      return text.status();
  return absl::OkStatus();
}

// An existing directory that files can be created in; errors name it.
absl::Status CheckWritableDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return ErrnoStatus(errno, absl::StrCat(dir, ": cannot save there"));
  if (!S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(dir, ": is not a directory"));
  if (access(dir.c_str(), W_OK | X_OK) != 0) return ErrnoStatus(errno, absl::StrCat(dir, ": cannot write in it"));
  return absl::OkStatus();
}

// What an existing `dir` holds: its model files, and whether anything else (checkpoints, notes) is there too.
struct Existing {
  bool exists = false;
  std::vector<std::string> model_files;
  std::string other;  // the first entry that is no model file; empty: none
};
absl::StatusOr<Existing> ListExisting(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return ErrnoStatus(errno, absl::StrCat(dir, ": cannot list"));
  Existing out;
  out.exists = true;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    const bool file = lstat((dir + "/" + name).c_str(), &st) == 0 && (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode));
    if (file && IsModelFile(name))
      out.model_files.push_back(name);
    else if (out.other.empty())
      out.other = name;
  }
  closedir(d);
  return out;
}

// config.json: the engine's config of the model, plus every field of the source's config.json the engine does not
// write (bos/eos/pad token ids, ...), labelled with the dtype the weights are saved in.
// Fields of `from` that `to` lacks, and inside text_config and rope_parameters those they lack (a conditional
// model's text model keeps the source's fields beside the engine's, Qwen3.5's RoPE its mrope_section).
void AddMissingFields(const nlohmann::ordered_json& from, nlohmann::ordered_json& to) {
  for (auto it = from.begin(); it != from.end(); ++it) {
    if (!to.contains(it.key())) {
      to[it.key()] = it.value();
    } else if ((it.key() == "text_config" || it.key() == "rope_parameters") && it.value().is_object() &&
               to[it.key()].is_object()) {
      AddMissingFields(it.value(), to[it.key()]);
    }
  }
}

absl::StatusOr<std::string> SavedConfig(const std::string& engine_json, DType dtype, const std::string& source_dir) {
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(engine_json, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) return absl::InternalError("the engine's config.json is not a JSON object");
  if (!source_dir.empty()) {
    absl::StatusOr<std::optional<std::string>> text = ReadCarriedFile(source_dir, "config.json");
    if (!text.ok()) return text.status();
    nlohmann::ordered_json source =
        nlohmann::ordered_json::parse(text->value_or("{}"), nullptr, /*allow_exceptions=*/false);
    if (!source.is_object())
      return absl::InvalidArgumentError(absl::StrCat(source_dir, "/config.json: is not a JSON object"));
    // The engine writes the RoPE block as rope_scaling: the source's rope_parameters would be a second one.
    if (!config.contains("rope_parameters")) source.erase("rope_parameters");
    AddMissingFields(source, config);
  }
  config["torch_dtype"] = HFDtypeName(dtype);  // transformers 4.x's name of the field
  config["dtype"] = HFDtypeName(dtype);        // and 5.x's
  return config.dump(2) + "\n";
}

// The source directory's tensors that the spec carries (ModelSpec::CarriedTensors), appended to `tensors` as they
// are stored there. A save without a source refuses a model whose carried tensors transformers needs.
absl::Status AddCarriedTensors(const ModelSpec& spec, const std::string& source_dir,
                               std::optional<io::ShardedSafetensors>& files, std::vector<io::TensorToWrite>& tensors) {
  const std::vector<std::string> carried = spec.CarriedTensors();
  const std::string required = spec.RequiredCarriedTensors();
  if (carried.empty()) return absl::OkStatus();
  if (source_dir.empty()) {
    if (required.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("a ", spec.architecture(), " save keeps the source directory's ", required,
                     "* tensors, which the engine does not run: save a model loaded from a directory"));
  }
  absl::StatusOr<io::ShardedSafetensors> opened = io::ShardedSafetensors::OpenDir(source_dir);
  if (!opened.ok()) return opened.status();
  files = *std::move(opened);
  bool found_required = required.empty();
  for (const std::string& name : files->TensorNames()) {
    if (!StartsWithAny(name, carried)) continue;
    const io::TensorInfo* info = files->Find(name);
    DType dtype;
    switch (info->dtype) {
      case io::StDType::kF64:
        dtype = DType::kF64;
        break;
      case io::StDType::kF32:
        dtype = DType::kF32;
        break;
      case io::StDType::kBF16:
        dtype = DType::kBF16;
        break;
      case io::StDType::kF16:
        dtype = DType::kF16;
        break;
      case io::StDType::kI32:
        dtype = DType::kI32;
        break;
      case io::StDType::kI64:
        dtype = DType::kI64;
        break;
      default:
        return absl::UnimplementedError(absl::StrCat(files->source(), ": tensor '", name, "' is ",
                                                     std::string(io::StDTypeName(info->dtype)),
                                                     "; a save carries F64, F32, BF16, F16, I32 and I64 tensors"));
    }
    found_required = found_required || absl::StartsWith(name, required);
    tensors.push_back({name, dtype, info->shape, info->bytes.data()});
  }
  if (!found_required)
    return absl::NotFoundError(absl::StrCat(files->source(), ": no ", required, "* tensors; a ", spec.architecture(),
                                            " save keeps them from its source directory"));
  return absl::OkStatus();
}

// Everything a save writes, into the (new, empty) staging directory; tensors in `dtype` (nullopt: as stored).
absl::Status WriteModelFiles(Model& model, const std::string& staging, const std::string& source_dir, SaveDType dtype) {
  const std::unique_ptr<ModelSpec> spec = model.spec();
  const bool tied = spec->tied_embeddings();
  std::vector<io::TensorToWrite> tensors;
  // A LoRA model is written merged: W + (alpha / r) B A for adapted weights, no adapter tensors.
  const LoraInfo* lora = model.lora();
  std::vector<std::vector<char>> merged, converted;
  merged.reserve(model.params().size());
  converted.reserve(model.params().size());
  for (size_t i = 0; i < model.params().size(); ++i) {
    Param& p = model.params()[i];
    if (tied && p.name == "lm_head.weight") continue;
    const void* data = nullptr;
    if (lora) {
      if (lora->AdapterOfParam(static_cast<int>(i))) continue;
      if (const LoraAdapter* ad = lora->AdapterOfWeight(static_cast<int>(i))) {
        merged.emplace_back(p.value.nbytes());
        MergedWeight(model, *ad, merged.back().data());
        data = merged.back().data();
      }
    }
    if (!data) data = HostBytes(p.value, &merged);                 // a device's tensors: host copies
    if (dtype == DType::kF32 && p.value.dtype() != DType::kF32) {  // --save_dtype=f32 of a bf16 or f64 model
      converted.emplace_back(p.value.numel() * sizeof(float));
      float* out = reinterpret_cast<float*>(converted.back().data());
      for (int64_t j = 0; j < p.value.numel(); ++j)
        out[j] = p.value.dtype() == DType::kBF16 ? BF16ToF32(static_cast<const uint16_t*>(data)[j])
                                                 : static_cast<float>(static_cast<const double*>(data)[j]);
      data = converted.back().data();
    }
    const DType saved = dtype.value_or(p.value.dtype());
    const std::vector<ModelSpec::StoredPiece> pieces = spec->StoredLayout(p.name);
    if (pieces.empty()) {
      tensors.push_back({p.name, saved, p.value.shape(), data});
      continue;
    }
    const int64_t cols = p.value.shape().back();
    for (const ModelSpec::StoredPiece& piece : pieces)
      tensors.push_back({piece.name,
                         saved,
                         {piece.rows, cols},
                         static_cast<const char*>(data) + piece.row0 * cols * static_cast<int64_t>(DTypeSize(saved))});
  }
  std::optional<io::ShardedSafetensors> source_files;  // the carried tensors' bytes live as long as it does
  if (absl::Status s = AddCarriedTensors(*spec, source_dir, source_files, tensors); !s.ok()) return s;
  if (absl::Status s = io::WriteSafetensors(staging + "/model.safetensors", tensors, {{"format", "pt"}}); !s.ok())
    return s;
  absl::StatusOr<std::string> config =
      SavedConfig(spec->HFConfigJson(), dtype.value_or(CreatedDType(model)), source_dir);
  if (!config.ok()) return config.status();
  if (absl::Status s = WriteFileAtomically(staging + "/config.json", *config); !s.ok()) return s;
  if (source_dir.empty()) return absl::OkStatus();
  for (const char* name : kCarriedFiles) {
    absl::StatusOr<std::optional<std::string>> text = ReadCarriedFile(source_dir, name);
    if (!text.ok()) return text.status();
    if (!*text) continue;  // not in the source: nothing to carry
    if (absl::Status s = WriteFileAtomically(absl::StrCat(staging, "/", name), **text); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SaveDType> ParseSaveDType(const std::string& name, const std::string& what) {
  if (name.empty()) return SaveDType();
  if (name == "f32") return SaveDType(DType::kF32);
  if (name == "bf16") return SaveDType(DType::kBF16);
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": '", name, "' is not a save dtype (f32, bf16, or empty: as the model stores its weights)"));
}

absl::Status CheckSaveDType(Model& model, SaveDType dtype, const std::string& what) {
  if (dtype == DType::kBF16 && CreatedDType(model) != DType::kBF16)
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is bf16 but the model stores its weights in ", DTypeName(model.dtype()),
                     "; bf16 saves come from models created with --dtype=bf16 (save in f32 or as stored)"));
  return absl::OkStatus();
}

namespace {

// The target checks of CheckModelSave; returns what `dir` holds now (nothing when it does not exist).
absl::StatusOr<Existing> CheckSaveTarget(const std::string& dir) {
  struct stat st;
  const bool exists = lstat(dir.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) return ErrnoStatus(errno, absl::StrCat(dir, ": cannot save there"));
  if (exists && !S_ISDIR(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(dir, ": exists and is not a directory"));
  if (absl::Status s = CheckWritableDirectory(io::ParentOf(dir)); !s.ok()) return s;
  RemoveStaleStaging(io::ParentOf(dir));
  if (!exists) return Existing();
  absl::StatusOr<Existing> existing = ListExisting(dir);
  if (!existing.ok()) return existing.status();
  // Beside other entries (e.g. train's checkpoint-N directories) the files are replaced one by one; the files of an
  // earlier sharded model could not go with them at once, so that case is refused.
  if (!existing->other.empty()) {
    for (const std::string& name : existing->model_files)
      if (name != "model.safetensors" && name != "config.json" && !IsCarriedFile(name))
        return absl::FailedPreconditionError(
            absl::StrCat(dir, "/", name, ": an earlier model's file in a directory that also holds other entries ('",
                         existing->other,
                         "'), where the save cannot replace the whole model at once; remove it or save into a "
                         "new directory"));
    if (absl::Status s = CheckWritableDirectory(dir); !s.ok()) return s;
  }
  return existing;
}

}  // namespace

absl::Status CheckModelSave(const std::string& dir, const std::string& source) {
  absl::StatusOr<Existing> existing = CheckSaveTarget(WithoutTrailingSlashes(dir));
  if (!existing.ok()) return existing.status();
  return CheckCarriedFiles(IsDirectory(source) ? source : "");
}

absl::Status CheckWritableTarget(const std::string& dir_arg) {
  const std::string dir = WithoutTrailingSlashes(dir_arg);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return CheckWritableDirectory(io::ParentOf(dir));
    return ErrnoStatus(errno, absl::StrCat(dir, ": cannot save there"));
  }
  if (!S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(dir, ": exists and is not a directory"));
  return CheckWritableDirectory(dir);
}

absl::Status SaveModel(Model& model, const std::string& dir_arg, const std::string& source, SaveDType dtype) {
  if (absl::Status s = CheckSaveDType(model, dtype); !s.ok()) return s;
  if (dtype == DType::kBF16) dtype.reset();  // what a bf16 model stores: its vectors stay f32
  const std::string dir = WithoutTrailingSlashes(dir_arg);
  const std::string source_dir = IsDirectory(source) ? source : "";
  absl::StatusOr<Existing> checked = CheckSaveTarget(dir);
  if (!checked.ok()) return checked.status();
  if (absl::Status s = CheckCarriedFiles(source_dir); !s.ok()) return s;  // before gigabytes of weights are written
  const Existing existing = *std::move(checked);
  const bool in_place = !existing.other.empty();
  // Everything goes into a staging directory beside `dir` first, so a failed save leaves `dir` as it was. Then the
  // staging directory takes the place of `dir` in one rename (readers see the old model or the new one, never a mix,
  // no stale shards or index) or, beside other entries, its files replace the old ones, each in one rename.
  std::string staging;
  absl::StatusOr<int> lock = CreateStaging(dir, &staging);
  if (!lock.ok()) return lock.status();
  absl::Status s = WriteModelFiles(model, staging, source_dir, dtype);
  if (s.ok() && in_place) {
    std::vector<std::string> written;
    for (const char* name : kCarriedFiles)
      if (struct stat st; lstat(absl::StrCat(staging, "/", name).c_str(), &st) == 0) written.push_back(name);
    written.push_back("model.safetensors");
    written.push_back("config.json");  // last: a reader that finds the new config finds the new weights
    for (const std::string& name : written)
      if (std::rename(absl::StrCat(staging, "/", name).c_str(), absl::StrCat(dir, "/", name).c_str()) != 0) {
        s = ErrnoStatus(errno, absl::StrCat(dir, "/", name, ": cannot replace it with the saved file"));
        break;
      }
    for (const std::string& name : existing.model_files)  // an earlier source's tokenizer files that this one lacks
      if (s.ok() && std::find(written.begin(), written.end(), name) == written.end())
        unlink(absl::StrCat(dir, "/", name).c_str());
  } else if (s.ok()) {
    // An existing directory is swapped with the staging one (renameat2 RENAME_EXCHANGE), then the old one removed.
    const int rc = existing.exists ? renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE)
                                   : renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_NOREPLACE);
    if (rc != 0)
      s = ErrnoStatus(errno, absl::StrCat(dir, ": cannot ", existing.exists ? "replace" : "create",
                                          " it atomically with the saved model (rename from ", staging, ")"));
  }
  RemoveFlatDirectory(staging);  // the replaced model, what is left of the staged one, or the partial save
  close(*lock);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("saving the model to ", dir, ": ", s.message()));
  return absl::OkStatus();
}

}  // namespace sg
