// Entry point of zerofn._C: each source file registers its functions here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace zerofn {
void register_adam(py::module_& m);         // adam_bindings.cpp
void register_fingerprint(py::module_& m);  // fingerprint.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "zerofn native kernels (CPU Adam, fused gradient passes, gradient fingerprints)";
  m.def("build_info", []() {
    py::dict info;
#if defined(_OPENMP)
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
#if defined(__x86_64__)
    info["arch"] = "x86_64";
#elif defined(__aarch64__)
    info["arch"] = "aarch64";
#else
    info["arch"] = "other";
#endif
    return info;
  }, "How this build of zerofn._C was compiled.");
  zerofn::register_adam(m);
  zerofn::register_fingerprint(m);
}
