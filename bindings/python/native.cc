// seqgrad._native: a thin pybind11 layer over the C ABI (seqgrad/seqgrad.h) only — never over core C++.
// Statuses become exceptions built by seqgrad._errors.from_status(code, message); the GIL is released while a
// trainer computes. Parameter/gradient arrays share memory with the model and keep its native handle alive.
// Arrays passed in must already have the exact dtype, shape and layout the C ABI reads (the Python layer converts);
// anything else is an InvalidArgumentError naming the argument, never a silent conversion.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

// NumPy 2 changed the array descriptor's layout; pybind11 reads both only since 2.12 (2.10, Debian 12's, gives
// all-zero strides under NumPy 2). //third_party:pybind11 is PyPI's: this stops Debian's headers slipping in.
#if !defined(PYBIND11_VERSION_HEX) || PYBIND11_VERSION_HEX < 0x020C0000
#error "pybind11 >= 2.12 is needed for NumPy 2 (//third_party:pybind11 should be the PyPI one)"
#endif

#include <atomic>
#include <deque>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "cabi/grad_views.h"
#include "cabi/trainer_options.h"
#include "seqgrad/seqgrad.h"

namespace py = pybind11;

namespace {

[[noreturn]] void RaiseCode(int code, const std::string& msg) {
  py::object exc = py::module_::import("seqgrad._errors").attr("from_status")(code, msg);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}
[[noreturn]] void Raise(sg_status* st) {
  const int code = sg_status_code(st);
  const std::string msg = sg_status_message(st);
  sg_status_free(st);
  RaiseCode(code, msg);
}
void Check(sg_status* st) {
  if (st) Raise(st);
}
[[noreturn]] void RaiseClosed(const char* what) {
  py::object cls = py::module_::import("seqgrad._errors").attr("ClosedError");
  PyErr_SetString(cls.ptr(), (std::string(what) + " is closed").c_str());
  throw py::error_already_set();
}

// The numpy dtype of an sg_dtype and its element size in bytes.
std::pair<py::dtype, py::ssize_t> NumpyDType(int dt) {
  switch (dt) {
    case SG_DTYPE_F32: return {py::dtype::of<float>(), 4};
    case SG_DTYPE_F64: return {py::dtype::of<double>(), 8};
    case SG_DTYPE_I32: return {py::dtype::of<int32_t>(), 4};
    case SG_DTYPE_I64: return {py::dtype::of<int64_t>(), 8};
    case SG_DTYPE_F16: return {py::dtype("float16"), 2};
    case SG_DTYPE_BF16: return {py::dtype("uint16"), 2};  // raw bf16 bits
  }
  RaiseCode(SG_ERR_INTERNAL, "unknown sg_dtype " + std::to_string(dt));
}

// A numpy array over one parameter's (or gradient's) row-major memory; `base` keeps the memory alive. The byte
// strides are given explicitly from the C ABI's element size, and the array numpy built is checked against them,
// so a pybind11/NumPy mismatch raises instead of aliasing every element to the first.
// A CUDA model's tensors are not host memory: HostCopy below makes arrays of their values instead. `sg_dtype` is
// the stored dtype (a bf16 parameter's gradient is f32, the model's dtype).
py::array View(const sg_param_info& p, int sg_dtype, void* data, py::object base) {
  auto [dtype, elem] = NumpyDType(sg_dtype);
  std::vector<py::ssize_t> shape(p.shape, p.shape + p.ndim), strides(p.ndim);
  py::ssize_t stride = elem;
  for (int d = p.ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
  py::array a(dtype, shape, strides, data, base);
  bool ok = a.itemsize() == elem && a.data() == data;
  for (int d = 0; d < p.ndim; ++d) ok = ok && a.strides(d) == strides[d] && a.shape(d) == shape[d];
  if (!ok)
    RaiseCode(SG_ERR_INTERNAL, std::string("numpy view of ") + p.name +
                                   " does not have the layout asked for (itemsize " + std::to_string(a.itemsize()) +
                                   ", expected " + std::to_string(elem) +
                                   "): this pybind11 does not match the installed NumPy");
  return a;
}

// A new array holding a copy of a device parameter's values (which = SG_PARAM_VALUE) or gradient, in sg_dtype.
py::array HostCopy(sg_model* m, int64_t index, const sg_param_info& p, int which, int sg_dtype) {
  auto [dtype, elem] = NumpyDType(sg_dtype);
  py::array a(dtype, std::vector<py::ssize_t>(p.shape, p.shape + p.ndim));
  sg_status* st;
  {
    py::gil_scoped_release release;
    st = sg_model_read_param(m, index, which, a.mutable_data(), static_cast<size_t>(p.numel) * elem);
  }
  Check(st);
  return a;
}

// `obj` as a 1-D C-contiguous aligned array of exactly T (named `what` in the error otherwise).
template <typename T>
py::array_t<T, py::array::c_style> Exact(const py::handle& obj, const std::string& what, const char* type_name) {
  using Array = py::array_t<T, py::array::c_style>;
  constexpr int kAligned = py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  if (py::isinstance<Array>(obj)) {
    auto a = py::reinterpret_borrow<Array>(obj);
    if (a.ndim() == 1 && (a.flags() & kAligned)) return a;
  }
  std::string got = std::string(py::str(py::type::handle_of(obj).attr("__name__")));
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    got = "dtype " + std::string(py::str(a.dtype())) + ", shape " + std::string(py::str(obj.attr("shape"))) +
          (a.flags() & py::array::c_style ? "" : ", not C-contiguous") + (a.flags() & kAligned ? "" : ", unaligned");
  }
  RaiseCode(SG_ERR_INVALID_ARGUMENT,
            what + " must be a 1-D C-contiguous aligned numpy array of " + type_name + ", got " + got);
}

// Owns one sg_model reference. Python arrays viewing its memory hold a reference to this object.
struct NativeModel {
  sg_model* m = nullptr;
  sg::cabi::GradViews grad_views;  // live numpy views of gradients (GradViewBase)
  explicit NativeModel(sg_model* m) : m(m) {}
  ~NativeModel() { sg_model_free(m); }
};

// The base object of a gradient view: keeps the model alive and counts the view (slices of the view share it).
py::capsule GradViewBase(const std::shared_ptr<NativeModel>& model) {
  struct Keeper {
    std::shared_ptr<NativeModel> model;
  };
  auto* k = new Keeper{model};
  {
    auto lock = model->grad_views.Lock();
    model->grad_views.Retain();
  }
  return py::capsule(k, [](void* p) {
    auto* k = static_cast<Keeper*>(p);
    k->model->grad_views.Release();
    delete k;
  });
}

// Before a call that enables LoRA (cabi/grad_views.h): refused while numpy views of gradients are alive.
void CheckNoGradViews(NativeModel& self, const char* what, bool enables_only_without_lora) {
  std::string refusal;
  {
    auto lock = self.grad_views.Lock();  // released before raising: the exception may collect a view (Release)
    refusal = self.grad_views.LoraRefusal(self.m, what, enables_only_without_lora,
                                          "numpy view(s) of the model's gradients (Model.gradients())");
  }
  if (!refusal.empty()) RaiseCode(SG_ERR_FAILED_PRECONDITION, refusal);
}

// Sets one field of sg_trainer_options from a Python value of its kind; `strings` keeps the string options' bytes.
template <sg::cabi::OptionKind K, typename T>
void SetOption(py::handle value, const char* name, std::deque<std::string>* strings, T* field) {
  using sg::cabi::OptionKind;
  try {
    if constexpr (K == OptionKind::kString) {
      *field = strings->emplace_back(value.cast<std::string>()).c_str();
    } else if constexpr (K == OptionKind::kBool) {
      *field = value.cast<bool>() ? 1 : 0;
    } else {
      *field = value.cast<T>();
    }
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("Trainer option '") + name + "' cannot be " +
                         std::string(py::str(py::type::handle_of(value).attr("__name__"))));
  }
}

