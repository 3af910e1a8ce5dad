#include "core/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "core/io/file.h"
#include "core/io/safetensors.h"
#include "core/lora.h"
#include "core/models/family.h"
#include "nlohmann/json.hpp"

namespace sg {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr char kFormat[] = "seqgrad-checkpoint";
constexpr int kVersion = 1;
constexpr char kStateFile[] = "trainer_state.json";
constexpr char kModelFile[] = "model.safetensors";
constexpr char kConfigFile[] = "config.json";
constexpr char kOptimizerFile[] = "optimizer.safetensors";
constexpr char kPrefix[] = "checkpoint-";
constexpr char kTmpPrefix[] = ".tmp-checkpoint-";
constexpr char kDelPrefix[] = ".del-checkpoint-";
constexpr char kInvalidPrefix[] = "invalid-";
constexpr int64_t kMaxStateBytes = int64_t{1} << 30;  // trainer_state.json (its history grows with the steps)

// ---- CRC-32 (slicing by 8) ----
struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};
const CrcTables& Tables() {
  static const CrcTables tables;
  return tables;
}

std::string Hex32(uint32_t v) { return absl::StrFormat("%08x", v); }

// The shortest "%.Ng" that reads back as the same double.
std::string DoubleStr(double v) {
  for (int digits = 15; digits <= 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, v);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

absl::Status Errno(const std::string& what, int err) { return ErrnoStatus(err, what); }

absl::Status FsyncPath(const std::string& path, bool directory) {
  const int fd = open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat(path, ": cannot open to fsync"), errno);
  const int r = fsync(fd);
  const int err = errno;
  close(fd);
  if (r != 0) return Errno(absl::StrCat(path, ": fsync failed"), err);
  return absl::OkStatus();
}

// Writes bytes to path (created or truncated) and fsyncs it.
absl::Status WriteFileSynced(const std::string& path, const std::string& bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(absl::StrCat(path, ": cannot create"), errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd);
      return Errno(absl::StrCat(path, ": write failed"), err);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    const int err = errno;
    close(fd);
    return Errno(absl::StrCat(path, ": fsync failed"), err);
  }
  if (close(fd) != 0) return Errno(absl::StrCat(path, ": close failed"), errno);
  return absl::OkStatus();
}

// Size and CRC-32 of a file, read in blocks.
absl::Status FileCrc(const std::string& path, int64_t* size, uint32_t* crc) {
  absl::StatusOr<io::ReadFd> file = io::OpenRegularFile(path);
  if (!file.ok()) return file.status();
  const int fd = file->get();
  std::vector<char> buf(1 << 20);
  *size = 0;
  *crc = 0;
  for (;;) {
    const ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(absl::StrCat(path, ": read failed"), errno);
    }
    if (n == 0) break;
    *crc = Crc32(buf.data(), static_cast<size_t>(n), *crc);
    *size += n;
  }
  return absl::OkStatus();
}

bool ParseStepName(const std::string& name, const std::string& prefix, int64_t* step) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  return absl::SimpleAtoi(digits, step);
}

// Removes a directory tree: renamed to a .del- name first, so that a kill during the removal never leaves a
// partial directory under a checkpoint name.
absl::Status RemoveCheckpointDir(const std::string& out_dir, const std::string& name) {
  const std::string from = absl::StrCat(out_dir, "/", name);
  const std::string to = absl::StrCat(out_dir, "/", kDelPrefix, name.substr(std::strlen(kPrefix)), "-", getpid());
  if (std::rename(from.c_str(), to.c_str()) != 0)
    return Errno(absl::StrCat(from, ": cannot rename for removal"), errno);
  if (absl::Status s = FsyncPath(out_dir, true); !s.ok()) return s;
  std::error_code ec;
  fs::remove_all(to, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat(to, ": cannot remove"));
  return absl::OkStatus();
}

// Moves an invalid checkpoint aside to invalid-checkpoint-<step>[-<n>]: kept for inspection, no longer a
// checkpoint (nor counted among the ones kept).
absl::Status QuarantineCheckpoint(const std::string& out_dir, const std::string& name, const std::string& why) {
  const std::string from = absl::StrCat(out_dir, "/", name);
  std::string to = absl::StrCat(out_dir, "/", kInvalidPrefix, name);
  std::error_code ec;
  for (int n = 1; fs::exists(to, ec); ++n) to = absl::StrCat(out_dir, "/", kInvalidPrefix, name, "-", n);
  if (std::rename(from.c_str(), to.c_str()) != 0) return Errno(absl::StrCat(from, ": cannot move aside"), errno);
  std::fprintf(stderr, "checkpoint: %s is invalid (%s); moved aside to %s\n", from.c_str(), why.c_str(), to.c_str());
  return FsyncPath(out_dir, true);
}

