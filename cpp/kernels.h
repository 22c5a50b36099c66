// Interface between the per-ISA kernel files and the dispatcher/bindings.
//
// Each ISA file (isa_avx512.cpp, isa_avx2.cpp, isa_generic.cpp) compiles the same
// templated bodies (kernel_body.h) for its vector width and exposes them through a
// KernelTable. Kernels here are serial over one contiguous range: threading lives in
// dispatch.cpp so that every ISA shares one partitioning scheme.
#pragma once

#include <cstdint>

// The AVX2 and AVX-512 kernels are compiled on x86-64 with GCC or clang. Defining
// ZEROFN_PORTABLE_ONLY builds only the generic ones, as on aarch64 (and lets an x86 host
// check that configuration).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ZEROFN_PORTABLE_ONLY)
#define ZEROFN_X86_KERNELS 1
#endif

namespace zerofn {

// Element types a buffer may hold. Values are part of the Python ABI (_C.DTYPE_*).
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = -1 };

// Per-step scalars in the exact fp32 form torch's single-tensor Adam applies them
// (each derived in double, then rounded to float once), see derive_coeffs().
struct AdamCoeffs {
  float grad_scale;   // unscale x clip factor, applied to the gradient first
  float decay;        // 1 - lr*wd for AdamW, 1 otherwise (p*1 is exact)
  float l2;           // wd for Adam's L2 mode: g += wd*p
  float lerp_w;       // torch lerp weight for exp_avg: 1 - beta1 (or that - 1, see below)
  bool lerp_small;    // torch picks the lerp formula by |weight| < 0.5
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;     // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool use_l2;
};

// Serial kernels over [0, n) of already-offset pointers.
using AdamFn = void (*)(float* p, const void* g, int g_dtype, float* m, float* v,
                        void* out, int out_dtype, int64_t n, const AdamCoeffs& c);
// Accumulates the sum of squares (in double) and whether every element was finite.
using SumsqFn = void (*)(const void* g, int g_dtype, int64_t n, double* sumsq,
                         bool* finite);
// Adam's memory traffic with trivial arithmetic: the speed-of-light yardstick.
using RooflineFn = void (*)(float* p, const float* g, float* m, float* v, int64_t n);

struct KernelTable {
  const char* name;
  int width;  // floats per vector register
  AdamFn adam;
  SumsqFn sumsq;
  RooflineFn roofline;
};

// nullptr where the ISA is not compiled into this build (e.g. AVX on aarch64).
const KernelTable* avx512_table();
const KernelTable* avx2_table();
const KernelTable* generic_table();

}  // namespace zerofn
