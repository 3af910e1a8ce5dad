// seqgrad._native: a thin pybind11 layer over the C ABI (seqgrad/seqgrad.h) only — never over core C++.
// Statuses become exceptions built by seqgrad._errors.from_status(code, message); the GIL is released while a
// trainer computes. Parameter/gradient arrays share memory with the model and keep its native handle alive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <string>

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

py::dtype NumpyDType(int dt) {
  switch (dt) {
    case SG_DTYPE_F32: return py::dtype::of<float>();
    case SG_DTYPE_F64: return py::dtype::of<double>();
    case SG_DTYPE_I32: return py::dtype::of<int32_t>();
    case SG_DTYPE_I64: return py::dtype::of<int64_t>();
    case SG_DTYPE_F16: return py::dtype("float16");
    case SG_DTYPE_BF16: return py::dtype("uint16");  // raw bf16 bits
  }
  throw py::value_error("unknown dtype");
}

// Owns one sg_model reference. Python arrays viewing its memory hold a reference to this object.
struct NativeModel {
  sg_model* m = nullptr;
  explicit NativeModel(sg_model* m) : m(m) {}
  ~NativeModel() { sg_model_free(m); }
};

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
  d["peak_bytes_by_category"] = peak;
  d["bytes_at_peak_by_category"] = at_peak;
  d["seconds"] = m.seconds;
  d["chunks"] = m.chunks;
  d["chunks_backpropagated"] = m.chunks_backpropagated;
  return d;
}

using IdArray = py::array_t<int32_t, py::array::c_style>;
using LenArray = py::array_t<int64_t, py::array::c_style>;