// Temporaries (.tmp-, .del-) whose writing process no longer runs.
void RemoveStaleTemporaries(const std::string& out_dir) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool tmp = name.rfind(kTmpPrefix, 0) == 0, del = name.rfind(kDelPrefix, 0) == 0;
    if (!tmp && !del) continue;
    const size_t dash = name.rfind('-');
    int64_t pid = 0;
    if (dash == std::string::npos || !absl::SimpleAtoi(name.substr(dash + 1), &pid) || pid <= 0) continue;
    if (pid != getpid() && (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) continue;  // a live writer's
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

void FlattenJson(const json& j, const std::string& prefix, RunConfig* out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) FlattenJson(it.value(), absl::StrCat(prefix, ".", it.key()), out);
    return;
  }
  if (j.is_string())
    (*out)[prefix] = j.get<std::string>();
  else if (j.is_number_float())
    (*out)[prefix] = DoubleStr(j.get<double>());
  else
    (*out)[prefix] = j.dump();
}

std::string ShapeStr(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

io::StDType StOf(DType t) {
  return t == DType::kF64 ? io::StDType::kF64 : t == DType::kBF16 ? io::StDType::kBF16 : io::StDType::kF32;
}

// A safetensors file of a checkpoint must hold exactly `expected` (name -> parameter), each with the parameter's
// shape and dtype (optimizer state: its gradient's, the compute dtype, also of bf16 parameters' fp32 masters).
absl::Status CheckTensors(const io::SafetensorsFile& file, const std::string& what,
                          const std::vector<std::pair<std::string, const Param*>>& expected,
                          bool optimizer_state = false) {
  std::set<std::string> names;
  for (const auto& [name, p] : expected) {
    names.insert(name);
    const io::TensorInfo* info = file.Find(name);
    if (!info) return absl::DataLossError(absl::StrCat(file.path(), ": tensor '", name, "' is missing (", what, ")"));
    if (info->shape != p->value.shape())
      return absl::FailedPreconditionError(absl::StrCat(file.path(), ": tensor '", name, "' has shape ",
                                                        ShapeStr(info->shape), ", the model's is ",
                                                        ShapeStr(p->value.shape())));
    const DType want = optimizer_state ? p->grad.dtype() : p->value.dtype();
    if (info->dtype != StOf(want))
      return absl::FailedPreconditionError(absl::StrCat(
          file.path(), ": tensor '", name, "' is ", std::string(io::StDTypeName(info->dtype)),
          ", the model holds it in ", DTypeName(want), " (resume with the --dtype the checkpoint was trained in)"));
  }
  for (const io::TensorInfo& t : file.tensors())
    if (!names.count(t.name))
      return absl::FailedPreconditionError(
          absl::StrCat(file.path(), ": tensor '", t.name, "' is not a parameter of this model (", what, ")"));
  return absl::OkStatus();
}

std::vector<std::pair<std::string, const Param*>> ModelTensors(Model& model) {
  std::vector<std::pair<std::string, const Param*>> out;
  for (const Param& p : model.params()) out.push_back({p.name, &p});
  return out;
}
std::vector<std::pair<std::string, const Param*>> MomentTensors(Model& model) {
  std::vector<std::pair<std::string, const Param*>> out;
  for (const Param& p : model.params())
    if (p.grad.defined()) {
      out.push_back({"m." + p.name, &p});
      out.push_back({"v." + p.name, &p});
      if (p.value.dtype() == DType::kBF16) out.push_back({"master." + p.name, &p});
    }
  return out;
}

}  // namespace

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  const auto& t = Tables().t;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (size >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;  // little-endian host
    crc = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^ t[4][a >> 24] ^ t[3][b & 0xFF] ^
          t[2][(b >> 8) & 0xFF] ^ t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    p += 8;
    size -= 8;
  }
  while (size--) crc = t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

