// Kernel bodies shared by every ISA, written once over a vector type `V`.
//
// Included by an isa_*.cpp file after it has (1) included every standard header it
// needs, (2) switched the target ISA with a pragma and (3) defined `V`. This header
// includes nothing itself: an inline standard-library function instantiated here would
// be compiled for the including file's ISA, and the linker could hand that AVX-512 copy
// to generic callers on a CPU without AVX-512.
//
// V provides: W (lanes), reg, load/store (f32), load_bf16/load_f16, half (W 16-bit
// values), bf16_bits/f16_bits (round to nearest even), store_half<STREAM>, store_fence,
// set1, add, sub, mul, div, sqrt, fma(a, b, c) = a*b + c rounded once, and the
// double-precision sum-of-squares accumulator (Dacc, dacc_zero, dacc_add_sq, dacc_sum).

namespace {

using zerofn::AdamCoeffs;
using zerofn::kBF16;
using zerofn::kF16;
using zerofn::kF32;
using zerofn::kNone;
using reg = V::reg;

template <int G>
inline reg load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return V::load(static_cast<const float*>(g) + i);
  if constexpr (G == kBF16) return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  if constexpr (G == kF16) return V::load_f16(static_cast<const uint16_t*>(g) + i);
}

// The low-precision copy is written, never read: a streaming (non-temporal) store
// skips the read-for-ownership of its cache line, 2 of the pipeline's 32 bytes/param.
// Needs W*2-byte alignment, which the caller checks (STREAM=false otherwise).
template <int O, bool STREAM>
inline void store_out(void* out, int64_t i, reg x) {
  auto* o = static_cast<uint16_t*>(out) + i;
  if constexpr (O == kBF16) V::template store_half<STREAM>(o, V::bf16_bits(x));
  if constexpr (O == kF16) V::template store_half<STREAM>(o, V::f16_bits(x));
}

constexpr int elem_size(int dtype) { return dtype == kF32 ? 4 : 2; }

// The step constants broadcast once per call rather than once per vector.
struct Regs {
  reg grad_scale, decay, l2, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  explicit Regs(const AdamCoeffs& c)
      : grad_scale(V::set1(c.grad_scale)), decay(V::set1(c.decay)), l2(V::set1(c.l2)),
        lerp_w(V::set1(c.lerp_w)), beta2(V::set1(c.beta2)),
        one_minus_beta2(V::set1(c.one_minus_beta2)), bc2_sqrt(V::set1(c.bc2_sqrt)),
        eps(V::set1(c.eps)), neg_step(V::set1(c.neg_step_size)) {}
};

// One vector of Adam, in the order of operations of torch's single-tensor Adam on CPU
// (vectorised ATen kernels): mul_(decay); add(p, alpha=wd) = fma; lerp_ = fma of the
// difference; mul_(beta2).addcmul_ = fma((1-b2)*g, g, v*b2); sqrt / bc2_sqrt + eps;
// addcdiv_ = p + (-step_size*m) / denom. Matching it keeps parity near one ulp.
template <int G, int O, bool L2, bool SMALL, bool STREAM = false>
inline void adam_vec(float* p, const void* g, float* m, float* v, void* out, int64_t i,
                     const Regs& k) {
  reg gr = V::mul(load_grad<G>(g, i), k.grad_scale);
  reg pr = V::mul(V::load(p + i), k.decay);
  if constexpr (L2) gr = V::fma(pr, k.l2, gr);
  reg mr = V::load(m + i);
  reg diff = V::sub(gr, mr);
  mr = V::fma(k.lerp_w, diff, SMALL ? mr : gr);
  reg vr = V::fma(V::mul(k.one_minus_beta2, gr), gr, V::mul(V::load(v + i), k.beta2));
  reg denom = V::add(V::div(V::sqrt(vr), k.bc2_sqrt), k.eps);
  pr = V::add(pr, V::div(V::mul(k.neg_step, mr), denom));
  V::store(p + i, pr);
  V::store(m + i, mr);
  V::store(v + i, vr);
  if constexpr (O != kNone) store_out<O, STREAM>(out, i, pr);
}

inline void copy_bytes(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  auto* s = static_cast<const unsigned char*>(src);
  for (int64_t b = 0; b < bytes; ++b) d[b] = s[b];
}

// The last n % W elements: staged through full-width scratch so the tail gets the
// same instructions (and so the same rounding) as the body.
template <int G, int O, bool L2, bool SMALL>
void adam_tail(float* p, const void* g, float* m, float* v, void* out, int64_t r,
               const Regs& k) {
  float ps[V::W] = {}, ms[V::W] = {}, vs[V::W] = {}, gs[V::W] = {};
  uint16_t os[V::W] = {};
  copy_bytes(ps, p, r * 4);
  copy_bytes(ms, m, r * 4);
  copy_bytes(vs, v, r * 4);
  copy_bytes(gs, g, r * elem_size(G));
  adam_vec<G, O, L2, SMALL>(ps, gs, ms, vs, os, 0, k);
  copy_bytes(p, ps, r * 4);
  copy_bytes(m, ms, r * 4);
  copy_bytes(v, vs, r * 4);
  if constexpr (O != kNone) copy_bytes(out, os, r * 2);
}

