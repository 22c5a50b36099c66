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
// kU8: 8-bit blockwise codes (moments only), with an fp32 scale per kQuantBlock elements.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kU8 = 3, kNone = -1 };

// Elements per 8-bit block, counted from the start of the whole buffer (not of a
// thread's piece: dispatch.cpp starts every piece on a block boundary).
constexpr int64_t kQuantBlock = 256;

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
  // Stochastic-rounding keys of the params and moments streams: element i of a buffer
  // rounds with 16 bits of mix32(i + key), exp_avg the low half of the moments' word
  // and exp_avg_sq the high half (zerofn/optim/lowp.py).
  uint32_t key_p, key_m;
};

// lowbias32: the counter hash of the stochastic rounding, here for deriving the keys.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// [Note: code search by table] The nearest code of a normalized value x (|x| <= 1) is
// the number of midpoints below it. A table answers that in one lookup and one compare:
// x's bucket is the top 16 bits of |x| (sign cleared; every |x| below 2^-23 shares the
// first bucket), and no bucket holds two midpoints (buckets are 2^-7 of their binade
// wide, the codes at least 0.7 % apart), so per bucket the table keeps how many
// midpoints lie below it and the low 16 bits of the one inside it, if any. Negative
// values have their own half, with those low bits complemented, so that one unsigned
// compare decides for either sign. Built once per code (adam_bindings.cpp).
constexpr uint32_t kLutLow = (127 - 23) << 7;     // the top 16 bits of 2^-23
constexpr int kLutSpan = 0x3F80 - kLutLow + 1;    // buckets up to that of 1.0, per sign
struct QuantTables {
  float code_m[256], code_v[256];
  int32_t lut_m[2 * kLutSpan], lut_v[2 * kLutSpan];   // (below << 16) | low bits inside
};

// One buffer set of adam_step, as the bindings received it (whole buffers).
struct AdamBufs {
  void* p;             // kF32 or kBF16 (bf16 masters round stochastically)
  const void* g;       // kF32, kBF16 or kF16
  void *m, *v;         // both kF32, both kBF16 or both kU8
  float *m_scale, *v_scale;  // kU8: one per kQuantBlock elements
  void* out;           // kBF16, kF16 or nullptr (kNone)
  int p_dtype, g_dtype, state_dtype, out_dtype;
  const QuantTables* q;  // kU8 only
};

// Serial Adam over elements [begin, end) of the buffers (begin is a multiple of
// kQuantBlock when the state is 8-bit); the index also counts for stochastic rounding.
using AdamFn = void (*)(const AdamBufs& b, int64_t begin, int64_t end, const AdamCoeffs& c);
// Other kernels: serial over [0, n) of already-offset pointers.
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
