// The model handle: creating and loading models, their properties and parameters, saving them.
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"
#include "core/model_io.h"
#include "core/models/family.h"

namespace sg::cabi {
namespace {

sg_status* ParseDType(const char* fn, const char* name, DType* out) {
  const std::string s = name ? name : "f32";
  if (s == "f32" || s == "float32")
    *out = DType::kF32;
  else if (s == "f64" || s == "float64")
    *out = DType::kF64;
  else if (s == "bf16" || s == "bfloat16")
    *out = DType::kBF16;  // bf16 weights over f32 compute (docs/bf16.md)
  else
    return Invalid(absl::StrCat(fn, ": argument 'dtype' is '", s, "'; supported: f32, f64, bf16"));
  return nullptr;
}

// Writes the model's files; under a tensor-parallel trainer rank 0 alone writes (the handle holds the whole model on
// every rank) and every rank returns its status.
absl::Status SaveWhole(ModelCore& core, const std::function<absl::Status()>& save) {
  std::lock_guard<std::mutex> lock(core.mu);
  if (!core.tp_group) return save();
  return dist::WriteOnRankZero(*core.tp_group, save);
}

sg_status* CreateModel(const char* fn, const std::string& spec, const char* dtype, uint64_t seed, bool from_dir,
                       sg_model** out, const char* device, bool frozen_base, bool offload_experts) {
  DType dt = DType::kF32;
  if (sg_status* s = ParseDType(fn, dtype, &dt)) return s;
  const std::string device_name = device ? device : "cpu";
  absl::StatusOr<Device> dev = ParseDevice(device_name);
  if (!dev.ok() || *dev == Device::kMeta)
    return Invalid(absl::StrCat(fn, ": options->device is '", device_name, "'; supported: cpu, cuda"));
  if (absl::Status usable = CheckDevice(*dev); !usable.ok()) return FromAbslIn(fn, usable);
  absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(spec, dt, seed, *dev, frozen_base, offload_experts);
  if (!m.ok()) return FromAbslIn(fn, m.status());
  auto core = std::make_shared<ModelCore>();
  core->model = std::move(*m);
  if (char* absolute = realpath(spec.c_str(), nullptr)) {  // a directory (a preset name is no path)
    if (from_dir) core->source_dir = absolute;
    free(absolute);
  }
  *out = new sg_model{std::move(core)};
  return nullptr;
}

sg_status* CreatePreset(const char* fn, const char* preset, const char* dtype, uint64_t seed, const char* device,
                        sg_model** out, bool frozen_base = false, bool offload_experts = false) {
  return Guard(fn, [&]() -> sg_status* {
    if (!out) return NullArg(fn, "out");
    *out = nullptr;
    if (!preset) return NullArg(fn, "preset");
    const std::vector<std::string> known = PresetNames();
    bool found = false;
    for (const std::string& n : known) found |= n == preset;
    if (!found) {
      std::string names;
      for (const std::string& n : known) absl::StrAppend(&names, names.empty() ? "" : ", ", n);
      return Invalid(absl::StrCat(fn, ": argument 'preset' is '", preset, "'; known presets: ", names));
    }
    return CreateModel(fn, preset, dtype, seed, /*from_dir=*/false, out, device, frozen_base, offload_experts);
  });
}

sg_status* Load(const char* fn, const char* hf_dir, const char* dtype, const char* device, sg_model** out,
                bool frozen_base = false, bool offload_experts = false) {
  return Guard(fn, [&]() -> sg_status* {
    if (!out) return NullArg(fn, "out");
    *out = nullptr;
    if (!hf_dir) return NullArg(fn, "hf_dir");
    if (sg_status* s = CheckDirectory(fn, "hf_dir", hf_dir)) return s;
    return CreateModel(fn, hf_dir, dtype, 0, /*from_dir=*/true, out, device, frozen_base, offload_experts);
  });
}

// options (NULL: the defaults) into *o, its struct_size checked.
sg_status* ModelOptions(const char* fn, const sg_model_options* options, sg_model_options* o) {
  *o = sg_model_default_options();
  if (!options) return nullptr;
  if (sg_status* s = CheckStructSize(fn, "options", options->struct_size, sizeof(sg_model_options), kModelOptionsSizes))
    return s;
  o->dtype = options->dtype;
  o->device = options->device;
  o->seed = options->seed;
  if (options->struct_size > kModelOptionsSize0_7) {
    o->frozen_base = options->frozen_base;
    o->offload_experts = options->offload_experts;
  }
  return nullptr;
}

// The tensor sg_model_read_param / sg_model_write_param copy, checked.
sg_status* ParamTensor(const char* fn, const sg_model* model, int64_t index, int which, size_t bytes,
                       const Tensor** out) {
  if (!model) return NullArg(fn, "model");
  const std::vector<Param>& params = model->core->model->params();
  if (index < 0 || index >= static_cast<int64_t>(params.size()))
    return MakeStatus(SG_ERR_OUT_OF_RANGE, absl::StrCat(fn, ": argument 'index' is ", index, "; the model has ",
                                                        params.size(), " parameters"));
  if (which != SG_PARAM_VALUE && which != SG_PARAM_GRAD)
    return Invalid(absl::StrCat(fn, ": argument 'which' is ", which, "; use SG_PARAM_VALUE (0) or SG_PARAM_GRAD (1)"));
  const Param& p = params[index];
  const Tensor& t = which == SG_PARAM_VALUE ? p.value : p.grad;
  if (!t.defined())
    return MakeStatus(SG_ERR_FAILED_PRECONDITION, absl::StrCat(fn, ": '", p.name, "' is frozen: it has no gradient"));
  if (bytes != t.nbytes())
    return Invalid(absl::StrCat(fn, ": argument 'bytes' is ", bytes, "; '", p.name, "' has ", t.nbytes(), " bytes"));
  *out = &t;
  return nullptr;
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

const char* sg_dtype_name(int dtype) {
  if (dtype < 0 || dtype > SG_DTYPE_I64) return nullptr;
  return sg::DTypeName(static_cast<sg::DType>(dtype));
}

const char* const* sg_model_preset_names(void) {
  // Built once from the core's preset lists; the strings live as long as the library.
  static const std::vector<std::string>* const kStrings = new std::vector<std::string>(sg::PresetNames());
  static const std::vector<const char*>* const kNames = [] {
    auto* v = new std::vector<const char*>();
    for (const std::string& n : *kStrings) v->push_back(n.c_str());
    v->push_back(nullptr);
    return v;
  }();
  return kNames->data();
}

sg_status* sg_model_create_preset(const char* preset, const char* dtype, uint64_t seed, sg_model** out) {
  return CreatePreset("sg_model_create_preset", preset, dtype, seed, nullptr, out);
}

sg_status* sg_model_load(const char* hf_dir, const char* dtype, sg_model** out) {
  return Load("sg_model_load", hf_dir, dtype, nullptr, out);
}

sg_model_options sg_model_default_options(void) {
  sg_model_options o{};
  o.struct_size = sizeof(sg_model_options);
  return o;
}

sg_status* sg_model_create_preset_with(const char* preset, const sg_model_options* options, sg_model** out) {
  static const char fn[] = "sg_model_create_preset_with";
  sg_model_options o;
  if (sg_status* s = ModelOptions(fn, options, &o)) return s;
  return CreatePreset(fn, preset, o.dtype, o.seed, o.device, out, o.frozen_base != 0, o.offload_experts != 0);
}

sg_status* sg_model_load_with(const char* hf_dir, const sg_model_options* options, sg_model** out) {
  static const char fn[] = "sg_model_load_with";
  sg_model_options o;
  if (sg_status* s = ModelOptions(fn, options, &o)) return s;
  return Load(fn, hf_dir, o.dtype, o.device, out, o.frozen_base != 0, o.offload_experts != 0);
}

const char* sg_model_device(const sg_model* model) {
  if (!model) return "";
  return model->core->model->memory().device() == sg::Device::kCUDA ? "cuda" : "cpu";
}

sg_status* sg_model_save(sg_model* model, const char* dir) {
  static const char fn[] = "sg_model_save";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbsl(
        SaveWhole(*model->core, [&] { return sg::SaveModel(*model->core->model, dir, model->core->source_dir); }));
  });
}

sg_status* sg_model_save_as(sg_model* model, const char* dir, const char* dtype) {
  static const char fn[] = "sg_model_save_as";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    const std::string what = absl::StrCat(fn, ": argument 'dtype'");
    absl::StatusOr<sg::SaveDType> as = sg::ParseSaveDType(dtype ? dtype : "", what);
    if (!as.ok()) return FromAbsl(as.status());
    if (absl::Status s = sg::CheckSaveDType(*model->core->model, *as, what); !s.ok()) return FromAbsl(s);
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbsl(
        SaveWhole(*model->core, [&] { return sg::SaveModel(*model->core->model, dir, model->core->source_dir, *as); }));
  });
}

