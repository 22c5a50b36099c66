// Python bindings of the CPU Adam kernels. Buffers arrive as (address, numel, dtype)
// from zerofn/optim/kernels.py, which has already checked device, dtype, contiguity
// and sizes on the torch tensors; this file re-checks what could crash (null or
// misaligned addresses, unknown dtypes, nonsense hyperparameters) and releases the
// GIL while the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "kernels.h"

namespace py = pybind11;

namespace zerofn {
namespace {

int elem_bytes(int dtype) { return dtype == kF32 ? 4 : dtype == kU8 ? 1 : 2; }

void check_dtype(int dtype, bool allow_none, const char* what) {
  if (dtype == kF32 || dtype == kBF16 || dtype == kF16 || (allow_none && dtype == kNone))
    return;
  throw std::invalid_argument(std::string(what) + ": unknown dtype code " +
                              std::to_string(dtype));
}

void check_ptr(uintptr_t addr, int64_t n, int bytes, const char* what) {
  if (n > 0 && addr == 0) throw std::invalid_argument(std::string(what) + " is null");
  if (addr % bytes != 0)
    throw std::invalid_argument(std::string(what) + " is not aligned to its element size");
}

// Exactly torch's single-tensor Adam scalars: Python computes them in double and the
// tensor ops round each one to float.
AdamCoeffs derive_coeffs(int64_t step, double lr, double beta1, double beta2, double eps,
                         double wd, bool adamw, double grad_scale) {
  if (step < 1) throw std::invalid_argument("step must be >= 1 (it counts this update)");
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1))
    throw std::invalid_argument("betas must lie in [0, 1)");
  if (!(eps >= 0 && std::isfinite(lr) && std::isfinite(wd) && std::isfinite(grad_scale)))
    throw std::invalid_argument("lr, eps, weight_decay and grad_scale must be finite (eps >= 0)");
  AdamCoeffs c{};
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  c.grad_scale = float(grad_scale);
  c.decay = adamw ? float(1.0 - lr * wd) : 1.0f;
  c.use_l2 = !adamw && wd != 0.0;
  c.l2 = float(wd);
  const float w = float(1.0 - beta1);
  c.lerp_small = std::fabs(w) < 0.5f;
  c.lerp_w = c.lerp_small ? w : w - 1.0f;
  c.beta2 = float(beta2);
  c.one_minus_beta2 = float(1.0 - beta2);
  c.bc2_sqrt = float(std::pow(bc2, 0.5));
  c.eps = float(eps);
  c.neg_step_size = float(-(lr / bc1));
  return c;
}

// The stochastic-rounding stream keys of one call (zerofn/optim/lowp.py, stream_key):
// key = mix32(mix32(mix32(seed_lo) ^ seed_hi) ^ step_lo), then one key per stream.
void derive_keys(uint64_t seed, int64_t step, AdamCoeffs* c) {
  const uint32_t key = mix32(mix32(mix32(uint32_t(seed)) ^ uint32_t(seed >> 32)) ^ uint32_t(step));
  const uint32_t golden = 0x9E3779B9u;
  c->key_p = mix32(key ^ golden * 1u);
  c->key_m = mix32(key ^ golden * 2u);
}

void check_code(const float* code, const char* what);

uint32_t bits32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One sign's bucket of |x| in [lo, hi) ([Note: code search by table] in kernels.h):
// (midpoints below it << 16) | the low bits of the one inside (0xFFFF: none). A negative
// bucket is x in (-hi, -lo]; its low bits are complemented.
int32_t lut_entry(const float* mid, bool negative, float lo, float hi, bool first) {
  uint32_t below = 0, low = 0xFFFF;
  int inside = 0;
  for (int i = 0; i < 255; ++i) {
    const float m = mid[i];
    if (negative ? m <= -hi : m < lo) {
      ++below;
    } else if (negative ? m <= -lo : m < hi) {
      ++inside;
      low = negative ? 0xFFFF - (bits32(-m) & 0xFFFF) : bits32(m) & 0xFFFF;
    }
  }
  if (inside > (first ? 0 : 1))
    throw std::invalid_argument("the code's midpoints are too close (or too near 0) for its "
                                "search table: codes must lie 2^-7 of their size apart");
  return int32_t((below << 16) | low);
}

