"""Global gradient-norm clipping across shards."""
from __future__ import annotations

import torch
from torch import nn

from .runtime.runtime import runtime_of


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the model's gradients by their global norm, as
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would on the unsharded model.

    Call on every rank after backward and before ``optimizer.step()``. Returns the total norm.
    """
    rt = runtime_of(model)
    norm_type = float(norm_type)
    rt.step_grads.prepare()   # reduced, in the master dtype, unscaled
    shards = rt.step_grads.present()
    device = rt.device
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max() for g in shards]).max() if shards \
            else torch.zeros((), device=device)
        total = local.to(device, torch.float32, copy=True)   # offloaded shards: on the host
        rt.comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    else:
        local = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
                     for g in shards), torch.zeros((), device=device))
        total = local.clone()
        rt.comm.all_reduce(total)
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, "
                           "so it cannot be clipped. Pass error_if_nonfinite=False to clip anyway.")
    if rt.step_grads.overflow:
        return total      # the step will be skipped: nothing to clip
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = coef.to(shards[0].device) if shards else coef   # once, where the shards are
    for g in shards:
        g.mul_(coef.to(g.dtype))
    return total
