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
  using ireg = __m256i;  // W uint32 values
  // Same rounding and NaN rule as the AVX-512 and generic versions.
  static half bf16_round(reg a, ireg add) {
    __m256i u = _mm256_castps_si256(a);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, add), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, q, nan);
    // packus works per 128-bit lane; the permute brings both halves into the low lane.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static half bf16_bits(reg a) {
    __m256i u = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return bf16_round(a, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  }
  static reg from_bf16(half h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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

  static ireg iset1(uint32_t a) { return _mm256_set1_epi32(int(a)); }
  static ireg iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static ireg iadd(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  static ireg ixor(ireg a, ireg b) { return _mm256_xor_si256(a, b); }
  static ireg iand(ireg a, ireg b) { return _mm256_and_si256(a, b); }
  static ireg imul(ireg a, ireg b) { return _mm256_mullo_epi32(a, b); }
  template <int K>
  static ireg isrl(ireg a) { return _mm256_srli_epi32(a, K); }
  template <int K>
  static ireg isra(ireg a) { return _mm256_srai_epi32(a, K); }
  static ireg ibits(reg a) { return _mm256_castps_si256(a); }
  static ireg isub(ireg a, ireg b) { return _mm256_sub_epi32(a, b); }
  static ireg imax0(ireg a) { return _mm256_max_epi32(a, _mm256_setzero_si256()); }
  static ireg imin(ireg a, ireg b) { return _mm256_min_epi32(a, b); }
  static ireg ilt_i(ireg a, ireg b) { return _mm256_srli_epi32(_mm256_cmpgt_epi32(b, a), 31); }
  static ireg gather(const int32_t* t, ireg j) { return _mm256_i32gather_epi32(t, j, 4); }
  static ireg load_u8(const uint8_t* x) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  }
  static void store_u8(uint8_t* x, ireg a) {
    __m128i w = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(a, a), 0x08));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(x), _mm_packus_epi16(w, w));
  }
  // table[j]: up to 8 entries one in-register permute, more a gather. (Tables are
  // read 8 floats at a time; callers keep them readable that far.)
  template <int N>
  static reg lookup(const float* t, ireg j) {
    if constexpr (N <= 8) return _mm256_permutevar8x32_ps(_mm256_loadu_ps(t), j);
    else return _mm256_i32gather_ps(t, j, 4);
  }
  static reg abs(reg a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float hmax(reg a) {
    float lanes[8];
    _mm256_storeu_ps(lanes, a);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
  }

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