// The search table of a code: midpoints in fp32, as the reference computes them.
void build_lut(const float* code, int32_t* lut) {
  float mid[255];
  for (int i = 0; i < 255; ++i) mid[i] = (code[i] + code[i + 1]) / 2.0f;
  for (int sign = 0; sign < 2; ++sign)
    for (int t = 0; t < kLutSpan; ++t) {
      const uint32_t key = kLutLow + uint32_t(t);
      lut[sign * kLutSpan + t] = lut_entry(mid, sign, t == 0 ? 0.0f : float32(key << 16),
                                           float32((key + 1) << 16), t == 0);
    }
}

// The tables of each pair of codes seen, built once and kept (a run passes one pair;
// building takes longer than stepping a small parameter). Never changed once built, so
// kernels on other threads may read them while another pair is added.
const QuantTables& tables_for(const float* cs, const float* cu) {
  static std::mutex lock;
  static std::map<std::vector<float>, std::unique_ptr<QuantTables>> built;
  std::vector<float> key(cs, cs + 256);
  key.insert(key.end(), cu, cu + 256);
  std::lock_guard<std::mutex> hold(lock);
  auto& tables = built[key];
  if (!tables) {
    check_code(cs, "the signed code");
    check_code(cu, "the unsigned code");
    auto fresh = std::make_unique<QuantTables>();
    std::memcpy(fresh->code_m, cs, sizeof fresh->code_m);
    std::memcpy(fresh->code_v, cu, sizeof fresh->code_v);
    build_lut(cs, fresh->lut_m);
    build_lut(cu, fresh->lut_v);
    tables = std::move(fresh);
  }
  return *tables;
}

void check_code(const float* code, const char* what) {
  for (int i = 0; i < 255; ++i)
    if (!(code[i] < code[i + 1]))
      throw std::invalid_argument(std::string(what) + " must be strictly increasing");
}

struct AdamJob {
  const KernelTable* k;
  AdamBufs b;
  AdamCoeffs c;
};

void adam_piece(void* ctx, int64_t, int64_t b, int64_t e) {
  auto* j = static_cast<AdamJob*>(ctx);
  j->k->adam(j->b, b, e, j->c);
}

void adam_step(uintptr_t p, uintptr_t g, int g_dtype, uintptr_t m, uintptr_t v,
               uintptr_t out, int out_dtype, int64_t n, int64_t step, double lr,
               double beta1, double beta2, double eps, double wd, bool adamw,
               double grad_scale, int p_dtype, int state_dtype, uintptr_t m_scale,
               uintptr_t v_scale, uint64_t seed, uintptr_t code_signed,
               uintptr_t code_unsigned) {
  if (n < 0) throw std::invalid_argument("numel must be >= 0");
  check_dtype(g_dtype, false, "grads");
  check_dtype(out_dtype, true, "out");
  if (out_dtype == kF32) throw std::invalid_argument("out must be bf16 or fp16");
  if ((out_dtype == kNone) != (out == 0))
    throw std::invalid_argument("out address and out dtype must be given together");
  if (p_dtype != kF32 && p_dtype != kBF16)
    throw std::invalid_argument("params must be fp32 or bf16");
  if (state_dtype != kF32 && state_dtype != kBF16 && state_dtype != kU8)
    throw std::invalid_argument("exp_avg/exp_avg_sq must be fp32, bf16 or uint8 codes");
  check_ptr(p, n, elem_bytes(p_dtype), "params");
  check_ptr(g, n, elem_bytes(g_dtype), "grads");
  check_ptr(m, n, elem_bytes(state_dtype), "exp_avg");
  check_ptr(v, n, elem_bytes(state_dtype), "exp_avg_sq");
  if (out) check_ptr(out, n, 2, "out");
  const QuantTables* q = nullptr;
  if (state_dtype == kU8) {
    const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
    check_ptr(m_scale, blocks, 4, "exp_avg_scale");
    check_ptr(v_scale, blocks, 4, "exp_avg_sq_scale");
    if (code_signed == 0 || code_unsigned == 0)
      throw std::invalid_argument("8-bit state needs both code tables");
    q = &tables_for(reinterpret_cast<const float*>(code_signed),
                    reinterpret_cast<const float*>(code_unsigned));
  }
  AdamJob job{&active_kernels(),
              AdamBufs{reinterpret_cast<void*>(p), reinterpret_cast<const void*>(g),
                       reinterpret_cast<void*>(m), reinterpret_cast<void*>(v),
                       reinterpret_cast<float*>(m_scale), reinterpret_cast<float*>(v_scale),
                       out ? reinterpret_cast<void*>(out) : nullptr, p_dtype, g_dtype,
                       state_dtype, out_dtype, q},
              derive_coeffs(step, lr, beta1, beta2, eps, wd, adamw, grad_scale)};
  derive_keys(seed, step, &job.c);
  py::gil_scoped_release nogil;
  parallel_ranges(n, adam_piece, &job);
}