// sg_trainer_options' field names (cabi/trainer_options.inc), the Python layer's option names.
constexpr const char* kTrainerOptionNames[] = {
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) #name,
#include "cabi/trainer_options.inc"
};

// sg_trainer_options from a dict keyed by its field names; the fields the dict lacks keep their defaults.
sg_trainer_options TrainerOptions(const py::dict& options, std::deque<std::string>* strings) {
  for (const auto& item : options) {
    bool known = false;
    for (const char* name : kTrainerOptionNames) known = known || py::str(name).equal(item.first);
    if (!known) RaiseCode(SG_ERR_INVALID_ARGUMENT, "Trainer: unknown option " + std::string(py::repr(item.first)));
  }
  sg_trainer_options o = sg_trainer_default_options();
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) \
  if (options.contains(#name)) SetOption<sg::cabi::OptionKind::kind>(options[#name], #name, strings, &o.name);
#include "cabi/trainer_options.inc"
  return o;
}

struct NativeTrainer {
  sg_trainer* t = nullptr;
  std::atomic<int> inflight{0};
  py::object callback;  // Python callable or None
  py::object callback_error;  // exception raised by the callback, re-raised after the step
  ~NativeTrainer() { sg_trainer_free(t); }
  sg_trainer* get() {
    if (!t) RaiseClosed("Trainer");
    return t;
  }
};

void ProgressTrampoline(void* user, const sg_progress* p) {
  auto* self = static_cast<NativeTrainer*>(user);
  py::gil_scoped_acquire gil;
  if (self->callback.is_none() || !self->callback_error.is_none()) return;
  try {
    py::dict d;
    d["step"] = p->step;
    d["loss"] = p->loss;
    d["tokens"] = p->tokens;
    d["grad_norm"] = p->grad_norm;
    d["phase"] = p->phase == 0 ? "gradients" : "optimizer";
    self->callback(d);
  } catch (py::error_already_set& e) {
    self->callback_error = e.value();
  }
}

py::dict MetricsDict(const sg_metrics& m) {
  py::dict d;
  d["loss"] = m.loss;
  d["tokens"] = m.tokens;
  d["grad_norm"] = m.grad_norm;
  d["step"] = m.step;
  d["peak_bytes"] = m.peak_bytes;
  py::dict peak, at_peak;
  for (int c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c) {
    peak[sg_memory_category_name(c)] = m.peak_bytes_by_category[c];
    at_peak[sg_memory_category_name(c)] = m.bytes_at_peak_by_category[c];
  }
  peak[sg_memory_category_name(SG_MEMORY_CATEGORY_MASTER_WEIGHTS)] = m.peak_bytes_master_weights;
  at_peak[sg_memory_category_name(SG_MEMORY_CATEGORY_MASTER_WEIGHTS)] = m.bytes_at_peak_master_weights;
  d["peak_bytes_by_category"] = peak;
  d["bytes_at_peak_by_category"] = at_peak;
  d["seconds"] = m.seconds;
  d["chunks"] = m.chunks;
  d["chunks_backpropagated"] = m.chunks_backpropagated;
  d["adjoint_pairs"] = m.adjoint_pairs;
  d["lr"] = m.lr;
  d["micro_batches"] = m.micro_batches;
  d["tp"] = m.tp;
  d["tp_bytes_reduced"] = m.tp_bytes_reduced;
  return d;
}

using IdArray = py::array_t<int32_t, py::array::c_style>;
using LenArray = py::array_t<int64_t, py::array::c_style>;
using F64Array = py::array_t<double, py::array::c_style>;

IdArray Ids(const py::handle& obj, const std::string& what) { return Exact<int32_t>(obj, what, "int32"); }
LenArray Int64s(const py::handle& obj, const std::string& what) { return Exact<int64_t>(obj, what, "int64"); }
F64Array Float64s(const py::handle& obj, const std::string& what) { return Exact<double>(obj, what, "float64"); }

// Runs call(sg_metrics*) -> sg_status* with the GIL released, then raises what the progress callback raised (as the
// cause of a StepAppliedError when the call completed: its update is in place), or the status.
template <typename F>
py::dict CallTrainer(NativeTrainer& self, F&& call) {
  sg_metrics m = sg_metrics_init();
  sg_status* st;
  self.callback_error = py::none();
  self.inflight.fetch_add(1);
  {
    py::gil_scoped_release release;
    st = call(&m);
  }
  self.inflight.fetch_sub(1);
  if (!self.callback_error.is_none()) {
    py::object e = self.callback_error;
    self.callback_error = py::none();
    if (!st) e = py::module_::import("seqgrad._errors").attr("step_applied")(sg_trainer_step_count(self.t), e);
    sg_status_free(st);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
    throw py::error_already_set();
  }
  Check(st);
  return MetricsDict(m);
}

void CheckSize(py::ssize_t got, py::ssize_t want, const std::string& what, const std::string& of) {
  if (got != want)
    RaiseCode(SG_ERR_INVALID_ARGUMENT, what + " has " + std::to_string(got) + " entries but " + of + " has " +
                                           std::to_string(want) + " tokens");
}

enum Mode { kGradients = 0, kStep = 1, kEvaluate = 2, kAccumulate = 3 };

// A packed batch: ids, labels (None = next-token labels), lengths, and documents (None, or per sequence a count and
// the lengths, flat): int32/int32/int64/int64/int64 C-contiguous (the Python layer converts). c points into them.
struct Batch {
  IdArray ids, labels;
  LenArray lengths, num_documents, doc_lengths;
  sg_batch c = sg_batch_init();
};

Batch ReadBatch(const py::object& ids_obj, const py::object& labels_obj, const py::object& lengths_obj,
                const py::object& num_documents_obj, const py::object& doc_lengths_obj) {
  Batch b;
  b.ids = Ids(ids_obj, "ids");
  b.lengths = Int64s(lengths_obj, "lengths");
  b.c.ids = b.ids.data();
  b.c.num_tokens = b.ids.size();
  b.c.lengths = b.lengths.data();
  b.c.num_sequences = b.lengths.size();
  if (!labels_obj.is_none()) {
    b.labels = Ids(labels_obj, "labels");
    if (b.labels.size() != b.ids.size())
      RaiseCode(SG_ERR_INVALID_ARGUMENT, "labels has " + std::to_string(b.labels.size()) + " tokens but ids has " +
                                             std::to_string(b.ids.size()));
    b.c.labels = b.labels.data();
  }
  if (!num_documents_obj.is_none()) {
    b.num_documents = Int64s(num_documents_obj, "num_documents");
    CheckSize(b.num_documents.size(), b.lengths.size(), "num_documents", "lengths (sequences)");
    b.doc_lengths = Int64s(doc_lengths_obj, "doc_lengths");
    b.c.num_documents = b.num_documents.data();
    b.c.doc_lengths = b.doc_lengths.size() ? b.doc_lengths.data() : nullptr;
  }
  return b;
}

py::dict RunStep(NativeTrainer& self, py::object ids_obj, py::object labels_obj, py::object lengths_obj,
                 py::object num_documents, py::object doc_lengths, Mode mode) {
  sg_trainer* t = self.get();
  Batch b = ReadBatch(ids_obj, labels_obj, lengths_obj, num_documents, doc_lengths);
  return CallTrainer(self, [&](sg_metrics* m) {
    auto fn = mode == kStep         ? sg_trainer_step_batch
              : mode == kEvaluate   ? sg_trainer_evaluate_batch
              : mode == kAccumulate ? sg_trainer_accumulate_gradients_batch
                                    : sg_trainer_compute_gradients_batch;
    return fn(t, &b.c, m);
  });
}

// (log-probs aligned with ids, metrics) of sg_trainer_score.
py::tuple Score(NativeTrainer& self, py::object ids_obj, py::object labels_obj, py::object lengths_obj,
                py::object num_documents, py::object doc_lengths) {
  sg_trainer* t = self.get();
  Batch b = ReadBatch(ids_obj, labels_obj, lengths_obj, num_documents, doc_lengths);
  F64Array logprobs(b.ids.size());
  double* out = logprobs.mutable_data();
  py::dict metrics = CallTrainer(self, [&](sg_metrics* m) { return sg_trainer_score_batch(t, &b.c, out, m); });
  return py::make_tuple(logprobs, metrics);
}

// A list of sequences as C pointer arrays: ids (int32 arrays), labels (int32 arrays or None = next-token labels)
// and their lengths; the arrays are kept alive by this object.
struct Sequences {
  std::vector<IdArray> id_arrays, label_arrays;
  std::vector<const int32_t*> ids, labels;
  std::vector<int64_t> lengths;

  Sequences(const py::list& ids_list, const py::list& labels_list, const std::string& what) {
    CheckSize(static_cast<py::ssize_t>(labels_list.size()), static_cast<py::ssize_t>(ids_list.size()),
              what + " labels", what + " ids (sequences)");
    for (size_t i = 0; i < ids_list.size(); ++i) {
      const std::string name = what + "[" + std::to_string(i) + "]";
      id_arrays.push_back(Ids(ids_list[i], name + " ids"));
      ids.push_back(id_arrays.back().data());
      lengths.push_back(id_arrays.back().size());
      if (labels_list[i].is_none()) {
        labels.push_back(nullptr);
      } else {
        label_arrays.push_back(Ids(labels_list[i], name + " labels"));
        CheckSize(label_arrays.back().size(), id_arrays.back().size(), name + " labels", name + " ids");
        labels.push_back(label_arrays.back().data());
      }
    }
  }
};

// Per-sequence float64 arrays (or None) of each sequence's length, as a C pointer array.
struct PerToken {
  std::vector<F64Array> arrays;
  std::vector<const double*> ptrs;

  PerToken(const py::list& list, const Sequences& seqs, const std::string& what) {
    CheckSize(static_cast<py::ssize_t>(list.size()), static_cast<py::ssize_t>(seqs.ids.size()), what,
              "the batch (sequences)");
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].is_none()) {
        ptrs.push_back(nullptr);
        continue;
      }
      arrays.push_back(Float64s(list[i], what + "[" + std::to_string(i) + "]"));
      CheckSize(arrays.back().size(), seqs.lengths[i], what + "[" + std::to_string(i) + "]",
                "sequence " + std::to_string(i));
      ptrs.push_back(arrays.back().data());
    }
  }
};

