"""fp16's loss scaling, as a function of the model: what backward must be given."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime import runtime_of
from .plain import plain_model


def scale_loss(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The loss to call ``backward()`` on: under ``mixed_precision(torch.float16)`` (or a
    static ``loss_scale``) the loss in fp32 times the current scale, as DeepSpeed scales
    it (an fp16 loss times 2**16 would itself be inf); otherwise ``loss`` itself, so one
    loop serves every precision.

    Call it on every backward, as ``torch.amp.GradScaler.scale``; the step unscales (and a
    step whose gradients overflowed is skipped on every rank, the scale lowered).

    Example:
        >>> zf.scale_loss(model, loss).backward()
        >>> opt.step()
    """
    if plain_model(model) is not None:    # (zf.auto's stage 0 trains in fp32)
        return loss
    scaler = runtime_of(model).scaler
    return loss if scaler is None else loss.float() * scaler.scale
