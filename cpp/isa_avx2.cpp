// The AVX2 + FMA + F16C build of the kernels (8 floats per register): every x86-64
// CPU since about 2013 that lacks AVX-512.
#include "kernels.h"

#if defined(ZEROFN_X86_KERNELS)
#include <immintrin.h>

#include <cstdint>

// Everything below is compiled for AVX2; standard headers stay above (kernel_body.h).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

struct V {
  static constexpr int W = 8;
  using reg = __m256;
  static reg load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, reg a) { _mm256_storeu_ps(x, a); }
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }

  static reg load_bf16(const uint16_t* x) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static reg load_f16(const uint16_t* x) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
  using half = __m128i;  // W 16-bit values
  // Same rounding and NaN rule as the AVX-512 and generic versions.
  static half bf16_bits(reg a) {
    __m256i u = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, q, nan);
    // packus works per 128-bit lane; the permute brings both halves into the low lane.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static half f16_bits(reg a) {
    return _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  template <bool STREAM>
  static void store_half(uint16_t* x, half h) {
    if constexpr (STREAM) _mm_stream_si128(reinterpret_cast<__m128i*>(x), h);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(x), h);
  }
  static void store_fence() { _mm_sfence(); }

  struct Dacc { __m256d lo, hi; };
  static Dacc dacc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static Dacc dacc_add_sq(Dacc d, reg a) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    return {_mm256_fmadd_pd(lo, lo, d.lo), _mm256_fmadd_pd(hi, hi, d.hi)};
  }
  static double dacc_sum(Dacc d) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(d.lo, d.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
};

}  // namespace

#include "kernel_body.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace zerofn {
const KernelTable* avx2_table() {
  static const KernelTable table{"avx2", V::W, adam_kernel, sumsq_kernel, roofline_kernel};
  return &table;
}
}  // namespace zerofn

#else
namespace zerofn {
const KernelTable* avx2_table() { return nullptr; }
}  // namespace zerofn
#endif
