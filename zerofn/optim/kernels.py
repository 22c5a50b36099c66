"""Checked Python entry points to the C++ CPU Adam kernels in ``zerofn._C``.

The kernels take raw buffers; everything that could make them read or write the wrong
memory is checked here on the torch tensors first, and reported as ``TypeError`` /
``ValueError`` naming the argument. See ``zerofn.optim`` for the public API.
"""
from __future__ import annotations

import math
import warnings

import torch

from zerofn.optim import lowp

try:
    from zerofn import _C
except ImportError as e:  # a missing or broken build must not degrade silently
    _C = None
    _IMPORT_ERROR = e
else:
    _IMPORT_ERROR = None

# What each buffer may hold, by the name zerofn._C gives the kernels' code for it (kernels.h).
_GRAD_DTYPES = {torch.float32: "DTYPE_F32", torch.bfloat16: "DTYPE_BF16",
                torch.float16: "DTYPE_F16"}
_OUT_DTYPES = {torch.bfloat16: "DTYPE_BF16", torch.float16: "DTYPE_F16"}
_PARAM_DTYPES = {torch.float32: "DTYPE_F32", torch.bfloat16: "DTYPE_BF16"}
_STATE_DTYPES = {torch.float32: "DTYPE_F32", torch.bfloat16: "DTYPE_BF16",
                 torch.uint8: "DTYPE_U8"}
_warned_generic = False


def native():
    """The ``zerofn._C`` module, or a RuntimeError saying how to build it."""
    if _C is None:
        raise RuntimeError(
            "zerofn._C (the C++ CPU Adam) is not built or failed to load: "
            f"{_IMPORT_ERROR}. Build it from the zerofn checkout: `bash scripts/setup.sh` "
            "(into the environment set-up uses), or in your own active environment "
            "`python -m pip install --no-build-isolation --no-deps -e .`."
        ) from _IMPORT_ERROR
    _warn_if_generic(_C)
    return _C


def _warn_if_generic(c) -> None:
    """Says once when an x86-64 CPU falls back to the scalar kernels (much slower)."""
    global _warned_generic
    if not _warned_generic and c.isa() == "generic" and c.build_info()["arch"] == "x86_64":
        _warned_generic = True
        warnings.warn(
            "zerofn CPU Adam runs its portable scalar kernels: this CPU lacks AVX2/FMA/F16C "
            "or ZEROFN_CPU_ISA forced it. Expect several times lower throughput.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_buffer(name: str, t, dtypes, numel: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the CPU Adam kernels need host tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() or pass a flat buffer)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, params has {numel}")