RunConfig TrainerRunConfig(Trainer& trainer) {
  RunConfig c;
  Model& model = trainer.model();
  c["model.family"] = model.family();
  c["model.dtype"] = DTypeName(model.dtype());
  int64_t params = 0, trainable = 0, elements = 0;
  for (const Param& p : model.params()) {
    ++params;
    trainable += p.grad.defined();
    elements += p.value.numel();
  }
  c["model.parameters"] = absl::StrCat(params);
  c["model.trainable_parameters"] = absl::StrCat(trainable);
  c["model.elements"] = absl::StrCat(elements);
  if (const std::string hf = model.spec()->HFConfigJson(); !hf.empty()) {
    json j = json::parse(hf, nullptr, /*allow_exceptions=*/false);
    if (j.is_object())
      for (auto it = j.begin(); it != j.end(); ++it)
        if (it.key() != "torch_dtype") FlattenJson(it.value(), absl::StrCat("model.", it.key()), &c);
  }
  if (const LoraInfo* lora = model.lora()) {
    c["lora.rank"] = absl::StrCat(lora->options.rank);
    c["lora.alpha"] = DoubleStr(lora->options.alpha);
    c["lora.dropout"] = DoubleStr(lora->options.dropout);
    c["lora.targets"] = absl::StrJoin(lora->options.targets, ",");
  }
  const StrategyOptions& s = trainer.strategy();
  c["strategy.name"] = s.name;
  c["strategy.chunk"] = absl::StrCat(s.chunk);
  c["strategy.page_size"] = absl::StrCat(s.page_size);
  c["strategy.lm_chunk"] = absl::StrCat(s.lm_chunk);
  if (s.sparse_pages != 0) c["strategy.sparse_pages"] = absl::StrCat(s.sparse_pages);
  c["strategy.seed"] = absl::StrCat(s.seed);
  if (s.name == "spaco") {
    c["strategy.spaco_budget"] = absl::StrCat(s.spaco_budget);
    c["strategy.spaco_cap"] = DoubleStr(s.spaco_cap);
  }
  if (s.name == "adjoint") {
    c["strategy.adjoint_form"] = s.adjoint_form;
    c["strategy.adjoint_window"] =
        s.adjoint_window == StrategyOptions::kNoAdjointWindow ? "none" : absl::StrCat(s.adjoint_window);
  }
  const OptimizerOptions& o = trainer.optimizer_options();
  c["optimizer.lr"] = DoubleStr(o.lr);
  c["optimizer.beta1"] = DoubleStr(o.beta1);
  c["optimizer.beta2"] = DoubleStr(o.beta2);
  c["optimizer.eps"] = DoubleStr(o.eps);
  c["optimizer.weight_decay"] = DoubleStr(o.weight_decay);
  c["optimizer.clip_grad_norm"] = DoubleStr(o.clip_grad_norm);
  c["optimizer.lr_schedule"] = o.lr_schedule;
  c["optimizer.warmup_steps"] = absl::StrCat(o.warmup_steps);
  if (o.lr_schedule != "constant") {  // the horizon matters only to a decaying schedule
    c["optimizer.min_lr"] = DoubleStr(o.min_lr);
    c["optimizer.total_steps"] = absl::StrCat(o.total_steps);
  }
  c["optimizer.grad_accum"] = absl::StrCat(o.grad_accum);
  c[absl::StrCat(kRuntimePrefix, "threads")] = absl::StrCat(trainer.threads());
  const ObjectiveOptions& obj = trainer.objective();
  c["objective.name"] = obj.name;
  if (obj.name == "dpo") c["objective.dpo_beta"] = DoubleStr(obj.dpo_beta);
  if (obj.name == "grpo") {
    c["objective.grpo_clip_eps"] = DoubleStr(obj.grpo_clip_eps);
    c["objective.grpo_kl_beta"] = DoubleStr(obj.grpo_kl_beta);
    // Recorded only where it changes the objective, so checkpoints from before the option resume without it.
    if (obj.grpo_kl_beta > 0 && obj.grpo_kl_bias_correction) c["objective.grpo_kl_bias_correction"] = "true";
  }
  return c;
}

