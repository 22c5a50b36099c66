// The portable build of the kernels: one float per "register", plain C++ that the
// compiler may auto-vectorise (NEON on aarch64). On x86-64 it is the slow path for
// CPUs without AVX2, and the Python side warns when it is chosen there.
#include <cstdint>

#include "kernels.h"

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t load_u16(const uint16_t* x) {
  uint16_t h;  // byte copy: the tail scratch buffers are float arrays
  __builtin_memcpy(&h, x, 2);
  return h;
}

// IEEE half -> float, exact for every input (subnormals scaled by 2^-24).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) return float_of(sign | bits_of(float(mant) * 5.9604644775390625e-8f));
  if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

// float -> IEEE half, round to nearest even like F16C's vcvtps2ph. Subnormal results
// come from a float addition whose rounding does the work; NaN becomes quiet 0x7E00.
inline uint16_t float_to_half(float f) {
  uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000;
  u &= 0x7FFFFFFFu;
  if (u >= (143u << 23)) return sign | (u > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (u < (113u << 23)) {
    const uint32_t magic = 126u << 23;  // 0.5: aligns the half subnormal ulp to bit 0
    return sign | uint16_t(bits_of(float_of(u) + float_of(magic)) - magic);
  }
  const uint32_t odd = (u >> 13) & 1;
  return sign | uint16_t((u + ((15u - 127u) << 23) + 0xFFF + odd) >> 13);
}

// The top half of bits(f) + add (see the AVX-512 version); NaN becomes quiet.
inline uint16_t bf16_round_bits(float f, uint32_t add) {
  const uint32_t u = bits_of(f);
  if (f != f) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + add) >> 16);
}

struct V {
  static constexpr int W = 1;
  using reg = float;
  static reg load(const float* x) { return *x; }
  static void store(float* x, reg a) { *x = a; }
  static reg set1(float a) { return a; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg sqrt(reg a) { return __builtin_sqrtf(a); }
  // Correctly rounded everywhere (libm's fmaf is exact without FMA hardware too), so
  // this path gives the same bits as the vector ones.
  static reg fma(reg a, reg b, reg c) { return __builtin_fmaf(a, b, c); }
  static reg load_bf16(const uint16_t* x) { return float_of(uint32_t(load_u16(x)) << 16); }
  static reg load_f16(const uint16_t* x) { return half_to_float(load_u16(x)); }
  using half = uint16_t;
  using ireg = uint32_t;
  static half bf16_round(reg a, ireg add) { return bf16_round_bits(a, add); }
  static half bf16_bits(reg a) { return bf16_round_bits(a, 0x7FFF + ((bits_of(a) >> 16) & 1)); }
  static reg from_bf16(half h) { return float_of(uint32_t(h) << 16); }
  static half f16_bits(reg a) { return float_to_half(a); }
  template <bool STREAM>
  static void store_half(uint16_t* x, half h) { *x = h; }
  static void store_fence() {}

  static ireg iset1(uint32_t a) { return a; }
  static ireg iota() { return 0; }
  static ireg iadd(ireg a, ireg b) { return a + b; }
  static ireg ixor(ireg a, ireg b) { return a ^ b; }
  static ireg iand(ireg a, ireg b) { return a & b; }
  static ireg imul(ireg a, ireg b) { return a * b; }
  template <int K>
  static ireg isrl(ireg a) { return a >> K; }
  template <int K>
  static ireg isra(ireg a) { return uint32_t(int32_t(a) >> K); }  // arithmetic in GCC/clang
  static ireg ibits(reg a) { return bits_of(a); }
  static ireg isub(ireg a, ireg b) { return a - b; }
  static ireg imax0(ireg a) { return int32_t(a) > 0 ? a : 0; }
  static ireg imin(ireg a, ireg b) { return int32_t(a) < int32_t(b) ? a : b; }
  static ireg ilt_i(ireg a, ireg b) { return int32_t(a) < int32_t(b) ? 1 : 0; }
  static ireg gather(const int32_t* t, ireg j) { return uint32_t(t[j]); }
  static ireg load_u8(const uint8_t* x) { return *x; }
  static void store_u8(uint8_t* x, ireg a) { *x = uint8_t(a); }
  template <int N>
  static reg lookup(const float* t, ireg j) { return t[j]; }
  static reg abs(reg a) { return float_of(bits_of(a) & 0x7FFFFFFFu); }
  static reg max(reg a, reg b) { return a > b ? a : b; }  // b when either is NaN, like maxps
  static float hmax(reg a) { return a; }

  struct Dacc { double s; };
  static Dacc dacc_zero() { return {0.0}; }
  static Dacc dacc_add_sq(Dacc d, reg a) { return {d.s + double(a) * double(a)}; }
  static double dacc_sum(Dacc d) { return d.s; }
};

}  // namespace

#include "kernel_body.h"

namespace zerofn {
const KernelTable* generic_table() {
  static const KernelTable table{"generic", V::W, adam_kernel, sumsq_kernel, roofline_kernel};
  return &table;
}
}  // namespace zerofn