def _check_distinct(**tensors) -> None:
    """In-place buffers that overlap would be read after being written."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
        for n, t in tensors.items()
        if t is not None and t.numel() > 0
    )
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{a} and {b} overlap in memory; they must be separate buffers")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.nbytes == b.nbytes


def adam_step(
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
    """One fused Adam/AdamW update of a contiguous buffer, in place, in one pass.

    Per element: ``g = grads * grad_scale`` (unscale x clip factor); AdamW decays
    ``params *= 1 - lr*weight_decay`` (``adamw_mode=True``) or Adam adds
    ``weight_decay * params`` to ``g`` (L2, ``adamw_mode=False``); then the moments and
    the bias-corrected update exactly as ``torch.optim.AdamW`` / ``Adam`` compute them in
    fp32. When ``out`` (bf16 or fp16, same numel) is given, it receives the updated
    params rounded to nearest even, like ``params.to(out.dtype)``.

    Low-precision state (exact definitions in ``zerofn.optim.lowp``, which
    ``reference_adam_step`` reproduces bit for bit): bf16 ``params`` are masters rounded
    stochastically; ``exp_avg``/``exp_avg_sq`` may both be bf16 (stochastic rounding)
    or both uint8 blockwise codes, each with its fp32 scale tensor (one per 256
    elements from the buffer's start), updated in place. The random bits depend on
    ``seed``, ``step`` and the element's index only, not on threads or ISA.

    Args:
        params: fp32 or bf16 CPU contiguous buffer.
        grads: fp32, bf16 or fp16, same numel; read only.
        exp_avg, exp_avg_sq: same numel, both fp32, both bf16 or both uint8.
        step: the number of this update, counting from 1 (bias correction).
        grad_scale: multiplies every gradient before anything else.
        out: optional low-precision copy of the updated params (e.g. for the device);
            may be ``grads`` itself (same memory and dtype size), overwritten in one pass.
        exp_avg_scale, exp_avg_sq_scale: fp32 scales of uint8 moments, ceil(n/256) each.
        seed: stochastic rounding's seed, an int in [0, 2**64).
    """
    c = native()
    n = params.numel()
    _check_buffer("params", params, tuple(_PARAM_DTYPES))
    _check_buffer("grads", grads, tuple(_GRAD_DTYPES), n)
    _check_buffer("exp_avg", exp_avg, tuple(_STATE_DTYPES), n)
    _check_buffer("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n)
    if out is not None:
        _check_buffer("out", out, tuple(_OUT_DTYPES), n)
    quantized = exp_avg.dtype == torch.uint8
    _check_scales(quantized, n, exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale)
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    # out may be grads itself: each element's gradient is read before its row is written
    # (offload's host ring steps a unit's gradients into its updated rows in place).
    in_place = out is not None and _same_memory(out, grads)
    _check_distinct(params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                    out=None if in_place else out, exp_avg_scale=exp_avg_scale,
                    exp_avg_sq_scale=exp_avg_sq_scale)
    codes = (lowp._code(True), lowp._code(False)) if quantized else None
    c.adam_step(
        params.data_ptr(), grads.data_ptr(), getattr(c, _GRAD_DTYPES[grads.dtype]),
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if out is None else out.data_ptr(),
        c.DTYPE_NONE if out is None else getattr(c, _OUT_DTYPES[out.dtype]),
        n, int(step), float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), bool(adamw_mode), float(grad_scale),
        getattr(c, _PARAM_DTYPES[params.dtype]), getattr(c, _STATE_DTYPES[exp_avg.dtype]),
        exp_avg_scale.data_ptr() if quantized else 0,
        exp_avg_sq_scale.data_ptr() if quantized else 0, int(seed),
        codes[0].data_ptr() if quantized else 0, codes[1].data_ptr() if quantized else 0,
    )  # fmt: skip


def _check_scales(quantized: bool, n: int, **scales) -> None:
    """uint8 moments need both fp32 scale tensors of ceil(n/256); others take none."""
    blocks = -(-n // lowp.QUANT_BLOCK)
    for name, t in scales.items():
        if not quantized:
            if t is not None:
                raise ValueError(f"{name} is only for uint8 (8-bit) exp_avg/exp_avg_sq")
            continue
        if t is None:
            raise ValueError(f"uint8 exp_avg/exp_avg_sq need {name} (fp32, {blocks} elements)")
        _check_buffer(name, t, (torch.float32,))
        if t.numel() != blocks:
            raise ValueError(f"{name} has {t.numel()} elements; {n} elements need {blocks} "
                             f"(one per {lowp.QUANT_BLOCK})")  # fmt: skip


def grad_sumsq_and_finite(grads: torch.Tensor) -> tuple[float, bool]:
    """``(sum of squares, every element finite)`` of a gradient buffer in one read.

    The sum is accumulated in double (no overflow for any fp32 value), so
    ``math.sqrt(sumsq)`` is the buffer's L2 norm; sums of several buffers (or ranks)
    add up to the global norm's square. ``finite`` is False if any element is inf or
    NaN, whatever the sum says.
    """
    c = native()
    _check_buffer("grads", grads, tuple(_GRAD_DTYPES))
    sumsq, finite = c.grad_sumsq_and_finite(
        grads.data_ptr(), getattr(c, _GRAD_DTYPES[grads.dtype]), grads.numel()
    )
    return sumsq, finite


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor: ``min(1, max_norm / (norm + 1e-6))``."""
    if not math.isfinite(total_norm):
        raise ValueError(f"gradient norm is {total_norm}; skip the step instead of clipping")
    return min(1.0, max_norm / (total_norm + 1e-6))


def adam_roofline(
    params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
) -> None:
    """Adam's memory traffic with trivial arithmetic: the yardstick of benchmarks.

    Reads all four fp32 buffers and writes three (28 bytes per element), adding
    ``1e-7 * grads`` to each; same threads, vector width and loop shape as adam_step.
    """
    c = native()
    n = params.numel()
    for name, t in (("params", params), ("grads", grads), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):  # fmt: skip
        _check_buffer(name, t, (torch.float32,), n)
    _check_distinct(params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    c.adam_roofline(params.data_ptr(), grads.data_ptr(), exp_avg.data_ptr(),
                    exp_avg_sq.data_ptr(), n)  # fmt: skip


def kernel_info() -> dict:
    """Build and run-time facts: ISA in use, ISAs available, OpenMP threads, arch."""
    c = native()
    return dict(c.build_info(), isa=c.isa(), available_isas=c.available_isas(),
                threads=c.max_threads())  # fmt: skip


def set_isa(name: str) -> None:
    """Force the kernels' instruction set ('avx512', 'avx2', 'generic'); for tests."""
    native().set_isa(name)