py::dict RunDpo(NativeTrainer& self, const py::list& chosen_ids, const py::list& chosen_labels,
                const py::list& rejected_ids, const py::list& rejected_labels, py::object ref_chosen_obj,
                py::object ref_rejected_obj, int mode) {
  sg_trainer* t = self.get();
  Sequences chosen(chosen_ids, chosen_labels, "chosen"), rejected(rejected_ids, rejected_labels, "rejected");
  CheckSize(static_cast<py::ssize_t>(rejected.ids.size()), static_cast<py::ssize_t>(chosen.ids.size()),
            "rejected (sequences)", "chosen (sequences)");
  F64Array ref_chosen = Float64s(ref_chosen_obj, "ref_chosen_logp");
  F64Array ref_rejected = Float64s(ref_rejected_obj, "ref_rejected_logp");
  const py::ssize_t n = static_cast<py::ssize_t>(chosen.ids.size());
  CheckSize(ref_chosen.size(), n, "ref_chosen_logp", "chosen (sequences)");
  CheckSize(ref_rejected.size(), n, "ref_rejected_logp", "chosen (sequences)");
  return CallTrainer(self, [&](sg_metrics* m) {
    auto fn = mode == kStep         ? sg_trainer_step_dpo
              : mode == kAccumulate ? sg_trainer_accumulate_gradients_dpo
                                    : sg_trainer_compute_gradients_dpo;
    return fn(t, chosen.ids.data(), chosen.labels.data(), chosen.lengths.data(), rejected.ids.data(),
              rejected.labels.data(), rejected.lengths.data(), ref_chosen.data(), ref_rejected.data(), n, m);
  });
}

