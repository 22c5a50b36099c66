"""CPUAdam: torch.optim.AdamW / Adam stepped by zerofn's fused C++ kernels."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch

from zerofn.optim import kernels

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

    Parameters must be fp32, on the CPU and contiguous; gradients fp32, bf16 or fp16 of
    the same shape, contiguous. Anything else raises instead of running a slow path.

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
    ) -> None:
        if amsgrad or maximize:
            raise ValueError("CPUAdam does not implement amsgrad or maximize; use torch.optim.AdamW")
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
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

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
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
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
                )  # fmt: skip
        return loss

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

    def _state_for(self, p: torch.Tensor) -> dict:
        """Torch's lazily created state, with the same names, dtypes and layout."""
        _check_param(p)
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif not torch.is_tensor(state["step"]):  # e.g. loaded from DeepSpeed (an int)
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        return state


def _check_param(p: torch.Tensor) -> None:
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(
            f"CPUAdam steps fp32 CPU parameters; got {p.dtype} on {p.device}. Keep an "
            "fp32 host master copy (zerofn.offload does) or use torch.optim.AdamW."
        )
    if not p.is_contiguous():
        raise ValueError("CPUAdam needs contiguous parameters; got a strided view")
    if p.grad is not None and p.grad.is_sparse:
        raise ValueError("CPUAdam does not support sparse gradients")
