"""CPUAdam: torch.optim.AdamW / Adam stepped by zerofn's fused C++ kernels."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from itertools import chain

import torch

from zerofn.optim import kernels, lowp

# Keys torch.optim.Adam(W) keeps in every param group. Storing them lets a CPUAdam
# state_dict load into torch's optimizers and back without a translation step.
_TORCH_GROUP_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over fp32 CPU parameters, one fused C++ pass per parameter.

    A drop-in for ``torch.optim.AdamW`` (``adamw_mode=True``, the default) or
    ``torch.optim.Adam`` with L2 weight decay (``adamw_mode=False``): same constructor,
    same update in fp32 (to about one ulp), same state names (``step``, ``exp_avg``,
    ``exp_avg_sq``), so state dicts move between them both ways. The weight-decay mode
    is kept in each group as torch's ``decoupled_weight_decay`` key.

    Beyond ``step()``, it fuses the rest of a mixed-precision step into the same pass:
    ``step(grad_scale=...)`` multiplies gradients on the fly (loss-scale unscale x clip
    factor), ``lowp_out={param: bf16_or_fp16_tensor}`` receives the updated params
    rounded for the device, and ``clip_and_step`` adds global-norm clipping and overflow
    skipping at the cost of one extra read of the gradients.

    Parameters must be fp32 or bf16, on the CPU and contiguous; gradients fp32, bf16 or
    fp16 of the same shape, contiguous. Anything else raises instead of running a slow
    path. bf16 parameters are bf16 masters, updated with stochastic rounding
    (``master_dtype``, if given, must name the parameters' dtype).

    ``state_dtype`` stores the moments as ``torch.float32`` (torch's layout),
    ``torch.bfloat16`` (stochastic rounding) or ``torch.int8`` (8-bit blockwise codes:
    ``exp_avg`` / ``exp_avg_sq`` hold uint8 codes, ``exp_avg_scale`` /
    ``exp_avg_sq_scale`` one fp32 scale per 256 elements; parameters of fewer than
    4096 elements keep fp32 moments, as bitsandbytes' and torchao's do); see
    docs/cpu_adam.md.
    Stochastic rounding draws counter-based bits from ``seed``, the parameter's index
    in the optimizer and the step, so a resumed run rounds exactly as the original.
    ``state_dict()`` holds fp32 moments (torch's format; ``raw=True`` keeps the stored
    codes and scales for a bit-identical resume), and ``load_state_dict`` converts
    either to the configured dtype.

    Example:
        >>> opt = CPUAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        adamw_mode: bool = True,
        maximize: bool = False,
        state_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        if amsgrad or maximize:
            raise ValueError("CPUAdam does not implement amsgrad or maximize; use torch.optim.AdamW")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be torch.float32, torch.bfloat16 or torch.int8 "
                             f"(8-bit blockwise codes); got {state_dtype}")  # fmt: skip
        if master_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype}")
        if not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
        self.state_dtype, self.master_dtype, self.seed = state_dtype, master_dtype, int(seed)
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        kernels.native()  # fail here, not at the first step, when the build is missing
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=adamw_mode, **_TORCH_GROUP_FLAGS)  # fmt: skip
        super().__init__(params, defaults)
        for p in self._params():
            _check_param(p, master_dtype)

    def _params(self) -> list:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_GROUP_FLAGS.items():
                group.setdefault(key, value)
            group.setdefault("decoupled_weight_decay", False)  # torch.optim.Adam's default
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("cannot load a state with amsgrad or maximize into CPUAdam")

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: float = 1.0,
        lowp_out: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ):
        """One update of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss, as in torch.
            grad_scale: multiplies every gradient first (e.g. clip_coef / loss_scale).
            lowp_out: maps a parameter to a bf16/fp16 tensor of its shape that receives
                the updated values, rounded to nearest even (the device's compute copy).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._state_for(p)
                state["step"] += 1
                kernels.adam_step(
                    p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"],
                    step=int(state["step"].item()), lr=float(group["lr"]), beta1=beta1,
                    beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    adamw_mode=group["decoupled_weight_decay"], grad_scale=grad_scale,
                    out=None if lowp_out is None else lowp_out.get(p),
                    exp_avg_scale=state.get("exp_avg_scale"),
                    exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
                    seed=self._param_seed(index - 1),
                )  # fmt: skip
        return loss

    def _param_seed(self, index: int) -> int:
        """A distinct stochastic-rounding seed per parameter (its index in the
        optimizer); the kernel mixes in the step."""
        return (self.seed + index * 0x9E3779B97F4A7C15) % 2**64

    @torch.no_grad()
    def grad_norm_and_finite(self, grad_scale: float = 1.0) -> tuple[float, bool]:
        """Global L2 norm of ``grad_scale * grads`` and whether every gradient is finite.

        One read of each gradient (C++ kernel, sums in double). The norm is ``inf`` when
        a gradient is not finite.
        """
        total, finite = 0.0, True
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    sumsq, ok = kernels.grad_sumsq_and_finite(p.grad)
                    total, finite = total + sumsq, finite and ok
        if not finite:
            return math.inf, False
        return math.sqrt(total) * abs(grad_scale), True

    @torch.no_grad()
    def clip_and_step(
        self,
        max_norm: float | None,
        *,
        loss_scale: float = 1.0,
        lowp_out: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[float, bool]:
        """Unscale, clip to ``max_norm`` (global L2, like ``clip_grad_norm_``), step.

        Gradients are read twice in all (norm, then the fused step), never written.
        With a non-finite gradient the step is skipped and nothing changes, as
        ``torch.amp.GradScaler`` does.

        Returns:
            ``(norm of the unscaled gradients, whether the step ran)``.
        """
        norm, finite = self.grad_norm_and_finite(1.0 / loss_scale)
        if not finite:
            return norm, False
        coef = 1.0 if max_norm is None else kernels.clip_coefficient(norm, max_norm)
        self.step(grad_scale=coef / loss_scale, lowp_out=lowp_out)
        return norm, True

    def state_dict(self, raw: bool = False) -> dict:
        """torch's format: fp32 ``exp_avg`` / ``exp_avg_sq`` of the parameters' shapes
        (8-bit codes decoded, bf16 widened), loadable by ``torch.optim.AdamW``. With
        ``raw=True``, the moments as stored (uint8 codes with their fp32 scales, or
        bf16): what a bit-identical resume at the same ``state_dtype`` needs."""
        sd = super().state_dict()
        if not raw:
            sd["state"] = {i: _state_to_fp32(s) for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads torch's format (fp32 moments, as from ``torch.optim.AdamW``) or a
        ``state_dict(raw=True)``, converting the moments to this optimizer's
        ``state_dtype`` (8-bit: re-encoded blockwise; bf16: rounded to nearest)."""
        saved = state_dict["state"]
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        by_param = {p: saved[i] for i, p in zip(ids, self._params()) if i in saved}
        super().load_state_dict(state_dict)  # torch casts the moments to the param dtype
        for p, s in by_param.items():
            loaded = self.state[p]
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
                loaded.pop(key, None)
            loaded.update(_convert_moments(s, p, self.state_dtype))

    def _state_for(self, p: torch.Tensor) -> dict:
        """Torch's lazily created state, with the same names and layout; moments in
        ``state_dtype`` (zero, or for 8-bit, the code of zero with zero scales)."""
        _check_param(p, self.master_dtype)
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            zeros = torch.zeros(p.shape, dtype=torch.float32)
            state.update(_convert_moments({"exp_avg": zeros, "exp_avg_sq": zeros}, p,
                                          self.state_dtype))  # fmt: skip
        elif not torch.is_tensor(state["step"]):  # e.g. loaded from DeepSpeed (an int)
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        return state


_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_MOMENTS = (("exp_avg", "exp_avg_scale", True), ("exp_avg_sq", "exp_avg_sq_scale", False))


def _moments_fp32(state: dict) -> dict:
    """A state's moments as fp32 of their stored shape, whatever they are stored as."""
    out = {}
    for key, scale, signed in _MOMENTS:
        t = state[key]
        if t.dtype == torch.uint8:
            out[key] = lowp.dequantize_blockwise(t, state[scale], signed).view(t.shape)
        else:
            out[key] = t.float()
    return out


def _state_to_fp32(state: dict) -> dict:
    if "exp_avg" not in state:
        return state
    rest = {k: v for k, v in state.items() if k not in ("exp_avg_scale", "exp_avg_sq_scale")}
    return {**rest, **_moments_fp32(state)}


def _convert_moments(state: dict, p: torch.Tensor, state_dtype: torch.dtype) -> dict:
    """exp_avg / exp_avg_sq (and scales) in state_dtype for parameter p, from stored
    moments of any kind: kept as they are when already in that form (a raw resume)."""
    src = state["exp_avg"]
    state_dtype = lowp.moment_dtype(state_dtype, p.numel())
    if state_dtype == torch.int8 and src.dtype == torch.uint8:
        return {k: state[k].clone() for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale",
                                             "exp_avg_sq_scale")}  # fmt: skip
    moments = _moments_fp32(state)
    out = {}
    for key, scale, signed in _MOMENTS:
        x = moments[key].reshape(p.shape)
        if state_dtype == torch.int8:
            codes, scales = lowp.quantize_blockwise(x.reshape(-1).contiguous(), signed)
            out[key], out[scale] = codes.view(p.shape), scales
        else:
            out[key] = x.to(state_dtype, copy=True).contiguous()  # never shared
    return out


def _check_param(p: torch.Tensor, master_dtype: torch.dtype | None = None) -> None:
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"CPUAdam steps fp32 CPU parameters (or bf16 masters); got {p.dtype} on {p.device}. Keep "
            "a host master copy (zerofn.offload does) or use torch.optim.AdamW."
        )
    if master_dtype is not None and p.dtype != master_dtype:
        raise ValueError(f"master_dtype={master_dtype} but a parameter is {p.dtype}; the "
                         "parameters are the masters, so the two must agree")  # fmt: skip
    if not p.is_contiguous():
        raise ValueError("CPUAdam needs contiguous parameters; got a strided view")
    if p.grad is not None and p.grad.is_sparse:
        raise ValueError("CPUAdam does not support sparse gradients")
