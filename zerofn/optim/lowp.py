"""Low-precision optimizer state on the host: the exact definitions, in plain torch.

The C++ kernels (``zerofn.optim.adam_step``) store Adam's moments as fp32, bf16 or
8-bit blockwise codes and the masters as fp32 or bf16; this module defines what they
compute, bit for bit, and converts state for state dicts and checkpoints:

- 8-bit moments: blocks of ``QUANT_BLOCK`` = 256 elements from the start of the buffer
  (the last may be short), each with an fp32 scale = its absmax, and one byte per
  element indexing the dynamic-tree code of Dettmers et al. (signed for ``exp_avg``,
  unsigned for ``exp_avg_sq``), picked by nearest code = ``torch.bucketize`` on the
  fp32 midpoints of consecutive codes.
- bf16 masters and bf16 moments: stochastic rounding with counter-based random bits
  (``round_bf16_stochastic``), so a result depends on (seed, step, stream, element
  index) only, never on threads or ISA.

``reference_adam_step`` is the kernels' arithmetic in torch (every fp32 operation
rounded exactly once, as the kernels round it); tests compare the two bit for bit.
"""
from __future__ import annotations

import math

import torch

#: Elements per block of 8-bit moments: each block has one fp32 scale, its absmax.
QUANT_BLOCK = 256
# Parameters with fewer elements keep fp32 moments under 8-bit state, as bitsandbytes'
# min_8bit_size and torchao's low-bit optimizers do: layer norms, biases and other small
# tensors hold a negligible share of the state's bytes, and rounding theirs costs accuracy.
MIN_8BIT_NUMEL = 4096


def moment_dtype(state_dtype: torch.dtype, numel: int) -> torch.dtype:
    """How a parameter of ``numel`` elements stores its moments under ``state_dtype``."""
    return torch.float32 if state_dtype == torch.int8 and numel < MIN_8BIT_NUMEL else state_dtype

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9
STREAM_PARAMS, STREAM_MOMENTS = 0, 1


# ---------------------------------------------------------------------------- codes