template <int G, int O, bool L2, bool SMALL, bool STREAM>
void adam_range(float* p, const void* g, float* m, float* v, void* out, int64_t n,
                const AdamCoeffs& c) {
  const Regs k(c);
  const int64_t body = n - n % V::W;
  for (int64_t i = 0; i < body; i += V::W)
    adam_vec<G, O, L2, SMALL, STREAM>(p, g, m, v, out, i, k);
  if constexpr (STREAM) V::store_fence();
  if (body == n) return;
  const void* gt = static_cast<const char*>(g) + body * elem_size(G);
  void* ot = O == kNone ? out : static_cast<char*>(out) + body * 2;
  adam_tail<G, O, L2, SMALL>(p + body, gt, m + body, v + body, ot, n - body, k);
}

// Runtime flags -> one template instantiation, so the inner loop has no branches.
template <int G, int O, bool STREAM>
void adam_go(float* p, const void* g, float* m, float* v, void* out, int64_t n,
             const AdamCoeffs& c) {
  if (c.use_l2 && c.lerp_small) return adam_range<G, O, true, true, STREAM>(p, g, m, v, out, n, c);
  if (c.use_l2) return adam_range<G, O, true, false, STREAM>(p, g, m, v, out, n, c);
  if (c.lerp_small) return adam_range<G, O, false, true, STREAM>(p, g, m, v, out, n, c);
  adam_range<G, O, false, false, STREAM>(p, g, m, v, out, n, c);
}

template <int G>
void adam_go_out(float* p, const void* g, float* m, float* v, void* out, int out_dtype,
                 bool stream, int64_t n, const AdamCoeffs& c) {
  if (out_dtype == kBF16 && stream) return adam_go<G, kBF16, true>(p, g, m, v, out, n, c);
  if (out_dtype == kBF16) return adam_go<G, kBF16, false>(p, g, m, v, out, n, c);
  if (out_dtype == kF16 && stream) return adam_go<G, kF16, true>(p, g, m, v, out, n, c);
  if (out_dtype == kF16) return adam_go<G, kF16, false>(p, g, m, v, out, n, c);
  adam_go<G, kNone, false>(p, g, m, v, out, n, c);
}

// Streams the low-precision copy when every vector store of it will be aligned.
void adam_kernel(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                 int out_dtype, int64_t n, const AdamCoeffs& c) {
  const bool stream = reinterpret_cast<uintptr_t>(out) % (V::W * 2) == 0;
  if (g_dtype == kBF16) return adam_go_out<kBF16>(p, g, m, v, out, out_dtype, stream, n, c);
  if (g_dtype == kF16) return adam_go_out<kF16>(p, g, m, v, out, out_dtype, stream, n, c);
  adam_go_out<kF32>(p, g, m, v, out, out_dtype, stream, n, c);
}

// x - x is 0 for every finite x and NaN for inf or NaN, so a running sum of it stays
// exactly 0 until the first non-finite element. Squares accumulate in double, which
// neither overflows for any fp32 input nor loses the small terms of a long sum.
template <int G>
void sumsq_range(const void* g, int64_t n, double* sumsq, bool* finite) {
  typename V::Dacc acc = V::dacc_zero();
  reg bad = V::set1(0.0f);
  const int64_t body = n - n % V::W;
  for (int64_t i = 0; i < body; i += V::W) {
    reg x = load_grad<G>(g, i);
    bad = V::add(bad, V::sub(x, x));
    acc = V::dacc_add_sq(acc, x);
  }
  if (body != n) {
    float tail[V::W] = {};
    copy_bytes(tail, static_cast<const char*>(g) + body * elem_size(G),
               (n - body) * elem_size(G));
    reg x = load_grad<G>(tail, 0);
    bad = V::add(bad, V::sub(x, x));
    acc = V::dacc_add_sq(acc, x);
  }
  float lanes[V::W];
  V::store(lanes, bad);
  bool ok = true;
  for (int j = 0; j < V::W; ++j) ok = ok && lanes[j] == 0.0f;
  *sumsq = V::dacc_sum(acc);
  *finite = ok;
}

void sumsq_kernel(const void* g, int g_dtype, int64_t n, double* sumsq, bool* finite) {
  if (g_dtype == kBF16) return sumsq_range<kBF16>(g, n, sumsq, finite);
  if (g_dtype == kF16) return sumsq_range<kF16>(g, n, sumsq, finite);
  sumsq_range<kF32>(g, n, sumsq, finite);
}

// Reads p, g, m, v and writes p, m, v (28 bytes per element, like fp32 Adam) with one
// fma each: what a perfect Adam could reach on this machine, in the same loop shape.
void roofline_kernel(float* p, const float* g, float* m, float* v, int64_t n) {
  const reg c = V::set1(1e-7f);
  const int64_t body = n - n % V::W;
  for (int64_t i = 0; i < body; i += V::W) {
    reg gr = V::load(g + i);
    V::store(p + i, V::fma(gr, c, V::load(p + i)));
    V::store(m + i, V::fma(gr, c, V::load(m + i)));
    V::store(v + i, V::fma(gr, c, V::load(v + i)));
  }
  for (int64_t i = body; i < n; ++i) {  // a few elements: speed is irrelevant here
    p[i] += g[i] * 1e-7f;
    m[i] += g[i] * 1e-7f;
    v[i] += g[i] * 1e-7f;
  }
}

}  // namespace
