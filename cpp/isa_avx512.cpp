// The AVX-512F build of the kernels (16 floats per register), used when the CPU and
// OS support it. Only AVX512F instructions are used, so every AVX-512 CPU qualifies.
#include "kernels.h"

#if defined(ZEROFN_X86_KERNELS)
#include <immintrin.h>

#include <cstdint>

// Everything below is compiled for AVX-512; standard headers stay above (kernel_body.h).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif

namespace {

struct V {
  static constexpr int W = 16;
  using reg = __m512;
  static reg load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* x, reg a) { _mm512_storeu_ps(x, a); }
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }

  static reg load_bf16(const uint16_t* x) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* x) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
  using half = __m256i;  // W 16-bit values
  // Round to nearest even on the bit pattern, like c10::BFloat16; a NaN keeps its sign
  // and top payload bits with the quiet bit set (rounding could turn it into an inf).
  static half bf16_bits(reg a) {
    __m512i u = _mm512_castps_si512(a);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), q);
    return _mm512_cvtepi32_epi16(r);
  }
  static half f16_bits(reg a) {
    return _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  template <bool STREAM>
  static void store_half(uint16_t* x, half h) {
    if constexpr (STREAM) _mm256_stream_si256(reinterpret_cast<__m256i*>(x), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), h);
  }
  static void store_fence() { _mm_sfence(); }

  struct Dacc { __m512d lo, hi; };
  static Dacc dacc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static Dacc dacc_add_sq(Dacc d, reg a) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
    __m512d hi = _mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    return {_mm512_fmadd_pd(lo, lo, d.lo), _mm512_fmadd_pd(hi, hi, d.hi)};
  }
  static double dacc_sum(Dacc d) { return _mm512_reduce_add_pd(_mm512_add_pd(d.lo, d.hi)); }
};

}  // namespace

#include "kernel_body.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace zerofn {
const KernelTable* avx512_table() {
  static const KernelTable table{"avx512", V::W, adam_kernel, sumsq_kernel, roofline_kernel};
  return &table;
}
}  // namespace zerofn

#else
namespace zerofn {
const KernelTable* avx512_table() { return nullptr; }
}  // namespace zerofn
#endif
