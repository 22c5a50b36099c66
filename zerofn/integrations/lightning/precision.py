"""Lightning's precision flags, trained by zerofn: ``ZeroPrecision`` (Trainer) and
``ZeroFabricPrecision`` (Fabric).

No autocast and no GradScaler: under ``"bf16-mixed"`` and ``"16-mixed"`` zerofn's
``mixed_precision`` holds the compute parameters in the low dtype beside fp32 masters, so
the forward runs in it as written, and fp16's loss scaling, overflow check and skipped
step are zerofn's (its scaler's state rides in the optimizer's state dict, hence in every
checkpoint). ``"bf16-true"`` casts the module itself, as Lightning does; zerofn then
steps bf16 parameters with no masters. Floating inputs are cast to the compute dtype.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalf
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch import nn

import zerofn as zf

from .options import FLAGS

# Lightning's own plugins for the four flags, which the strategies replace by theirs.
LIGHTNING_PLUGINS = (Precision, MixedPrecision, HalfPrecision, FabricPrecision, FabricMixed,
                     FabricHalf)


class _ZeroFlag:
    """What both plugins share: the flag, the module's dtype, inputs and outputs, and fp16's
    loss scale. ``bind`` hands them the transformed module."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in FLAGS:
            raise ValueError(f"precision={precision!r}: zerofn trains with "
                             f"{', '.join(repr(f) for f in FLAGS)}.")
        self.precision = precision
        self.flag = FLAGS[precision]
        self.module: nn.Module | None = None

    def bind(self, module: nn.Module) -> None:
        self.module = module

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.flag.module is None else module.to(dtype=self.flag.module)

    def tensor_init_context(self):
        if self.flag.module is None:
            return contextlib.nullcontext()
        return _DtypeContextManager(self.flag.module)

    def module_init_context(self):
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self.flag.inputs is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=self.flag.inputs)

    def convert_output(self, data: Any) -> Any:
        if self.flag.inputs is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=torch.get_default_dtype())

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: the loss times zerofn's loss scale (the optimizer unscales, checks and
        skips); other flags: the loss."""
        if self.precision != "16-mixed":
            return loss
        return zf.scale_loss(self.module, loss)

    def clip(self, value: float, by_norm: bool, norm_type: float = 2.0,
             error_if_nonfinite: bool = False):
        """By the global norm across shards (zerofn's), or by value as torch clips."""
        if by_norm:
            return zf.clip_grad_norm_(self.module, value, norm_type, error_if_nonfinite)
        return torch.nn.utils.clip_grad_value_(self.module.parameters(), value)

    def state_dict(self) -> dict:
        return {}    # fp16's scaler is in the optimizer's state dict

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class ZeroPrecision(_ZeroFlag, Precision):
    """The Trainer's precision plugin under ``ZeroStrategy``: ``precision=`` of
    ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``, trained by zerofn.

    The strategy puts it in place of Lightning's own plugin for the flag; pass it (or
    Lightning's ``MixedPrecision("16-mixed", "cpu")``) in ``plugins=`` where Lightning
    would rewrite the flag, as it rewrites ``"16-mixed"`` on the CPU into ``"bf16-mixed"``.
    """

    def forward_context(self):
        return contextlib.nullcontext()

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        return super().pre_backward(self.scaled(tensor), module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """The closure (forward and backward), Lightning's hooks and clipping, then
        zerofn's step; none when ``training_step`` returned None (no backward ran)."""
        result = closure()
        if result is None and model.automatic_optimization:
            return None
        self._after_closure(model, optimizer)
        optimizer.step(**kwargs)
        return result

    def clip_gradients(self, optimizer, clip_val=0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if clip_val and clip_val > 0:
            self.clip(float(clip_val), gradient_clip_algorithm == GradClipAlgorithmType.NORM)


class ZeroFabricPrecision(_ZeroFlag, FabricPrecision):
    """Fabric's precision plugin under ``ZeroFabricStrategy`` (see ``ZeroPrecision``)."""

    def forward_context(self):
        return contextlib.nullcontext()

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        self.scaled(tensor).backward(*args, **kwargs)


def zero_precision(plugin, cls):
    """Lightning's plugin for one of the four flags as ``cls`` (ours); anything else is
    refused, naming the flag (every rank builds the same Trainer: none goes on alone)."""
    if plugin is None:
        return cls()
    if isinstance(plugin, cls):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) not in LIGHTNING_PLUGINS or flag not in FLAGS:
        raise ValueError(f"zerofn's Lightning strategy trains with precision "
                         f"{', '.join(repr(f) for f in FLAGS)} (zerofn.mixed_precision); got "
                         f"precision={flag!r} ({type(plugin).__name__}).")
    return cls(flag)