std::vector<std::string> DiffRunConfig(const RunConfig& checkpoint, const RunConfig& now) {
  std::vector<std::string> out;
  std::set<std::string> keys;
  for (const auto& [k, v] : checkpoint) keys.insert(k);
  for (const auto& [k, v] : now) keys.insert(k);
  for (const std::string& k : keys) {
    const auto a = checkpoint.find(k), b = now.find(k);
    const std::string va = a == checkpoint.end() ? "(not set)" : absl::StrCat("'", a->second, "'");
    const std::string vb = b == now.end() ? "(not set)" : absl::StrCat("'", b->second, "'");
    if (va != vb) out.push_back(absl::StrCat(k, ": checkpoint ", va, ", now ", vb));
  }
  return out;
}

std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& out_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(out_dir, ec)) {
    int64_t step = 0;
    std::error_code dir_ec;
    if (ParseStepName(e.path().filename().string(), kPrefix, &step) && e.is_directory(dir_ec))
      out.push_back({step, e.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& out_dir, Trainer& trainer, const CheckpointMeta& meta,
                                           int keep) {
  Model& model = trainer.model();
  const int64_t step = meta.trainer.step;
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("checkpoint step ", step, " is negative"));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat(out_dir, ": cannot create directory"));
  RemoveStaleTemporaries(out_dir);

  const std::string name = absl::StrCat(kPrefix, step);
  const std::string final_dir = absl::StrCat(out_dir, "/", name);
  const std::string tmp = absl::StrCat(out_dir, "/", kTmpPrefix, step, "-", getpid());
  fs::remove_all(tmp, ec);
  if (mkdir(tmp.c_str(), 0755) != 0) return Errno(absl::StrCat(tmp, ": cannot create directory"), errno);
  auto fail = [&](absl::Status s) {
    std::error_code rm;
    fs::remove_all(tmp, rm);
    return s;
  };

  // The files, each fsynced (WriteSafetensors writes a temporary, fsyncs, renames and fsyncs the directory).
  std::vector<io::TensorToWrite> weights;
  std::vector<std::vector<char>> host_copies;  // of a device's tensors
  for (const Param& p : model.params())
    weights.push_back({p.name, p.value.dtype(), p.value.shape(), HostBytes(p.value, &host_copies)});
  if (absl::Status s = io::WriteSafetensors(absl::StrCat(tmp, "/", kModelFile), weights, {{"format", "pt"}}); !s.ok())
    return fail(s);
  std::vector<io::TensorToWrite> moments;
  AdamW& adam = trainer.optimizer();
  if (adam.has_moments()) {
    const std::vector<Param>& params = model.params();
    if (adam.m().size() != params.size())
      return fail(absl::FailedPreconditionError("optimizer state does not match the model's parameters"));
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].grad.defined()) continue;
      const Tensor& m = adam.m()[i];
      const Tensor& v = adam.v()[i];
      if (!m.defined() || !v.defined())
        return fail(absl::FailedPreconditionError(
            absl::StrCat("parameter '", params[i].name, "' has a gradient but no optimizer moments")));
      moments.push_back({"m." + params[i].name, m.dtype(), m.shape(), HostBytes(m, &host_copies)});
      moments.push_back({"v." + params[i].name, v.dtype(), v.shape(), HostBytes(v, &host_copies)});
      if (const Tensor& master = adam.master()[i]; master.defined())
        moments.push_back(
            {"master." + params[i].name, master.dtype(), master.shape(), HostBytes(master, &host_copies)});
    }
  }
  if (absl::Status s = io::WriteSafetensors(absl::StrCat(tmp, "/", kOptimizerFile), moments,
                                            {{"format", "seqgrad-adamw"}, {"step", absl::StrCat(step)}});
      !s.ok())
    return fail(s);
  std::vector<std::string> files = {kModelFile, kOptimizerFile};
  if (const std::string hf = model.spec()->HFConfigJson(); !hf.empty()) {
    if (absl::Status s = WriteFileSynced(absl::StrCat(tmp, "/", kConfigFile), hf); !s.ok()) return fail(s);
    files.push_back(kConfigFile);
  }

  json state;
  state["format"] = kFormat;
  state["version"] = kVersion;
  state["step"] = step;
  state["sampling_calls"] = meta.trainer.sampling_calls;
  state["seed"] = meta.seed;
  state["data_position"] = meta.data_position;
  state["has_optimizer_state"] = adam.has_moments();
  json history = json::object();
  for (const auto& [k, v] : meta.history) history[k] = v;
  state["history"] = history;
  json config = json::object();
  for (const auto& [k, v] : meta.run_config) config[k] = v;
  state["run_config"] = config;
  json manifest = json::object();
  for (const std::string& f : files) {
    int64_t size = 0;
    uint32_t crc = 0;
    if (absl::Status s = FileCrc(absl::StrCat(tmp, "/", f), &size, &crc); !s.ok()) return fail(s);
    manifest[f] = {{"bytes", size}, {"crc32", Hex32(crc)}};
  }
  state["files"] = manifest;
  const std::string body = state.dump();
  state["state_crc32"] = Hex32(Crc32(body.data(), body.size()));
  if (absl::Status s = WriteFileSynced(absl::StrCat(tmp, "/", kStateFile), state.dump(1) + "\n"); !s.ok())
    return fail(s);
  if (absl::Status s = FsyncPath(tmp, true); !s.ok()) return fail(s);

  // Into place. An existing checkpoint of this step goes aside first (rename does not replace a non-empty
  // directory) and is removed once the new one is in place.
  std::string replaced;
  if (fs::exists(final_dir, ec)) {
    replaced = absl::StrCat(out_dir, "/", kDelPrefix, step, "-", getpid());
    fs::remove_all(replaced, ec);
    if (std::rename(final_dir.c_str(), replaced.c_str()) != 0)
      return fail(Errno(absl::StrCat(final_dir, ": cannot move the existing checkpoint aside"), errno));
  }
  if (std::rename(tmp.c_str(), final_dir.c_str()) != 0)
    return fail(Errno(absl::StrCat(final_dir, ": cannot rename ", tmp, " into place"), errno));
  if (absl::Status s = FsyncPath(out_dir, true); !s.ok()) return s;
  if (!replaced.empty()) fs::remove_all(replaced, ec);

  if (keep > 0) {
    // The newest `keep` valid checkpoints stay; an invalid one is moved aside, neither counted nor removed.
    int kept = 1;  // the new one
    for (const auto& [s, path] : ListCheckpoints(out_dir)) {
      if (s == step) continue;
      const std::string other = fs::path(path).filename().string();
      absl::StatusOr<CheckpointMeta> meta = ReadCheckpoint(path);
      if (!meta.ok() || meta->trainer.step != s) {
        const std::string why = meta.ok() ? absl::StrCat(kStateFile, " says step ", meta->trainer.step)
                                          : std::string(meta.status().message());
        if (absl::Status r = QuarantineCheckpoint(out_dir, other, why); !r.ok()) return r;
        continue;
      }
      if (kept < keep) {
        ++kept;
        continue;
      }
      if (absl::Status r = RemoveCheckpointDir(out_dir, other); !r.ok()) return r;
    }
  }
  return final_dir;
}