struct SumsqJob {
  const KernelTable* k;
  const char* g;
  int g_dtype;
  std::vector<double> sums;
  std::vector<char> finite;
};

void sumsq_piece(void* ctx, int64_t piece, int64_t b, int64_t e) {
  auto* j = static_cast<SumsqJob*>(ctx);
  bool ok = true;
  j->k->sumsq(j->g + b * elem_bytes(j->g_dtype), j->g_dtype, e - b, &j->sums[piece], &ok);
  j->finite[piece] = ok;
}

py::tuple grad_sumsq_and_finite(uintptr_t g, int g_dtype, int64_t n) {
  if (n < 0) throw std::invalid_argument("numel must be >= 0");
  check_dtype(g_dtype, false, "grads");
  check_ptr(g, n, elem_bytes(g_dtype), "grads");
  const int64_t pieces = split_for(n).pieces;
  SumsqJob job{&active_kernels(), reinterpret_cast<const char*>(g), g_dtype,
               std::vector<double>(pieces, 0.0), std::vector<char>(pieces, 1)};
  {
    py::gil_scoped_release nogil;
    parallel_ranges(n, sumsq_piece, &job);
  }
  double total = 0.0;  // fixed order: the result does not depend on thread timing
  bool finite = true;
  for (int64_t i = 0; i < pieces; ++i) {
    total += job.sums[i];
    finite = finite && job.finite[i];
  }
  return py::make_tuple(total, finite);
}

struct RoofJob {
  const KernelTable* k;
  float *p, *g, *m, *v;
};

void roof_piece(void* ctx, int64_t, int64_t b, int64_t e) {
  auto* j = static_cast<RoofJob*>(ctx);
  j->k->roofline(j->p + b, j->g + b, j->m + b, j->v + b, e - b);
}

void adam_roofline(uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, int64_t n) {
  if (n < 0) throw std::invalid_argument("numel must be >= 0");
  for (uintptr_t a : {p, g, m, v}) check_ptr(a, n, 4, "buffer");
  RoofJob job{&active_kernels(), reinterpret_cast<float*>(p), reinterpret_cast<float*>(g),
              reinterpret_cast<float*>(m), reinterpret_cast<float*>(v)};
  py::gil_scoped_release nogil;
  parallel_ranges(n, roof_piece, &job);
}

}  // namespace

void register_adam(py::module_& m) {
  m.attr("DTYPE_F32") = int(kF32);
  m.attr("DTYPE_BF16") = int(kBF16);
  m.attr("DTYPE_F16") = int(kF16);
  m.attr("DTYPE_U8") = int(kU8);
  m.attr("DTYPE_NONE") = int(kNone);
  m.attr("QUANT_BLOCK") = kQuantBlock;
  m.def("adam_step", &adam_step, "Fused unscale + Adam/AdamW + optional low-precision copy.",
        py::arg("params"), py::arg("grads"), py::arg("grad_dtype"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("out"), py::arg("out_dtype"), py::arg("numel"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("grad_scale"),
        py::arg("param_dtype") = int(kF32), py::arg("state_dtype") = int(kF32),
        py::arg("exp_avg_scale") = 0, py::arg("exp_avg_sq_scale") = 0, py::arg("seed") = 0,
        py::arg("code_signed") = 0, py::arg("code_unsigned") = 0);
  m.def("grad_sumsq_and_finite", &grad_sumsq_and_finite,
        "(sum of squares in double, all finite) of a gradient buffer, in one pass.",
        py::arg("grads"), py::arg("grad_dtype"), py::arg("numel"));
  m.def("adam_roofline", &adam_roofline,
        "Adam's memory traffic (read p, g, m, v; write p, m, v) with trivial arithmetic.",
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("numel"));
  m.def("isa", []() { return std::string(active_kernels().name); },
        "The instruction set the kernels run with.");
  m.def("set_isa", &set_isa, "Force 'avx512', 'avx2' or 'generic' (tests, benchmarks).",
        py::arg("name"));
  m.def("available_isas", &available_isas, "ISAs this CPU and build can run, best first.");
  m.def("max_threads", &max_threads, "OpenMP threads a kernel call may use.");
}

}  // namespace zerofn
