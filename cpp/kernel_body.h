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
// For low-precision state also: ireg (W uint32 lanes) with iset1, iota, iadd, isub,
// ixor, iand, imul (wrapping), isrl<k> / isra<k> (logical / arithmetic shift right),
// imax0 (max with 0, signed), imin (signed), ilt_i(a, b) = (a < b, signed) ? 1 : 0, ibits (a reg's
// bits), gather(int32 table, j); bf16_round(x, add) (top half of bits(x) + add, NaN
// kept quiet), from_bf16, load_u8/store_u8 (one byte per lane), lookup<N>(table, j) =
// table[j] for j < N (up to 256), abs, max, hmax.

namespace {

using zerofn::AdamBufs;
using zerofn::AdamCoeffs;
using zerofn::kBF16;
using zerofn::kF16;
using zerofn::kF32;
using zerofn::kNone;
using zerofn::kQuantBlock;
using zerofn::kU8;
using zerofn::QuantTables;
using reg = V::reg;
using ireg = V::ireg;

constexpr int elem_size(int dtype) { return dtype == kF32 ? 4 : dtype == kU8 ? 1 : 2; }

template <int D>
inline void* at(void* x, int64_t i) { return static_cast<char*>(x) + i * elem_size(D); }
template <int D>
inline const void* at(const void* x, int64_t i) {
  return static_cast<const char*>(x) + i * elem_size(D);
}

// Any fp32 / bf16 / fp16 buffer, widened to fp32 (exactly).
template <int D>
inline reg load_as(const void* x, int64_t i) {
  if constexpr (D == kF32) return V::load(static_cast<const float*>(x) + i);
  if constexpr (D == kBF16) return V::load_bf16(static_cast<const uint16_t*>(x) + i);
  if constexpr (D == kF16) return V::load_f16(static_cast<const uint16_t*>(x) + i);
}

// lowbias32 of the element counter plus the stream key: the same bits for element i
// whatever the thread split, vector width or ISA (zerofn/optim/lowp.py, random_bits).
inline ireg random_bits(uint32_t key, int64_t i) {
  ireg x = V::iadd(V::iota(), V::iset1(uint32_t(i) + key));
  x = V::ixor(x, V::template isrl<16>(x));
  x = V::imul(x, V::iset1(0x7feb352du));
  x = V::ixor(x, V::template isrl<15>(x));
  x = V::imul(x, V::iset1(0x846ca68bu));
  return V::ixor(x, V::template isrl<16>(x));
}

// Stores x as D and returns the value stored. bf16 rounds stochastically: adding 16
// random bits (`bits`, below 2^16; unused for fp32) below the kept half rounds the
// magnitude up with probability (dropped part) / 2^16, so the expected value is x.
// Round to nearest even would freeze exp_avg_sq (beta2 = 0.999 moves it by less than
// half a bf16 ulp) and bf16 masters.
template <int D>
inline reg store_as(void* x, int64_t i, reg a, ireg bits) {
  if constexpr (D == kF32) {
    V::store(static_cast<float*>(x) + i, a);
    return a;
  } else {
    const auto h = V::bf16_round(a, bits);
    V::template store_half<false>(static_cast<uint16_t*>(x) + i, h);
    return V::from_bf16(h);
  }
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

// The step constants broadcast once per call rather than once per vector.
struct Regs {
  reg grad_scale, decay, l2, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  uint32_t key_p, key_m;
  explicit Regs(const AdamCoeffs& c)
      : grad_scale(V::set1(c.grad_scale)), decay(V::set1(c.decay)), l2(V::set1(c.l2)),
        lerp_w(V::set1(c.lerp_w)), beta2(V::set1(c.beta2)),
        one_minus_beta2(V::set1(c.one_minus_beta2)), bc2_sqrt(V::set1(c.bc2_sqrt)),
        eps(V::set1(c.eps)), neg_step(V::set1(c.neg_step_size)), key_p(c.key_p),
        key_m(c.key_m) {}
};

// Compile-time shape of one instantiation: gradient, copy-out, params and moment
// dtypes (S is kF32 or kBF16 here: 8-bit moments reach adam_regs decoded to fp32).
template <int G_, int O_, bool L2_, bool SMALL_, int P_, int S_>
struct Kind {
  static constexpr int G = G_, O = O_, P = P_, S = S_;
  static constexpr bool L2 = L2_, SMALL = SMALL_;
};

// One vector of Adam, in the order of operations of torch's single-tensor Adam on CPU
// (vectorised ATen kernels): mul_(decay); add(p, alpha=wd) = fma; lerp_ = fma of the
// difference; mul_(beta2).addcmul_ = fma((1-b2)*g, g, v*b2); sqrt / bc2_sqrt + eps;
// addcdiv_ = p + (-step_size*m) / denom. Matching it keeps parity near one ulp.
// The moments come and go in registers (mr, vr: old values in, new ones out); p and
// the copy-out are read and written here. `index` is element i's position in the whole
// buffer (stochastic rounding's counter).
template <class K, bool STREAM>
inline void adam_regs(void* p, const void* g, reg& mr, reg& vr, void* out, int64_t i,
                      int64_t index, const Regs& k) {
  reg gr = V::mul(load_as<K::G>(g, i), k.grad_scale);
  reg pr = V::mul(load_as<K::P>(p, i), k.decay);
  if constexpr (K::L2) gr = V::fma(pr, k.l2, gr);
  reg diff = V::sub(gr, mr);
  mr = V::fma(k.lerp_w, diff, K::SMALL ? mr : gr);
  vr = V::fma(V::mul(k.one_minus_beta2, gr), gr, V::mul(vr, k.beta2));
  reg denom = V::add(V::div(V::sqrt(vr), k.bc2_sqrt), k.eps);
  pr = V::add(pr, V::div(V::mul(k.neg_step, mr), denom));
  pr = store_as<K::P>(p, i, pr, V::iand(random_bits(k.key_p, index), V::iset1(0xFFFFu)));
  if constexpr (K::O != kNone) store_out<K::O, STREAM>(out, i, pr);
}

// adam_regs with the moments in fp32 or bf16 buffers. bf16 moments share one hash per
// element: exp_avg rounds with its low 16 bits, exp_avg_sq with its high 16.
template <class K, bool STREAM = false>
inline void adam_vec(void* p, const void* g, void* m, void* v, void* out, int64_t i,
                     int64_t index, const Regs& k) {
  reg mr = load_as<K::S>(m, i), vr = load_as<K::S>(v, i);
  adam_regs<K, STREAM>(p, g, mr, vr, out, i, index, k);
  const ireg bits = random_bits(k.key_m, index);
  store_as<K::S>(m, i, mr, V::iand(bits, V::iset1(0xFFFFu)));
  store_as<K::S>(v, i, vr, V::template isrl<16>(bits));
}

inline void copy_bytes(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  auto* s = static_cast<const unsigned char*>(src);
  for (int64_t b = 0; b < bytes; ++b) d[b] = s[b];
}

// The last r < W elements: staged through full-width scratch so the tail gets the
// same instructions (and so the same rounding) as the body.
template <class K>
void adam_tail(void* p, const void* g, void* m, void* v, void* out, int64_t r,
               int64_t index, const Regs& k) {
  float ps[V::W] = {}, ms[V::W] = {}, vs[V::W] = {}, gs[V::W] = {};
  uint16_t os[V::W] = {};
  copy_bytes(ps, p, r * elem_size(K::P));
  copy_bytes(ms, m, r * elem_size(K::S));
  copy_bytes(vs, v, r * elem_size(K::S));
  copy_bytes(gs, g, r * elem_size(K::G));
  adam_vec<K>(ps, gs, ms, vs, os, 0, index, k);
  copy_bytes(p, ps, r * elem_size(K::P));
  copy_bytes(m, ms, r * elem_size(K::S));
  copy_bytes(v, vs, r * elem_size(K::S));
  if constexpr (K::O != kNone) copy_bytes(out, os, r * 2);
}

// fp32 or bf16 moments: [begin, end) vector by vector, the tail on a padded copy.
template <class K, bool STREAM>
void adam_range(const AdamBufs& b, int64_t begin, int64_t end, const Regs& k) {
  const int64_t n = end - begin;
  void* p = at<K::P>(b.p, begin);
  const void* g = at<K::G>(b.g, begin);
  void* m = at<K::S>(b.m, begin);
  void* v = at<K::S>(b.v, begin);
  void* out = K::O == kNone ? nullptr : at<kBF16>(b.out, begin);
  const int64_t body = n - n % V::W;
  for (int64_t i = 0; i < body; i += V::W)
    adam_vec<K, STREAM>(p, g, m, v, out, i, begin + i, k);
  if constexpr (STREAM) V::store_fence();
  if (body == n) return;
  adam_tail<K>(at<K::P>(p, body), at<K::G>(g, body), at<K::S>(m, body), at<K::S>(v, body),
               K::O == kNone ? out : at<kBF16>(out, body), n - body, begin + body, k);
}

// Nearest code of each lane of x (already normalized by the block's absmax): the number
// of midpoints strictly below x, as torch.bucketize(x, mids, right=False) counts them,
// by one table lookup and one compare ([Note: code search by table] in kernels.h).
inline ireg nearest_code(reg x, const int32_t* lut) {
  const ireg u = V::ibits(x);
  const ireg neg = V::template isra<31>(u);  // all ones in the negative lanes
  const ireg mag = V::iand(u, V::iset1(0x7FFFFFFFu));
  ireg t = V::imax0(V::isub(V::template isrl<16>(mag), V::iset1(zerofn::kLutLow)));
  // NaN (a block whose scale is inf or nan) lies past the table: it stays in bounds and
  // takes code 255, as bucketize puts nan after every midpoint.
  t = V::imin(t, V::iset1(zerofn::kLutSpan - 1));
  t = V::iadd(t, V::iand(neg, V::iset1(zerofn::kLutSpan)));
  const ireg e = V::gather(lut, t);
  const ireg low = V::iand(V::ixor(mag, neg), V::iset1(0xFFFFu));
  const ireg code = V::iadd(V::template isrl<16>(e), V::ilt_i(V::iand(e, V::iset1(0xFFFFu)), low));
  const ireg nan = V::ilt_i(V::iset1(0x7F800000u), mag);
  return V::iadd(code, V::imul(nan, V::isub(V::iset1(255u), code)));
}

// Where one block's moments come from: its 8-bit codes, decoded vector by vector...
struct Codes {
  const uint8_t *m, *v;
  reg m_scale, v_scale;
  const QuantTables& q;
  reg load_m(int64_t i) const { return decode(m + i, m_scale, q.code_m); }
  reg load_v(int64_t i) const { return decode(v + i, v_scale, q.code_v); }
  static reg decode(const uint8_t* c, reg scale, const float* code) {
    return V::mul(V::template lookup<256>(code, V::load_u8(c)), scale);
  }
};

// ... or, for a short last block, fp32 scratch that holds them decoded, zero-padded.
struct Decoded {
  const float *m, *v;
  reg load_m(int64_t i) const { return V::load(m + i); }
  reg load_v(int64_t i) const { return V::load(v + i); }
};

// One short block's codes -> fp32 scratch (code * scale); lanes from len on are zero.
inline void decode_short(const uint8_t* codes, float scale, const float* code, float* x,
                         int64_t len) {
  for (int64_t i = 0; i < kQuantBlock; ++i) x[i] = i < len ? code[codes[i]] * scale : 0.0f;
}

// Whether every lane is 0 (an accumulated x - x is, until an inf or nan).
inline bool all_zero(reg a) {
  float lanes[V::W];
  V::store(lanes, a);
  for (int j = 0; j < V::W; ++j)
    if (lanes[j] != 0.0f) return false;
  return true;
}

// A block with an inf or nan (training diverged): its absmax as torch's amax takes it,
// nan winning, in scalar code (rare). The magnitude clears the sign bit, as abs does.
inline float absmax_keeping_nan(const float* x) {
  float mx = 0.0f;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    const float a = __builtin_fabsf(x[i]);
    if (a != a) return a;
    if (a > mx) mx = a;
  }
  return mx;
}

// The new fp32 moments of one block (in L1 scratch) and their absmax.
struct BlockMoments {
  alignas(64) float m[kQuantBlock], v[kQuantBlock];
  float m_max, v_max;
};

// Adam over one whole block: the moments from `src`, the new ones into `out_m`, their
// absmax taken on the way (the same lanes in the same order as a separate pass would).
template <class KF, bool STREAM, class Src>
void adam_block(void* p, const void* g, void* out, const Src& src, int64_t b0,
                const Regs& k, BlockMoments& nm) {
  reg m_max = V::set1(0.0f), v_max = V::set1(0.0f), bad = V::set1(0.0f);
  for (int64_t i = 0; i < kQuantBlock; i += V::W) {
    reg mr = src.load_m(i), vr = src.load_v(i);
    adam_regs<KF, STREAM>(p, g, mr, vr, out, i, b0 + i, k);
    V::store(nm.m + i, mr);
    V::store(nm.v + i, vr);
    m_max = V::max(m_max, V::abs(mr));
    v_max = V::max(v_max, V::abs(vr));
    bad = V::add(bad, V::add(V::sub(mr, mr), V::sub(vr, vr)));   // 0 until an inf or nan
  }
  nm.m_max = V::hmax(m_max);
  nm.v_max = V::hmax(v_max);
  if (!all_zero(bad)) {   // (maxps drops a nan; torch's amax keeps it)
    nm.m_max = absmax_keeping_nan(nm.m);
    nm.v_max = absmax_keeping_nan(nm.v);
  }
}

// fp32 scratch (zero beyond len) -> codes, and the block's scale s = absmax. The
// elements are normalized as x * (1/s), the reciprocal rounded once per block: a
// multiply costs a fraction of a division, and the code search only needs a monotone,
// deterministic normalization that maps s to about 1 (lowp.quantize_blockwise). A block
// of zeros uses s = 1; a subnormal s, whose reciprocal would overflow, is scaled by 2^24
// together with the elements first, exactly.
inline void encode_block(const float* x, float absmax, uint8_t* codes, float* scale,
                         const int32_t* lut, int64_t len) {
  *scale = absmax;
  const float s = absmax == 0.0f ? 1.0f : absmax;
  const float pre = s < 0x1p-126f ? 0x1p24f : 1.0f;
  const reg up = V::set1(pre), recip = V::set1(1.0f / (s * pre));
  alignas(64) uint8_t staged[kQuantBlock];
  uint8_t* dst = len == kQuantBlock ? codes : staged;
  for (int64_t i = 0; i < kQuantBlock; i += V::W)
    V::store_u8(dst + i, nearest_code(V::mul(V::mul(V::load(x + i), up), recip), lut));
  if (dst == staged) copy_bytes(codes, staged, len);
}

// 8-bit moments, block by block: decode, update and take the new absmax in one pass
// (new moments to L1 scratch), then encode with it. A short last block runs the whole
// block on zero-padded copies of its moments, p and g.
template <class K, bool STREAM>
void adam_range_u8(const AdamBufs& b, int64_t begin, int64_t end, const Regs& k) {
  using KF = Kind<K::G, K::O, K::L2, K::SMALL, K::P, kF32>;
  const QuantTables& q = *b.q;
  BlockMoments nm;
  for (int64_t b0 = begin; b0 < end; b0 += kQuantBlock) {
    const int64_t len = end - b0 < kQuantBlock ? end - b0 : kQuantBlock;
    auto* mc = static_cast<uint8_t*>(b.m) + b0;
    auto* vc = static_cast<uint8_t*>(b.v) + b0;
    float* msc = b.m_scale + b0 / kQuantBlock;
    float* vsc = b.v_scale + b0 / kQuantBlock;
    void* p = at<K::P>(b.p, b0);
    const void* g = at<K::G>(b.g, b0);
    void* out = K::O == kNone ? nullptr : at<kBF16>(b.out, b0);
    if (len == kQuantBlock) {
      adam_block<KF, STREAM>(p, g, out, Codes{mc, vc, V::set1(*msc), V::set1(*vsc), q}, b0, k, nm);
    } else {
      alignas(64) float ps[kQuantBlock] = {}, gs[kQuantBlock] = {};
      alignas(64) uint16_t os[kQuantBlock];
      decode_short(mc, *msc, q.code_m, nm.m, len);
      decode_short(vc, *vsc, q.code_v, nm.v, len);
      copy_bytes(ps, p, len * elem_size(K::P));
      copy_bytes(gs, g, len * elem_size(K::G));
      adam_block<KF, false>(ps, gs, os, Decoded{nm.m, nm.v}, b0, k, nm);
      copy_bytes(p, ps, len * elem_size(K::P));
      if constexpr (K::O != kNone) copy_bytes(out, os, len * 2);
    }
    encode_block(nm.m, nm.m_max, mc, msc, q.lut_m, len);
    encode_block(nm.v, nm.v_max, vc, vsc, q.lut_v, len);
  }
  if constexpr (STREAM) V::store_fence();
}

// Runtime dtypes and flags -> one template instantiation, so the inner loop has no
// branches. Each level fixes one template argument and calls the next.
template <int G, int O, bool STREAM, bool L2, bool SMALL, int P>
void adam_go_state(const AdamBufs& b, int64_t begin, int64_t end, const Regs& k) {
  if (b.state_dtype == kU8)
    return adam_range_u8<Kind<G, O, L2, SMALL, P, kF32>, STREAM>(b, begin, end, k);
  if (b.state_dtype == kBF16)
    return adam_range<Kind<G, O, L2, SMALL, P, kBF16>, STREAM>(b, begin, end, k);
  adam_range<Kind<G, O, L2, SMALL, P, kF32>, STREAM>(b, begin, end, k);
}

template <int G, int O, bool STREAM, bool L2, bool SMALL>
void adam_go_param(const AdamBufs& b, int64_t begin, int64_t end, const Regs& k) {
  if (b.p_dtype == kBF16) return adam_go_state<G, O, STREAM, L2, SMALL, kBF16>(b, begin, end, k);
  adam_go_state<G, O, STREAM, L2, SMALL, kF32>(b, begin, end, k);
}

template <int G, int O, bool STREAM>
void adam_go(const AdamBufs& b, int64_t begin, int64_t end, const AdamCoeffs& c) {
  const Regs k(c);
  if (c.use_l2 && c.lerp_small) return adam_go_param<G, O, STREAM, true, true>(b, begin, end, k);
  if (c.use_l2) return adam_go_param<G, O, STREAM, true, false>(b, begin, end, k);
  if (c.lerp_small) return adam_go_param<G, O, STREAM, false, true>(b, begin, end, k);
  adam_go_param<G, O, STREAM, false, false>(b, begin, end, k);
}

template <int G>
void adam_go_out(const AdamBufs& b, bool stream, int64_t begin, int64_t end,
                 const AdamCoeffs& c) {
  if (b.out_dtype == kBF16 && stream) return adam_go<G, kBF16, true>(b, begin, end, c);
  if (b.out_dtype == kBF16) return adam_go<G, kBF16, false>(b, begin, end, c);
  if (b.out_dtype == kF16 && stream) return adam_go<G, kF16, true>(b, begin, end, c);
  if (b.out_dtype == kF16) return adam_go<G, kF16, false>(b, begin, end, c);
  adam_go<G, kNone, false>(b, begin, end, c);
}

// Streams the low-precision copy when every vector store of it will be aligned.
void adam_kernel(const AdamBufs& b, int64_t begin, int64_t end, const AdamCoeffs& c) {
  const bool stream =
      b.out != nullptr && reinterpret_cast<uintptr_t>(at<kBF16>(b.out, begin)) % (V::W * 2) == 0;
  if (b.g_dtype == kBF16) return adam_go_out<kBF16>(b, stream, begin, end, c);
  if (b.g_dtype == kF16) return adam_go_out<kF16>(b, stream, begin, end, c);
  adam_go_out<kF32>(b, stream, begin, end, c);
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
    reg x = load_as<G>(g, i);
    bad = V::add(bad, V::sub(x, x));
    acc = V::dacc_add_sq(acc, x);
  }
  if (body != n) {
    float tail[V::W] = {};
    copy_bytes(tail, static_cast<const char*>(g) + body * elem_size(G),
               (n - body) * elem_size(G));
    reg x = load_as<G>(tail, 0);
    bad = V::add(bad, V::sub(x, x));
    acc = V::dacc_add_sq(acc, x);
  }
  *sumsq = V::dacc_sum(acc);
  *finite = all_zero(bad);
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
