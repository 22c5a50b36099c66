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
  using ireg = __m512i;  // W uint32 values
  // The top half of bits(a) + add: add = lsb + 0x7FFF rounds to nearest even, like
  // c10::BFloat16; 16 random bits round stochastically. A NaN keeps its sign and top
  // payload bits with the quiet bit set (rounding could turn it into an inf).
  static half bf16_round(reg a, ireg add) {
    __m512i u = _mm512_castps_si512(a);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, add), 16);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), q);
    return _mm512_cvtepi32_epi16(r);
  }
  static half bf16_bits(reg a) {
    __m512i u = _mm512_castps_si512(a);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return bf16_round(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  }
  static reg from_bf16(half h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

  static ireg iset1(uint32_t a) { return _mm512_set1_epi32(int(a)); }
  static ireg iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static ireg iadd(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
  static ireg ixor(ireg a, ireg b) { return _mm512_xor_si512(a, b); }
  static ireg iand(ireg a, ireg b) { return _mm512_and_si512(a, b); }
  static ireg imul(ireg a, ireg b) { return _mm512_mullo_epi32(a, b); }
  template <int K>
  static ireg isrl(ireg a) { return _mm512_srli_epi32(a, K); }
  template <int K>
  static ireg isra(ireg a) { return _mm512_srai_epi32(a, K); }
  static ireg ibits(reg a) { return _mm512_castps_si512(a); }
  static ireg isub(ireg a, ireg b) { return _mm512_sub_epi32(a, b); }
  static ireg imax0(ireg a) { return _mm512_max_epi32(a, _mm512_setzero_si512()); }
  static ireg imin(ireg a, ireg b) { return _mm512_min_epi32(a, b); }
  static ireg ilt_i(ireg a, ireg b) {
    return _mm512_maskz_mov_epi32(_mm512_cmplt_epi32_mask(a, b), _mm512_set1_epi32(1));
  }
  static ireg gather(const int32_t* t, ireg j) { return _mm512_i32gather_epi32(j, t, 4); }
  static ireg load_u8(const uint8_t* x) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
  static void store_u8(uint8_t* x, ireg a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm512_cvtepi32_epi8(a));
  }
  // table[j]: up to 16 entries one in-register permute, 32 a two-register permute, 64
  // to 256 two, four or eight of those blended on the higher index bits. That is faster
  // than a gather even at 256 entries (8 permutes + 7 blends: 8-bit decoding went from
  // 2.0 to 1.56 ns an element). (Tables are read 16 floats at a time; callers keep them
  // readable that far.)
  template <int N>
  static reg lookup(const float* t, ireg j) {
    if constexpr (N <= 16) {
      return _mm512_permutexvar_ps(j, _mm512_loadu_ps(t));
    } else if constexpr (N == 32) {
      return _mm512_permutex2var_ps(_mm512_loadu_ps(t), j, _mm512_loadu_ps(t + 16));
    } else {
      static_assert(N == 64 || N == 128 || N == 256, "lookup<N>: N up to 256");
      reg lo = lookup<N / 2>(t, j), hi = lookup<N / 2>(t + N / 2, j);
      return _mm512_mask_blend_ps(_mm512_test_epi32_mask(j, _mm512_set1_epi32(N / 2)), lo, hi);
    }
  }
  static reg abs(reg a) { return _mm512_abs_ps(a); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float hmax(reg a) { return _mm512_reduce_max_ps(a); }

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