py::dict RunGrpo(NativeTrainer& self, const py::list& ids, const py::list& labels, py::object advantages_obj,
                 const py::list& old_logprobs, const py::list& ref_logprobs, py::object offsets_obj, int mode) {
  sg_trainer* t = self.get();
  Sequences seqs(ids, labels, "completions");
  F64Array advantages = Float64s(advantages_obj, "advantages");
  LenArray offsets = Int64s(offsets_obj, "group_offsets");
  const py::ssize_t n = static_cast<py::ssize_t>(seqs.ids.size());
  CheckSize(advantages.size(), n, "advantages", "completions (sequences)");
  PerToken old_lp(old_logprobs, seqs, "old_logprobs"), ref_lp(ref_logprobs, seqs, "ref_logprobs");
  if (offsets.size() < 1) RaiseCode(SG_ERR_INVALID_ARGUMENT, "group_offsets is empty; need num_groups + 1 entries");
  return CallTrainer(self, [&](sg_metrics* m) {
    auto fn = mode == kStep         ? sg_trainer_step_grpo
              : mode == kAccumulate ? sg_trainer_accumulate_gradients_grpo
                                    : sg_trainer_compute_gradients_grpo;
    return fn(t, seqs.ids.data(), seqs.labels.data(), seqs.lengths.data(), advantages.data(), old_lp.ptrs.data(),
              ref_lp.ptrs.data(), n, offsets.data(), offsets.size() - 1, m);
  });
}