def _dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``,
    with one value changed in each (see below).

    Exponent i = 0..6 scales 10**(i-6); the fraction part at exponent i takes the
    midpoints of ``linspace(0.1, 1, k + 1)`` with k = 2**i values (signed, each also
    negated) or k = 2**(i+1) (unsigned). With 0 and 1.0 that is 127*2 + 2 = 256
    (signed) or 254 + 2 = 256 (unsigned) values, sorted ascending.

    The changes:
    - signed: the most negative value is -1.0, where bitsandbytes has -(1 - 0.9/128) =
      -0.99296875. A block's largest magnitude then encodes exactly (to ±1 times the
      scale) whatever its sign, so decoding and encoding again gives the same codes and
      scale: an fp32 state dict or checkpoint resumes the stored state bit for bit.
    - unsigned (``exp_avg_sq``): no zero. Its lowest value is 0.55e-7 (the tree taken one
      decade further down, with one fraction value), where bitsandbytes has 0: a second
      moment that rounds to 0 while the first moment does not makes the update
      ``m / (sqrt(0) + eps)``, far too large (Li et al. 2023, "Memory Efficient
      Optimizers with 4-bit States", the zero-point problem, fixed the same way). A
      block of zeros still decodes to 0: its scale is 0.

    Computed here in fp64 (mean_j = 0.1 + 0.9*(j + 0.5)/k) and rounded to fp32 once;
    bitsandbytes computes in fp32 and can differ in the last bit of a few codes.
    """
    data = [0.0 if signed else 0.55e-7, 1.0]
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        scale = 10.0 ** (i - 6)
        means = [scale * (0.1 + 0.9 * (j + 0.5) / k) for j in range(k)]
        data += means + ([-x for x in means] if signed else [])
    assert len(data) == 256
    data.sort()
    if signed:
        data[0] = -1.0
    return torch.tensor(data, dtype=torch.float64).float()


_CODES: dict[bool, torch.Tensor] = {}


def _code(signed: bool) -> torch.Tensor:
    if signed not in _CODES:
        _CODES[signed] = _dynamic_map(signed)
    return _CODES[signed]


def signed_code() -> torch.Tensor:
    """The 256 fp32 values an ``exp_avg`` byte decodes to (times its block's scale)."""
    return _code(True).clone()


def unsigned_code() -> torch.Tensor:
    """The 256 fp32 values an ``exp_avg_sq`` byte decodes to (times its block's scale)."""
    return _code(False).clone()


def midpoints(signed: bool) -> torch.Tensor:
    """The 255 decision boundaries, ``(code[i] + code[i+1]) / 2`` in fp32."""
    c = _code(signed)
    return (c[:-1] + c[1:]) / 2


# ------------------------------------------------------------- 8-bit quantization


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (1-D) zero-padded to whole blocks, as (blocks, QUANT_BLOCK)."""
    n = x.numel()
    pad = -n % QUANT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """fp32 a / b rounded once: the quotient in fp64 rounds to fp32 exactly as IEEE
    fp32 division would (53 >= 2*24 + 2 bits makes the double rounding harmless)."""
    b = b.double() if isinstance(b, torch.Tensor) else b
    return (a.double() / b).float()


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [n], scales fp32 [ceil(n/256)])`` of a 1-D fp32 tensor.

    Per block: scale s = ``max |x|``; normalized = x * r in fp32 with r = 1 / s rounded
    to fp32 once per block (s = 1 for a block of zeros; a subnormal s, whose reciprocal
    overflows, and the block's elements are first multiplied by 2**24, exactly); code
    index = number of midpoints strictly below normalized (``bucketize``,
    ``right=False``), so a value exactly on a midpoint takes the lower code.

    The reciprocal is the kernels' choice (a multiply per element is much cheaper than a
    division) and is sound: the code search needs only a monotone, deterministic
    normalization, and x * r is within an ulp of x / s: s itself maps to within an ulp
    of 1.0, which takes the code of 1.0.
    """
    if x.dtype != torch.float32 or x.dim() != 1:
        raise TypeError(f"quantize_blockwise takes a 1-D fp32 tensor, got {x.dtype} {x.dim()}-D")
    n = x.numel()
    b = _blocks(x)
    scales = b.abs().amax(dim=1)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    up = torch.where(safe < 2.0**-126, 2.0**24, 1.0)  # fp32
    recip = _div(torch.ones_like(safe), safe * up)  # safe * up is exact
    normalized = _mul(_mul(b, up[:, None]), recip[:, None])
    codes = torch.bucketize(normalized, midpoints(signed), right=False)
    return codes.reshape(-1)[:n].to(torch.uint8), scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 ``code[q] * scale`` of each element (one fp32 multiply, as the kernels do)."""
    n = codes.numel()
    values = _code(signed)[codes.reshape(-1).long()]
    per_elem = scales.repeat_interleave(QUANT_BLOCK)[:n]
    return values * per_elem


# ------------------------------------------------------------ stochastic rounding


def _mul32(x, c: int):
    """(x * c) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def mix32(x):
    """lowbias32 (Chris Wellons' 32-bit integer hash), on ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, step: int, stream: int) -> int:
    """The per-(seed, step, stream) key ``ks``; element i's bits are mix32(i + ks).

    key = mix32(mix32(mix32(seed_lo) ^ seed_hi) ^ step_lo);
    ks = mix32(key ^ (0x9E3779B9 * (stream + 1) mod 2**32)). All values uint32.
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    key = mix32(mix32(mix32(seed & _MASK32) ^ (seed >> 32)) ^ (step & _MASK32))
    return mix32(key ^ ((_GOLDEN32 * (stream + 1)) & _MASK32))


def random_bits(n: int, *, seed: int, step: int, stream: int, start: int = 0) -> torch.Tensor:
    """uint32 random bits (in int64) of elements start..start+n-1 of a buffer."""
    ks = stream_key(seed, step, stream)
    i = torch.arange(start, start + n, dtype=torch.int64)
    return mix32((i + ks) & _MASK32)


def _bits32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _bf16_from_top(u: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """bf16 whose bits are the top half of u + add; a NaN keeps its sign and top
    payload with the quiet bit set (rounding could otherwise turn it into an inf)."""
    top = ((u + add) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    top = torch.where(nan, (u >> 16) | 0x40, top)
    return (top - ((top >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def round_bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding to nearest even on the bit pattern, like the kernels'
    copy-out (and ``Tensor.to`` except for which NaN bits a NaN gets)."""
    u = _bits32(x.float())
    return _bf16_from_top(u, 0x7FFF + ((u >> 16) & 1)).view(x.shape)


def round_bf16_stochastic(
    x: torch.Tensor, *, seed: int, step: int, stream: int, start: int = 0, high: bool = False
) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding, deterministic in (seed, step, stream, index).

    Adds the low 16 random bits r & 0xFFFF of element i (``random_bits``; i counts
    from 0 at the buffer's start, plus ``start``), or with ``high`` the high 16 bits
    r >> 16, to the fp32 bit pattern and keeps the top 16 bits: the magnitude rounds up
    with probability (dropped bits) / 2**16, which makes E[result] = x for either sign.
    inf stays inf; NaN stays NaN (quiet, same sign); the largest finite values can round
    up to inf, with that probability. The two halves of a word are independent draws
    (lowbias32 mixes every input bit into both), so two buffers can share one stream.
    """
    u = _bits32(x.float().reshape(-1))
    r = random_bits(u.numel(), seed=seed, step=step, stream=stream, start=start)
    return _bf16_from_top(u, (r >> 16) if high else (r & 0xFFFF)).view(x.shape)


# ------------------------------------------------------------ reference Adam step


def _f32(x: float) -> float:
    """x rounded to the nearest fp32, as a Python float (exact in double)."""
    return torch.tensor(x, dtype=torch.float32).item()


def adam_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale) -> dict:
    """The kernels' per-step scalars (``derive_coeffs`` in cpp/adam_bindings.cpp):
    derived in double with the same libm ``pow``, then each rounded to fp32 once."""
    bc1 = 1.0 - beta1 ** float(step)
    bc2 = 1.0 - beta2 ** float(step)
    w = _f32(1.0 - beta1)
    small = abs(w) < 0.5
    return dict(
        grad_scale=_f32(grad_scale),
        decay=_f32(1.0 - lr * weight_decay) if adamw_mode else 1.0,
        use_l2=not adamw_mode and weight_decay != 0.0,
        l2=_f32(weight_decay),
        lerp_small=small,
        lerp_w=w if small else _f32(w - 1.0),
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1.0 - beta2),
        bc2_sqrt=_f32(bc2**0.5),
        eps=_f32(eps),
        neg_step=_f32(-(lr / bc1)),
    )


def _d(x):
    return x.double() if isinstance(x, torch.Tensor) else x


def _mul(a, b) -> torch.Tensor:
    return (_d(a) * _d(b)).float()  # the fp32 product is exact in double: one rounding


def _add(a, b) -> torch.Tensor:
    return (_d(a) + _d(b)).float()  # an fp32 sum rounds once from double (53 >= 2*24+2)


def _fma(a, b, c) -> torch.Tensor:
    """fp32 fma(a, b, c) = a*b + c rounded once. a*b is exact in double; the sum is
    rounded to odd in double (TwoSum gives its exact error, an inexact even result
    steps one ulp toward the error), and round-to-odd at 53 bits then to nearest at
    24 bits equals one rounding to nearest: plain double rounding would not."""
    ab = _d(a) * _d(b)
    c = _d(c) * torch.ones_like(ab)
    s = ab + c
    bb = s - ab
    err = (ab - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & even & torch.isfinite(s)
    toward = torch.where(err > 0, math.inf, -math.inf).to(torch.float64)
    return torch.where(fix, torch.nextafter(s, toward), s).float()


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 sqrt. sqrt in double rounded to fp32 is correctly rounded when the
    double sqrt is; torch's CPU sqrt may go through MKL, so the result is checked
    against the exact squares of the neighbouring midpoints and fixed if needed."""
    r = v.double().sqrt().float()
    ok = torch.isfinite(r) & (r > 0)
    up = torch.nextafter(r, torch.full_like(r, math.inf))
    down = torch.nextafter(r, torch.zeros_like(r))
    vd = v.double()
    r = torch.where(ok & (((r.double() + up.double()) / 2) ** 2 < vd), up, r)
    r = torch.where(ok & (((r.double() + down.double()) / 2) ** 2 > vd), down, r)
    return r


def _load_state(t: torch.Tensor, scale, signed: bool) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return dequantize_blockwise(t, scale, signed)
    return t.reshape(-1).float()


def _store_state(t, scale, x, signed, seed, step) -> None:
    """Stores a new moment; bf16 exp_avg (signed) and exp_avg_sq share the moments
    stream, exp_avg rounding with the low and exp_avg_sq with the high 16 bits."""
    if t.dtype == torch.uint8:
        codes, scales = quantize_blockwise(x, signed)
        t.view(-1).copy_(codes)
        scale.copy_(scales)
    elif t.dtype == torch.bfloat16:
        t.view(-1).copy_(round_bf16_stochastic(x, seed=seed, step=step, stream=STREAM_MOMENTS,
                                               high=not signed))
    else:
        t.view(-1).copy_(x)


def reference_adam_step(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    seed: int = 0,
) -> None:
    """What ``adam_step`` computes, in plain torch, in place; equal to it bit for bit.

    Loads every buffer to fp32 (bf16/fp16 exactly, 8-bit codes as ``code * scale``),
    runs the fp32 kernel's operations in its order (see ``adam_vec`` in
    cpp/kernel_body.h), each rounded once like the kernel's fp32 instruction, then
    stores: fp32 as is; bf16 params by ``round_bf16_stochastic`` with stream 0, bf16
    exp_avg / exp_avg_sq with stream 1, the low / high half of each word; 8-bit moments by ``quantize_blockwise`` of the new fp32
    moments (their scales updated in place). The update of the params uses the new
    fp32 moments, before they are quantized. ``out`` receives the stored params value
    rounded to nearest even (for bf16 params and bf16 out, the same bits).
    """
    k = adam_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale)
    p = params.reshape(-1).float()
    m = _load_state(exp_avg, exp_avg_scale, True)
    v = _load_state(exp_avg_sq, exp_avg_sq_scale, False)
    gr = _mul(grads.reshape(-1).float(), k["grad_scale"])
    pr = _mul(p, k["decay"])
    if k["use_l2"]:
        gr = _fma(pr, k["l2"], gr)
    diff = _add(gr, -m)
    m = _fma(k["lerp_w"], diff, m if k["lerp_small"] else gr)
    v = _fma(_mul(k["one_minus_beta2"], gr), gr, _mul(v, k["beta2"]))
    denom = _add(_div(_sqrt(v), k["bc2_sqrt"]), k["eps"])
    pr = _add(pr, _div(_mul(k["neg_step"], m), denom))
    if params.dtype == torch.bfloat16:
        stored = round_bf16_stochastic(pr, seed=seed, step=step, stream=STREAM_PARAMS)
        params.view(-1).copy_(stored)
        pr = stored.float()
    else:
        params.view(-1).copy_(pr)
    _store_state(exp_avg, exp_avg_scale, m, True, seed, step)
    _store_state(exp_avg_sq, exp_avg_sq_scale, v, False, seed, step)
    if out is not None:
        low = round_bf16_nearest(pr) if out.dtype == torch.bfloat16 else pr.to(out.dtype)
        out.view(-1).copy_(low)