absl::StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& dir) {
  const std::string state_path = absl::StrCat(dir, "/", kStateFile);
  int64_t size = 0;
  uint32_t unused = 0;
  if (absl::Status s = FileCrc(state_path, &size, &unused); !s.ok())
    return absl::DataLossError(absl::StrCat(state_path, ": missing or unreadable: not a complete checkpoint"));
  absl::StatusOr<std::string> text = io::ReadRegularFile(state_path, kMaxStateBytes);
  if (!text.ok()) return absl::DataLossError(text.status().message());
  json state = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object())
    return absl::DataLossError(absl::StrCat(state_path, ": not valid JSON (truncated or corrupt)"));
  auto bad = [&](const std::string& what) { return absl::DataLossError(absl::StrCat(state_path, ": ", what)); };
  if (!state.contains("state_crc32") || !state["state_crc32"].is_string()) return bad("no 'state_crc32' field");
  const std::string stated = state["state_crc32"].get<std::string>();
  state.erase("state_crc32");
  const std::string body = state.dump();
  if (Hex32(Crc32(body.data(), body.size())) != stated)
    return bad(absl::StrCat("CRC-32 mismatch: the contents are corrupt (stated ", stated, ", computed ",
                            Hex32(Crc32(body.data(), body.size())), ")"));
  if (!state.contains("format") || state["format"] != kFormat)
    return bad(absl::StrCat("'format' is not \"", kFormat, "\""));
  if (!state.contains("version") || !state["version"].is_number_integer() || state["version"].get<int>() != kVersion)
    return bad(absl::StrCat("unsupported 'version' (this build reads version ", kVersion, ")"));
  auto need_int = [&](const char* key, bool non_negative = true) -> absl::StatusOr<int64_t> {
    if (!state.contains(key) || !state[key].is_number_integer())
      return bad(absl::StrCat("'", key, "' is missing or not an integer"));
    if (state[key].is_number_unsigned()) {
      const uint64_t u = state[key].get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return bad(absl::StrCat("'", key, "' is out of range"));
      return static_cast<int64_t>(u);
    }
    const int64_t v = state[key].get<int64_t>();
    if (non_negative && v < 0) return bad(absl::StrCat("'", key, "' is negative"));
    return v;
  };
  CheckpointMeta meta;
  absl::StatusOr<int64_t> step = need_int("step");
  if (!step.ok()) return step.status();
  absl::StatusOr<int64_t> data_position = need_int("data_position");
  if (!data_position.ok()) return data_position.status();
  meta.trainer.step = *step;
  meta.data_position = *data_position;
  for (const char* key : {"sampling_calls", "seed"}) {
    if (!state.contains(key) || !state[key].is_number_unsigned())
      return bad(absl::StrCat("'", key, "' is missing or not a non-negative integer"));
  }
  meta.trainer.sampling_calls = state["sampling_calls"].get<uint64_t>();
  meta.seed = state["seed"].get<uint64_t>();
  if (!state.contains("has_optimizer_state") || !state["has_optimizer_state"].is_boolean())
    return bad("'has_optimizer_state' is missing or not a boolean");
  meta.has_optimizer_state = state["has_optimizer_state"].get<bool>();
  if (!state.contains("history") || !state["history"].is_object()) return bad("'history' is missing or not an object");
  for (auto it = state["history"].begin(); it != state["history"].end(); ++it) {
    if (!it.value().is_array()) return bad(absl::StrCat("history '", it.key(), "' is not an array"));
    std::vector<double>& series = meta.history[it.key()];
    for (const json& x : it.value()) {
      if (!x.is_number()) return bad(absl::StrCat("history '", it.key(), "' holds a non-number"));
      series.push_back(x.get<double>());
    }
  }
  if (!state.contains("run_config") || !state["run_config"].is_object())
    return bad("'run_config' is missing or not an object");
  for (auto it = state["run_config"].begin(); it != state["run_config"].end(); ++it) {
    if (!it.value().is_string()) return bad(absl::StrCat("run_config '", it.key(), "' is not a string"));
    meta.run_config[it.key()] = it.value().get<std::string>();
  }

  // Every file: listed, present, of its size and CRC; the safetensors headers parse.
  if (!state.contains("files") || !state["files"].is_object()) return bad("'files' is missing or not an object");
  const json& files = state["files"];
  for (const char* required : {kModelFile, kOptimizerFile})
    if (!files.contains(required)) return bad(absl::StrCat("'files' does not list ", required));
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string& f = it.key();
    if (f.empty() || f.find('/') != std::string::npos || f[0] == '.')
      return bad(absl::StrCat("bad file name '", f, "'"));
    const json& e = it.value();
    if (!e.is_object() || !e.contains("bytes") || !e["bytes"].is_number_unsigned() || !e.contains("crc32") ||
        !e["crc32"].is_string())
      return bad(absl::StrCat("entry of '", f, "' needs 'bytes' and 'crc32'"));
    const std::string path = absl::StrCat(dir, "/", f);
    int64_t actual = 0;
    uint32_t crc = 0;
    if (absl::Status s = FileCrc(path, &actual, &crc); !s.ok())
      return absl::DataLossError(absl::StrCat(path, ": missing from the checkpoint"));
    const int64_t expected = static_cast<int64_t>(e["bytes"].get<uint64_t>());
    if (actual != expected)
      return absl::DataLossError(absl::StrCat(path, ": ", actual < expected ? "truncated" : "too long", ": ", actual,
                                              " bytes, ", kStateFile, " says ", expected));
    if (Hex32(crc) != e["crc32"].get<std::string>())
      return absl::DataLossError(absl::StrCat(path, ": CRC-32 mismatch: the contents are corrupt (stated ",
                                              e["crc32"].get<std::string>(), ", computed ", Hex32(crc), ")"));
  }
  for (const char* f : {kModelFile, kOptimizerFile}) {
    absl::StatusOr<io::SafetensorsFile> st = io::SafetensorsFile::Open(absl::StrCat(dir, "/", f));
    if (!st.ok()) return absl::DataLossError(st.status().message());
  }
  return meta;
}