// Held-out evaluation with the distance buckets as a list of dicts.
py::dict EvaluateDetailed(NativeTrainer& self, py::object ids_obj, py::object labels_obj, py::object lengths_obj,
                          py::object distances_obj, py::object num_documents, py::object doc_lengths) {
  sg_trainer* t = self.get();
  Batch b = ReadBatch(ids_obj, labels_obj, lengths_obj, num_documents, doc_lengths);
  LenArray distances;
  const int64_t* distances_ptr = nullptr;
  if (!distances_obj.is_none()) {
    distances = Int64s(distances_obj, "distances");
    CheckSize(distances.size(), b.ids.size(), "distances", "ids");
    distances_ptr = distances.data();
  }
  sg_eval_result r = sg_eval_result_init();
  sg_status* st;
  self.inflight.fetch_add(1);
  {
    py::gil_scoped_release release;
    st = sg_trainer_evaluate_detailed_batch(t, &b.c, distances_ptr, &r);
  }
  self.inflight.fetch_sub(1);
  Check(st);
  py::dict d;
  d["sequences"] = r.sequences;
  d["tokens"] = r.tokens;
  d["loss"] = r.loss;
  d["perplexity"] = r.perplexity;
  d["correct"] = r.correct;
  d["accuracy"] = r.accuracy;
  d["peak_bytes"] = r.peak_bytes;
  d["seconds"] = r.seconds;
  py::list buckets;
  for (int64_t k = 0; k < r.num_buckets; ++k) {
    py::dict b;
    b["lo"] = int64_t{1} << k;
    b["hi"] = int64_t{1} << (k + 1);
    b["count"] = r.bucket_count[k];
    b["correct"] = r.bucket_correct[k];
    b["accuracy"] = r.bucket_count[k] ? static_cast<double>(r.bucket_correct[k]) / r.bucket_count[k] : 0.0;
    b["loss"] = r.bucket_loss[k];
    buckets.append(b);
  }
  d["by_distance"] = buckets;
  return d;
}

// Runs a checkpoint call (GIL released); returns (step, data_position).
template <typename F>
py::tuple CheckpointCall(NativeTrainer& self, F&& call) {
  sg_trainer* t = self.get();
  int64_t step = -1, position = -1;
  sg_status* st;
  self.inflight.fetch_add(1);
  {
    py::gil_scoped_release release;
    st = call(t, &step, &position);
  }
  self.inflight.fetch_sub(1);
  Check(st);
  return py::make_tuple(step, position);
}

}  // namespace

