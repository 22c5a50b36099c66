"""zerofn.optim: the host-side optimizer step, in C++ (``zerofn._C``).

``CPUAdam`` is a drop-in ``torch.optim.AdamW`` / ``Adam`` for fp32 CPU parameters. The
kernels under it are public for the offload runtime, which steps whole flat per-unit
buffers at once:

``adam_step(params, grads, exp_avg, exp_avg_sq, *, step, lr, ...) -> None``
    (keywords and defaults: ``beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
    adamw_mode=True, grad_scale=1.0, out=None, exp_avg_scale=None, exp_avg_sq_scale=None,
    seed=0``.)
    One fused pass: ``grads * grad_scale``, AdamW (decoupled) or Adam (L2) weight decay,
    moments, bias-corrected update of fp32 ``params`` in place, and when ``out`` (bf16
    or fp16) is given, the updated params rounded to nearest even into it. Grads may be
    fp32, bf16 or fp16. Same arithmetic as torch's single-tensor AdamW in fp32. Params
    may be bf16 masters and the moments bf16 or uint8 blockwise codes (with their
    scales): stochastic rounding / 8-bit encoding, exactly as ``reference_adam_step``.

``grad_sumsq_and_finite(grads) -> (float sumsq, bool finite)``
    Sum of squares (accumulated in double) and an inf/NaN check in one read; add the
    sums of all buffers and ranks, then ``clip_coefficient(sqrt(total), max_norm)``.

``clip_coefficient(total_norm, max_norm) -> float``
    ``min(1, max_norm / (total_norm + 1e-6))``, the factor ``clip_grad_norm_`` applies.

``adam_roofline(params, grads, exp_avg, exp_avg_sq) -> None``
    Adam's memory traffic with trivial arithmetic: the benchmarks' yardstick.

``kernel_info() -> dict``, ``set_isa(name)``
    Which ISA (``avx512``, ``avx2``, ``generic``) and how many OpenMP threads the kernels
    use; forcing a lower ISA is for tests. ``ZEROFN_CPU_ISA`` does the same at start.

Low-precision state (``zerofn.optim.lowp``, docs/cpu_adam.md): ``QUANT_BLOCK`` (256),
``signed_code()`` / ``unsigned_code()`` (the 8-bit dynamic-tree maps of exp_avg /
exp_avg_sq), ``quantize_blockwise(x, signed) -> (codes, scales)``,
``dequantize_blockwise(codes, scales, signed)``, ``round_bf16_stochastic(x, *, seed,
step, stream)`` and ``reference_adam_step`` (the kernels' arithmetic in plain torch).

All buffers must be contiguous CPU tensors of equal numel; violations raise
``TypeError`` / ``ValueError``, and a missing build raises ``RuntimeError`` on first use.
Kernels release the GIL and use as many threads as ``torch.get_num_threads()``.
"""
from zerofn.optim.cpu_adam import CPUAdam
from zerofn.optim.kernels import (
    adam_roofline,
    adam_step,
    clip_coefficient,
    grad_sumsq_and_finite,
    kernel_info,
    set_isa,
)
from zerofn.optim.lowp import (
    QUANT_BLOCK,
    dequantize_blockwise,
    quantize_blockwise,
    reference_adam_step,
    round_bf16_stochastic,
    signed_code,
    unsigned_code,
)

__all__ = [
    "QUANT_BLOCK",
    "CPUAdam",
    "adam_roofline",
    "adam_step",
    "clip_coefficient",
    "dequantize_blockwise",
    "grad_sumsq_and_finite",
    "kernel_info",
    "quantize_blockwise",
    "reference_adam_step",
    "round_bf16_stochastic",
    "set_isa",
    "signed_code",
    "unsigned_code",
]
