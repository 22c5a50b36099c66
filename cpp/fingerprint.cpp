// The fingerprint of a gradient's rows (zerofn/runtime/visible.py, ``fingerprint``): the
// sum mod 2^64 of one splitmix64 finalizer per element, over the element's bits plus its
// position times the golden ratio. Each term depends on a value and where it lies, so a
// sign flip, a permutation or a swap of rows changes the sum, unlike a sum of the bits;
// an edit goes unseen with a chance of about 2^-64. The Python twin (``_fingerprint_torch``,
// for a GPU's rows) computes the same number, which tests/test_grad_edits.py checks.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace py = pybind11;

namespace zerofn {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Elements of one width, read unsigned (zero-extended), positions counted from 1. Cloned
// for AVX-512 and AVX2 (the loop vectorises; the baseline build's SSE2 has no 64-bit
// multiply), the CPU choosing at load.
template <typename T>
__attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
uint64_t sum_of_terms(const T* bits, int64_t n) {
  uint64_t total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static) if (n > (1 << 18))
  for (int64_t i = 0; i < n; ++i) total += mix(uint64_t(bits[i]) + uint64_t(i + 1) * kGolden);
  return total;
}

uint64_t fingerprint(uintptr_t addr, int64_t n, int bytes) {
  if (n < 0) throw std::invalid_argument("fingerprint: a negative element count");
  if (n > 0 && (addr == 0 || addr % bytes != 0))
    throw std::invalid_argument("fingerprint: a null or misaligned address");
  py::gil_scoped_release nogil;
  switch (bytes) {
    case 2: return sum_of_terms(reinterpret_cast<const uint16_t*>(addr), n);
    case 4: return sum_of_terms(reinterpret_cast<const uint32_t*>(addr), n);
    case 8: return sum_of_terms(reinterpret_cast<const uint64_t*>(addr), n);
  }
  throw std::invalid_argument("fingerprint: elements of 2, 4 or 8 bytes only");
}

}  // namespace

void register_fingerprint(py::module_& m) {
  m.def("fingerprint", &fingerprint, py::arg("addr"), py::arg("numel"), py::arg("elem_bytes"),
        "Position-weighted hash of n contiguous elements of 2, 4 or 8 bytes (mod 2^64).");
}

}  // namespace zerofn
