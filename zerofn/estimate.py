"""Model-state memory per rank before building anything: DESIGN.md §4 as a function."""
from __future__ import annotations

import torch
from torch import nn


def estimate_model_state_bytes(params: int | nn.Module, world: int, stage: int,
                               param_dtype: torch.dtype = torch.bfloat16,
                               master_dtype: torch.dtype = torch.float32,
                               optimizer_states: int = 2) -> dict[str, float]:
    """Bytes of params, grads and optimizer state one rank holds, and their total.

    Args:
        params: a parameter count, or a module whose parameters are counted.
        world: ranks the state is sharded over.
        stage: 0 (replicated, like DDP), 1, 2 or 3.
        param_dtype: compute dtype of params and grads.
        master_dtype: dtype of master params and optimizer state; when it equals
            ``param_dtype`` the params are their own master.
        optimizer_states: tensors of state per param (Adam: 2, SGD momentum: 1).

    Example (DESIGN.md §4, 7B params on 8 ranks, bf16 + Adam, in GB):
        >>> [estimate_model_state_bytes(7e9, 8, s)["total"] / 1e9 for s in range(4)]
        [112.0, 38.5, 26.25, 14.0]
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}.")
    n = sum(p.numel() for p in params.parameters()) if isinstance(params, nn.Module) else params
    compute = param_dtype.itemsize
    master = 0 if master_dtype == param_dtype else master_dtype.itemsize
    out = {
        "params": n * compute / (world if stage >= 3 else 1),
        "grads": n * compute / (world if stage >= 2 else 1),
        "optimizer": n * (master + optimizer_states * master_dtype.itemsize)
        / (world if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out