absl::StatusOr<CheckpointMeta> LoadCheckpoint(const std::string& dir, Trainer& trainer, const RunConfig* expected) {
  absl::StatusOr<CheckpointMeta> meta = ReadCheckpoint(dir);
  if (!meta.ok()) return meta;
  if (expected) {
    std::vector<std::string> diff = DiffRunConfig(meta->run_config, *expected);
    // runtime.* fields change rounding, not the run: a resume continues, warned that it is no longer bit-identical.
    const auto runtime = std::stable_partition(
        diff.begin(), diff.end(), [](const std::string& d) { return !absl::StartsWith(d, kRuntimePrefix); });
    for (auto it = runtime; it != diff.end(); ++it)
      meta->warnings.push_back(absl::StrCat(*it,
                                            ": the run continues, but not bit-identically to one without the "
                                            "interruption (floating-point sums split differently)"));
    diff.erase(runtime, diff.end());
    if (!diff.empty())
      return absl::FailedPreconditionError(
          absl::StrCat(dir, " was written by a run with a different configuration (", diff.size(),
                       diff.size() == 1 ? " field differs" : " fields differ", "):\n  ", absl::StrJoin(diff, "\n  ")));
  }
  Model& model = trainer.model();
  // Check every tensor against the model before anything is written into it.
  absl::StatusOr<io::SafetensorsFile> weights = io::SafetensorsFile::Open(absl::StrCat(dir, "/", kModelFile));
  if (!weights.ok()) return weights.status();
  if (absl::Status s = CheckTensors(*weights, "model weights", ModelTensors(model)); !s.ok()) return s;
  absl::StatusOr<io::SafetensorsFile> opt = io::SafetensorsFile::Open(absl::StrCat(dir, "/", kOptimizerFile));
  if (!opt.ok()) return opt.status();
  if (meta->has_optimizer_state) {
    if (absl::Status s = CheckTensors(*opt, "optimizer moments", MomentTensors(model), true); !s.ok()) return s;
  } else if (!opt->tensors().empty()) {
    return absl::DataLossError(
        absl::StrCat(opt->path(), ": holds tensors but ", kStateFile, " says there is no optimizer state"));
  }
  AdamW& adam = trainer.optimizer();
  if (meta->has_optimizer_state) {
    if (absl::Status s = adam.EnsureMoments(model); !s.ok()) return s;
  } else {  // no step taken yet: moments (if any) start from zero
    for (Tensor& t : adam.mutable_m())
      if (t.defined()) t.SetZero();
    for (Tensor& t : adam.mutable_v())
      if (t.defined()) t.SetZero();
  }

  // Into the tensors (a device's through host buffers).
  auto read = [](auto& files, const std::string& name, const Tensor& t) {
    return FillFromHost(t, [&](void* dst) { return files->ReadInto(name, t.shape(), t.dtype(), dst); });
  };
  for (Param& p : model.params())
    if (absl::Status s = read(weights, p.name, p.value); !s.ok()) return s;
  if (meta->has_optimizer_state) {
    std::vector<Param>& params = model.params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].grad.defined()) continue;
      Tensor& m = adam.mutable_m()[i];
      Tensor& v = adam.mutable_v()[i];
      if (absl::Status s = read(opt, "m." + params[i].name, m); !s.ok()) return s;
      if (absl::Status s = read(opt, "v." + params[i].name, v); !s.ok()) return s;
      if (Tensor& master = adam.mutable_master()[i]; master.defined())
        if (absl::Status s = read(opt, "master." + params[i].name, master); !s.ok()) return s;
    }
  } else {
    adam.RefreshMasters(model);  // the masters (if any) start from the weights just read
  }
  trainer.set_state(meta->trainer);
  return meta;
}

absl::StatusOr<std::string> FindLatestCheckpoint(const std::string& out_dir, std::vector<std::string>* skipped) {
  for (const auto& [step, path] : ListCheckpoints(out_dir)) {
    absl::StatusOr<CheckpointMeta> meta = ReadCheckpoint(path);
    if (meta.ok() && meta->trainer.step == step) return path;
    if (skipped)
      skipped->push_back(meta.ok() ? absl::StrCat(path, ": ", kStateFile, " says step ", meta->trainer.step)
                                   : std::string(meta.status().message()));
  }
  return absl::NotFoundError(absl::StrCat(out_dir, ": no complete checkpoint (checkpoint-<step> directory)"));
}

}  // namespace sg