void sg_model_free(sg_model* model) { delete model; }

const char* sg_model_family(const sg_model* model) {
  if (!model) return "";
  // Static strings: the C API promises them for the library's lifetime.
  return model->core->model->family() == "ssm" ? "ssm" : "transformer";
}
int64_t sg_model_vocab_size(const sg_model* model) { return model ? model->core->model->vocab_size() : -1; }
int64_t sg_model_num_layers(const sg_model* model) { return model ? model->core->model->num_layers() : -1; }
int64_t sg_model_hidden_size(const sg_model* model) { return model ? model->core->model->hidden_size() : -1; }
int64_t sg_model_num_params(const sg_model* model) {
  return model ? static_cast<int64_t>(model->core->model->params().size()) : -1;
}
int sg_model_dtype(const sg_model* model) { return model ? static_cast<int>(model->core->model->dtype()) : -1; }

sg_param_info sg_param_info_init(void) {
  sg_param_info p{};
  p.struct_size = sizeof(sg_param_info);
  return p;
}

sg_status* sg_model_param_info(const sg_model* model, int64_t index, sg_param_info* out) {
  static const char fn[] = "sg_model_param_info";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!out) return NullArg(fn, "out");
    if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_param_info), kParamInfoSizes)) return s;
    std::vector<sg::Param>& params = model->core->model->params();
    if (index < 0 || index >= static_cast<int64_t>(params.size()))
      return MakeStatus(SG_ERR_OUT_OF_RANGE, absl::StrCat(fn, ": argument 'index' is ", index, "; the model has ",
                                                          params.size(), " parameters"));
    const sg::Param& p = params[index];
    if (p.value.shape().size() > SG_MAX_DIMS)
      return MakeStatus(SG_ERR_UNIMPLEMENTED, absl::StrCat(fn, ": '", p.name, "' has more than 8 dimensions"));
    out->name = p.name.c_str();
    out->dtype = static_cast<int>(p.value.dtype());
    out->ndim = static_cast<int>(p.value.shape().size());
    for (int i = 0; i < SG_MAX_DIMS; ++i) out->shape[i] = i < out->ndim ? p.value.shape()[i] : 0;
    out->numel = p.value.numel();
    out->data = p.value.raw();
    out->grad = p.grad.defined() ? p.grad.raw() : nullptr;
    if (out->struct_size > kParamInfoSize0_6) out->on_device = !sg::HostAddressable(p.value.device());
    return nullptr;
  });
}

sg_status* sg_model_read_param(const sg_model* model, int64_t index, int which, void* dst, size_t bytes) {
  static const char fn[] = "sg_model_read_param";
  return Guard(fn, [&]() -> sg_status* {
    const sg::Tensor* t = nullptr;
    if (sg_status* s = ParamTensor(fn, model, index, which, bytes, &t)) return s;
    if (!dst) return NullArg(fn, "dst");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    sg::CopyToHost(*t, dst);
    return nullptr;
  });
}

sg_status* sg_model_write_param(sg_model* model, int64_t index, int which, const void* src, size_t bytes) {
  static const char fn[] = "sg_model_write_param";
  return Guard(fn, [&]() -> sg_status* {
    const sg::Tensor* t = nullptr;
    if (sg_status* s = ParamTensor(fn, model, index, which, bytes, &t)) return s;
    if (!src) return NullArg(fn, "src");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    sg::CopyFromHost(*t, src);
    return nullptr;
  });
}

}  // extern "C"
