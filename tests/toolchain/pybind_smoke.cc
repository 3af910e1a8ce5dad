// Tiny pybind11 module: built as cc_binary(name = "sg_toolchain_py.so", linkshared = 1).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace {

int Add(int a, int b) { return a + b; }

// In place: .noconvert() makes a mismatched dtype an error instead of a silent copy.
void ScaleInPlace(py::array_t<float, py::array::c_style> x, float s) {
  auto v = x.mutable_unchecked<1>();
  for (py::ssize_t i = 0; i < v.shape(0); ++i) v(i) *= s;
}

}  // namespace

PYBIND11_MODULE(sg_toolchain_py, m) {
  m.doc() = "seqgrad toolchain smoke module";
  m.def("add", &Add, py::arg("a"), py::arg("b"));
  m.def("scale_in_place", &ScaleInPlace, py::arg("x").noconvert(), py::arg("s"));
}