PYBIND11_MODULE(_native, mod) {
  mod.doc() = "seqgrad C ABI bindings (use the seqgrad package, not this module)";
  mod.attr("VERSION_MAJOR") = SG_VERSION_MAJOR;
  mod.attr("VERSION_MINOR") = SG_VERSION_MINOR;
  mod.attr("VERSION_PATCH") = SG_VERSION_PATCH;
  mod.def("version", [] { return std::string(sg_version()); });
  mod.def("code_name", [](int c) { return std::string(sg_code_name(c)); });
  mod.def("memory_category_names", [] {
    py::list l;
    for (int c = 0; c < SG_NUM_MEMORY_CATEGORIES_ALL; ++c) l.append(sg_memory_category_name(c));
    return l;
  });
  mod.attr("TRAINER_OPTIONS") = [] {
    py::tuple names(std::size(kTrainerOptionNames));
    for (size_t i = 0; i < std::size(kTrainerOptionNames); ++i) names[i] = kTrainerOptionNames[i];
    return names;
  }();
  // sg_trainer_default_options() as a dict keyed by TRAINER_OPTIONS (flags as bools).
  mod.def("trainer_default_options", [] {
    using sg::cabi::OptionKind;
    const sg_trainer_options o = sg_trainer_default_options();
    py::dict d;
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) \
  d[#name] = OptionKind::kind == OptionKind::kBool ? py::object(py::bool_(o.name != 0)) : py::cast(o.name);
#include "cabi/trainer_options.inc"
    return d;
  });
  mod.def("preset_names", [] {
    py::list l;
    for (const char* const* p = sg_model_preset_names(); *p; ++p) l.append(*p);
    return l;
  });

  py::class_<NativeModel, std::shared_ptr<NativeModel>>(mod, "Model")
      .def_static("create_preset",
                  [](const std::string& name, const std::string& dtype, uint64_t seed, const std::string& device,
                     bool frozen_base, bool offload_experts) {
                    sg_model_options o = sg_model_default_options();
                    o.dtype = dtype.c_str();
                    o.device = device.c_str();
                    o.seed = seed;
                    o.frozen_base = frozen_base;
                    o.offload_experts = offload_experts;
                    sg_model* m = nullptr;
                    sg_status* st;
                    {
                      py::gil_scoped_release release;
                      st = sg_model_create_preset_with(name.c_str(), &o, &m);
                    }
                    Check(st);
                    return std::make_shared<NativeModel>(m);
                  })
      .def_static("load",
                  [](const std::string& dir, const std::string& dtype, const std::string& device, bool frozen_base,
                     bool offload_experts) {
                    sg_model_options o = sg_model_default_options();
                    o.dtype = dtype.c_str();
                    o.device = device.c_str();
                    o.frozen_base = frozen_base;
                    o.offload_experts = offload_experts;
                    sg_model* m = nullptr;
                    sg_status* st;
                    {
                      py::gil_scoped_release release;
                      st = sg_model_load_with(dir.c_str(), &o, &m);
                    }
                    Check(st);
                    return std::make_shared<NativeModel>(m);
                  })
      .def("save",
           [](NativeModel& self, const std::string& dir, const std::string& dtype) {
             sg_status* st;
             {
               py::gil_scoped_release release;
               st = sg_model_save_as(self.m, dir.c_str(), dtype.c_str());
             }
             Check(st);
           })
      .def_property_readonly("vocab_size", [](NativeModel& s) { return sg_model_vocab_size(s.m); })
      .def_property_readonly("num_layers", [](NativeModel& s) { return sg_model_num_layers(s.m); })
      .def_property_readonly("hidden_size", [](NativeModel& s) { return sg_model_hidden_size(s.m); })
      .def_property_readonly("num_params", [](NativeModel& s) { return sg_model_num_params(s.m); })
      .def_property_readonly("family", [](NativeModel& s) { return std::string(sg_model_family(s.m)); })
      .def_property_readonly("dtype", [](NativeModel& s) { return std::string(sg_dtype_name(sg_model_dtype(s.m))); })
      .def_property_readonly("device", [](NativeModel& s) { return std::string(sg_model_device(s.m)); })
      // (name, numpy dtype, shape) of parameter i.
      .def("param_meta",
           [](NativeModel& self, int64_t i) {
             sg_param_info p = sg_param_info_init();
             Check(sg_model_param_info(self.m, i, &p));
             py::tuple shape(p.ndim);
             for (int d = 0; d < p.ndim; ++d) shape[d] = p.shape[d];
             return py::make_tuple(std::string(p.name), NumpyDType(p.dtype).first, shape);
           })
      // Writes parameter i's values from a C-contiguous array of its dtype and size (any device).
      .def("write_param",
           [](NativeModel& self, int64_t i, const py::array& values) {
             sg_param_info p = sg_param_info_init();
             Check(sg_model_param_info(self.m, i, &p));
             const size_t bytes = static_cast<size_t>(p.numel) * NumpyDType(p.dtype).second;
             if (!(values.flags() & py::array::c_style) || !values.dtype().is(NumpyDType(p.dtype).first) ||
                 static_cast<size_t>(values.nbytes()) != bytes)
               RaiseCode(SG_ERR_INVALID_ARGUMENT,
                         std::string("values for '") + p.name + "' must be a C-contiguous " +
                             std::string(py::str(NumpyDType(p.dtype).first)) + " array of " +
                             std::to_string(p.numel) + " elements, got dtype " + std::string(py::str(values.dtype())) +
                             ", " + std::to_string(values.size()) + " elements");
             sg_status* st;
             {
               py::gil_scoped_release release;
               st = sg_model_write_param(self.m, i, SG_PARAM_VALUE, values.data(), bytes);
             }
             Check(st);
           })
      .def("set_memory_limit", [](NativeModel& s, int64_t bytes) { Check(sg_model_set_memory_limit(s.m, bytes)); })
      .def_property_readonly("memory_limit", [](NativeModel& s) { return sg_model_memory_limit(s.m); })
      // targets: comma-separated names, "all", or None (the family's default); alpha 0 = 2 * rank.
      .def("enable_lora",
           [](NativeModel& s, int64_t rank, double alpha, double dropout, py::object targets, uint64_t seed) {
             CheckNoGradViews(s, "Model.enable_lora", false);
             sg_lora_options o = sg_lora_default_options();
             o.rank = rank;
             o.alpha = alpha;
             o.dropout = dropout;
             std::string t = targets.is_none() ? std::string() : targets.cast<std::string>();
             o.targets = targets.is_none() ? nullptr : t.c_str();
             o.seed = seed;
             Check(sg_model_enable_lora(s.m, &o));
           })
      // None without LoRA, else a dict of its options.
      .def("lora",
           [](NativeModel& s) -> py::object {
             sg_lora_options o = sg_lora_default_options();
             Check(sg_model_lora(s.m, &o));
             if (o.rank == 0) return py::none();
             py::dict d;
             d["rank"] = o.rank;
             d["alpha"] = o.alpha;
             d["dropout"] = o.dropout;
             d["targets"] = std::string(o.targets ? o.targets : "");
             d["seed"] = o.seed;
             return d;
           })
      .def("save_lora_adapter",
           [](NativeModel& s, const std::string& dir, py::object base) {
             std::string b = base.is_none() ? std::string() : base.cast<std::string>();
             sg_status* st;
             {
               py::gil_scoped_release release;
               st = sg_model_save_lora_adapter(s.m, dir.c_str(), base.is_none() ? nullptr : b.c_str());
             }
             Check(st);
           })
      .def("load_lora_adapter",
           [](NativeModel& s, const std::string& dir) {
             CheckNoGradViews(s, "Model.load_lora_adapter", true);
             sg_status* st;
             {
               py::gil_scoped_release release;
               st = sg_model_load_lora_adapter(s.m, dir.c_str());
             }
             Check(st);
           })
      // (name, value array, grad array or None): arrays view the model's memory; their base keeps it alive.
      .def("param", [](py::object self_obj, int64_t i) {
        NativeModel& self = self_obj.cast<NativeModel&>();
        sg_param_info p = sg_param_info_init();
        Check(sg_model_param_info(self.m, i, &p));
        const int grad_dtype = sg_model_dtype(self.m);  // a bf16 parameter's gradient is f32
        if (p.on_device) {  // copies: device memory is not host-addressable
          py::object grad = py::none();
          if (p.grad) grad = HostCopy(self.m, i, p, SG_PARAM_GRAD, grad_dtype);
          return py::tuple(py::make_tuple(std::string(p.name), HostCopy(self.m, i, p, SG_PARAM_VALUE, p.dtype), grad));
        }
        py::array value = View(p, p.dtype, p.data, self_obj);
        py::object grad = py::none();
        if (p.grad) grad = View(p, grad_dtype, p.grad, GradViewBase(self_obj.cast<std::shared_ptr<NativeModel>>()));
        return py::tuple(py::make_tuple(std::string(p.name), value, grad));
      });

  py::class_<NativeTrainer, std::shared_ptr<NativeTrainer>>(mod, "Trainer")
      // options: a dict keyed by sg_trainer_options' field names (TRAINER_OPTIONS).
      .def(py::init([](NativeModel& model, const py::dict& options) {
             std::deque<std::string> strings;
             const sg_trainer_options o = TrainerOptions(options, &strings);
             auto self = std::make_shared<NativeTrainer>();
             self->callback = py::none();
             self->callback_error = py::none();
             Check(sg_trainer_create(model.m, &o, &self->t));
             Check(sg_trainer_set_progress_callback(self->t, ProgressTrampoline, self.get()));
             return self;
           }),
           py::arg("model"), py::arg("options"))
      // num_documents: None or int64 per sequence; doc_lengths: int64, their lengths sequence after sequence.
      .def("step", [](NativeTrainer& s, py::object ids, py::object labels, py::object lengths, py::object counts,
                      py::object docs) { return RunStep(s, ids, labels, lengths, counts, docs, kStep); })
      .def("compute_gradients",
           [](NativeTrainer& s, py::object ids, py::object labels, py::object lengths, py::object counts,
              py::object docs) { return RunStep(s, ids, labels, lengths, counts, docs, kGradients); })
      .def("evaluate", [](NativeTrainer& s, py::object ids, py::object labels, py::object lengths, py::object counts,
                          py::object docs) { return RunStep(s, ids, labels, lengths, counts, docs, kEvaluate); })
      .def("accumulate_gradients",
           [](NativeTrainer& s, py::object ids, py::object labels, py::object lengths, py::object counts,
              py::object docs) { return RunStep(s, ids, labels, lengths, counts, docs, kAccumulate); })
      .def("score", &Score)
      // distances: None or int64 aligned with ids (used where the label is valid); then the documents as above.
      .def("evaluate_detailed", &EvaluateDetailed)
      .def("save_checkpoint",
           [](NativeTrainer& s, const std::string& out_dir, int64_t data_position, int64_t keep) {
             CheckpointCall(s, [&](sg_trainer* t, int64_t*, int64_t*) {
               return sg_trainer_save_checkpoint(t, out_dir.c_str(), data_position, keep);
             });
           })
      .def("load_checkpoint",
           [](NativeTrainer& s, const std::string& dir) {
             return CheckpointCall(s, [&](sg_trainer* t, int64_t* step, int64_t* position) {
               return sg_trainer_load_checkpoint(t, dir.c_str(), step, position);
             });
           })
      .def("resume",
           [](NativeTrainer& s, const std::string& out_dir) {
             return CheckpointCall(s, [&](sg_trainer* t, int64_t* step, int64_t* position) {
               return sg_trainer_resume(t, out_dir.c_str(), step, position);
             });
           })
      // chosen/rejected ids: lists of int32 arrays; labels: lists of int32 arrays or None; ref: float64 arrays (NaN =
      // the reference model's).
      .def("dpo",
           [](NativeTrainer& s, const py::list& chosen_ids, const py::list& chosen_labels,
              const py::list& rejected_ids, const py::list& rejected_labels, py::object ref_chosen,
              py::object ref_rejected, int mode) {
             return RunDpo(s, chosen_ids, chosen_labels, rejected_ids, rejected_labels, ref_chosen, ref_rejected,
                           mode);
           })
      // mode: 0 = compute gradients, 1 = step, 3 = accumulate (Mode).
      // ids/labels as for dpo, one per completion; advantages float64; old/ref: lists of float64 arrays or None;
      // group_offsets int64 (num_groups + 1).
      .def("grpo",
           [](NativeTrainer& s, const py::list& ids, const py::list& labels, py::object advantages,
              const py::list& old_logprobs, const py::list& ref_logprobs, py::object group_offsets, int mode) {
             return RunGrpo(s, ids, labels, advantages, old_logprobs, ref_logprobs, group_offsets, mode);
           })
      .def("set_reference",
           [](NativeTrainer& s, py::object model) {
             sg_model* m = model.is_none() ? nullptr : model.cast<NativeModel&>().m;
             Check(sg_trainer_set_reference(s.get(), m));
           })
      .def("set_reference_base_model", [](NativeTrainer& s) { Check(sg_trainer_set_reference_base_model(s.get())); })
      .def("optimizer_step",
           [](NativeTrainer& s) {
             sg_trainer* t = s.get();
             return CallTrainer(s, [&](sg_metrics* m) { return sg_trainer_optimizer_step(t, m); });
           })
      .def("cancel", [](NativeTrainer& s) { sg_trainer_cancel(s.t); })  // NULL-safe; never blocks
      .def_property_readonly("step_count", [](NativeTrainer& s) { return sg_trainer_step_count(s.get()); })
      .def("set_callback", [](NativeTrainer& s, py::object cb) { s.callback = cb; })
      .def_property_readonly("closed", [](NativeTrainer& s) { return s.t == nullptr; })
      .def("close", [](NativeTrainer& s) {
        if (s.inflight.load() > 0) RaiseCode(SG_ERR_BUSY, "Trainer.close: a step is running in another thread");
        sg_trainer_free(s.t);
        s.t = nullptr;
        s.callback = py::none();
      });
}