// ids, labels (or None), lengths: already int32/int32/int64 C-contiguous (the Python layer converts).
py::dict RunStep(NativeTrainer& self, py::array ids_obj, py::object labels_obj, py::array lengths_obj,
                 bool optimizer) {
  sg_trainer* t = self.get();
  IdArray ids = py::cast<IdArray>(ids_obj);
  LenArray lengths = py::cast<LenArray>(lengths_obj);
  IdArray labels;
  const int32_t* labels_ptr = nullptr;
  if (!labels_obj.is_none()) {
    labels = py::cast<IdArray>(labels_obj);
    if (labels.size() != ids.size())
      RaiseCode(SG_ERR_INVALID_ARGUMENT, "labels has " + std::to_string(labels.size()) + " tokens but ids has " +
                                             std::to_string(ids.size()));
    labels_ptr = labels.data();
  }
  sg_metrics m = sg_metrics_init();
  sg_status* st;
  self.callback_error = py::none();
  self.inflight.fetch_add(1);
  {
    py::gil_scoped_release release;
    st = optimizer ? sg_trainer_step(t, ids.data(), labels_ptr, ids.size(), lengths.data(), lengths.size(), &m)
                   : sg_trainer_compute_gradients(t, ids.data(), labels_ptr, ids.size(), lengths.data(),
                                                  lengths.size(), &m);
  }
  self.inflight.fetch_sub(1);
  if (!self.callback_error.is_none()) {
    sg_status_free(st);
    py::object e = self.callback_error;
    self.callback_error = py::none();
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
    throw py::error_already_set();
  }
  Check(st);
  return MetricsDict(m);
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
    for (int c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c) l.append(sg_memory_category_name(c));
    return l;
  });
  mod.def("preset_names", [] {
    py::list l;
    for (const char* const* p = sg_model_preset_names(); *p; ++p) l.append(*p);
    return l;
  });

  py::class_<NativeModel, std::shared_ptr<NativeModel>>(mod, "Model")
      .def_static("create_preset",
                  [](const std::string& name, const std::string& dtype, uint64_t seed) {
                    sg_model* m = nullptr;
                    sg_status* st;
                    {
                      py::gil_scoped_release release;
                      st = sg_model_create_preset(name.c_str(), dtype.c_str(), seed, &m);
                    }
                    Check(st);
                    return std::make_shared<NativeModel>(m);
                  })
      .def_static("load",
                  [](const std::string& dir, const std::string& dtype) {
                    sg_model* m = nullptr;
                    sg_status* st;
                    {
                      py::gil_scoped_release release;
                      st = sg_model_load(dir.c_str(), dtype.c_str(), &m);
                    }
                    Check(st);
                    return std::make_shared<NativeModel>(m);
                  })
      .def("save",
           [](NativeModel& self, const std::string& dir) {
             sg_status* st;
             {
               py::gil_scoped_release release;
               st = sg_model_save(self.m, dir.c_str());
             }
             Check(st);
           })
      .def_property_readonly("vocab_size", [](NativeModel& s) { return sg_model_vocab_size(s.m); })
      .def_property_readonly("num_layers", [](NativeModel& s) { return sg_model_num_layers(s.m); })
      .def_property_readonly("hidden_size", [](NativeModel& s) { return sg_model_hidden_size(s.m); })
      .def_property_readonly("num_params", [](NativeModel& s) { return sg_model_num_params(s.m); })
      .def_property_readonly("family", [](NativeModel& s) { return std::string(sg_model_family(s.m)); })
      .def_property_readonly("dtype", [](NativeModel& s) { return std::string(sg_dtype_name(sg_model_dtype(s.m))); })
      // (name, value array, grad array or None): arrays view the model's memory; their base keeps it alive.
      .def("param", [](py::object self_obj, int64_t i) {
        NativeModel& self = self_obj.cast<NativeModel&>();
        sg_param_info p = sg_param_info_init();
        Check(sg_model_param_info(self.m, i, &p));
        std::vector<py::ssize_t> shape(p.shape, p.shape + p.ndim);
        py::dtype dt = NumpyDType(p.dtype);
        py::array value(dt, shape, {}, p.data, self_obj);
        py::object grad = py::none();
        if (p.grad) grad = py::array(dt, shape, {}, p.grad, self_obj);
        return py::make_tuple(std::string(p.name), value, grad);
      });

  py::class_<NativeTrainer, std::shared_ptr<NativeTrainer>>(mod, "Trainer")
      .def(py::init([](NativeModel& model, const std::string& strategy, int64_t chunk, int64_t page_size,
                       int64_t lm_chunk, double lr, double beta1, double beta2, double eps, double weight_decay,
                       double clip_grad_norm, int64_t spaco_budget, double spaco_cap, uint64_t seed) {
             sg_trainer_options o = sg_trainer_default_options();
             o.strategy = strategy.c_str();
             o.chunk = chunk;
             o.page_size = page_size;
             o.lm_chunk = lm_chunk;
             o.lr = lr;
             o.beta1 = beta1;
             o.beta2 = beta2;
             o.eps = eps;
             o.weight_decay = weight_decay;
             o.clip_grad_norm = clip_grad_norm;
             o.spaco_budget = spaco_budget;
             o.spaco_cap = spaco_cap;
             o.seed = seed;
             auto self = std::make_shared<NativeTrainer>();
             self->callback = py::none();
             self->callback_error = py::none();
             Check(sg_trainer_create(model.m, &o, &self->t));
             Check(sg_trainer_set_progress_callback(self->t, ProgressTrampoline, self.get()));
             return self;
           }),
           py::arg("model"), py::arg("strategy"), py::arg("chunk"), py::arg("page_size"), py::arg("lm_chunk"),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("clip_grad_norm"), py::arg("spaco_budget"), py::arg("spaco_cap"), py::arg("seed"))
      .def("step", [](NativeTrainer& s, py::array ids, py::object labels,
                      py::array lengths) { return RunStep(s, ids, labels, lengths, true); })
      .def("compute_gradients", [](NativeTrainer& s, py::array ids, py::object labels,
                                   py::array lengths) { return RunStep(s, ids, labels, lengths, false); })
      .def("optimizer_step",
           [](NativeTrainer& s) {
             sg_trainer* t = s.get();
             sg_metrics m = sg_metrics_init();
             sg_status* st;
             s.inflight.fetch_add(1);
             {
               py::gil_scoped_release release;
               st = sg_trainer_optimizer_step(t, &m);
             }
             s.inflight.fetch_sub(1);
             Check(st);
             return MetricsDict(m);
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
