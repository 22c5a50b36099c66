"""Global gradient-norm clipping across shards."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime import runtime_of
from .plain import clip_grad_norm_ as clip_plain, plain_model


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the model's gradients by their global norm, as
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would on the unsharded model.

    Call on every rank after backward and before ``optimizer.step()``. Under offload with
    Adam the clip coefficient is not applied to the host gradients but folded into the
    step's Adam kernel (runtime/step_grads.py, [Note: deferred scaling]).

    Args:
        model: a model transformed by zerofn (or ``zf.auto``'s stage 0: DDP's, whose
            reduced gradients torch's own clip takes).
        max_norm: the largest global norm the gradients may have.
        norm_type: the norm's order (``float("inf")`` for the largest magnitude).
        error_if_nonfinite: raise if the total norm is inf or nan.

    Returns:
        The total norm of the (unscaled) gradients before clipping, on the model's device.

    Example:
        >>> loss.backward()
        >>> zf.clip_grad_norm_(model, 1.0)
        >>> opt.step()
    """
    if plain_model(model) is not None:
        return clip_plain(model, max_norm, float(norm_type), error_if_nonfinite)
    return runtime_of(model).clip_grad_norm(max_norm, float(norm_type), error_if_nonfinite)
