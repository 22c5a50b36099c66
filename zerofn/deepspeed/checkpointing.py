"""DeepSpeed's activation-checkpointing calls (``deepspeed.checkpointing``) on torch's.

A model written for DeepSpeed calls ``configure(mpu, deepspeed_config=...)`` once and
``checkpoint(function, *args)`` around the blocks whose activations it recomputes. Here
``checkpoint`` is torch's non-reentrant ``torch.utils.checkpoint.checkpoint``; with the
config's ``activation_checkpointing.cpu_checkpointing`` the saved inputs of each
checkpointed block are kept in host memory and moved back for the recomputation, as
DeepSpeed's ``cpu_checkpointing`` does. The section's other keys (partitioning across
model-parallel ranks, contiguous buffers, synchronization, profiling) mean nothing here
and are reported by ``from_deepspeed_config``.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .config import activation_checkpointing, load_config

__all__ = ["configure", "is_configured", "checkpoint"]

_state = {"configured": False, "cpu_checkpointing": False}


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    """Read ``activation_checkpointing`` from ``deepspeed_config`` (a dict or JSON path);
    ``checkpoint_in_cpu`` overrides its ``cpu_checkpointing``. The other arguments are
    DeepSpeed's and have no effect here."""
    section = activation_checkpointing(load_config(deepspeed_config)
                                       if deepspeed_config is not None else {})
    if checkpoint_in_cpu is not None:
        section["cpu_checkpointing"] = checkpoint_in_cpu
    _state.update(configured=True, cpu_checkpointing=bool(section["cpu_checkpointing"]))


def is_configured() -> bool:
    """Whether ``configure`` has been called."""
    return _state["configured"]


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in backward instead of kept.

    Example:
        >>> x = checkpoint(block, x)
    """
    if not _state["cpu_checkpointing"]:
        return torch_checkpoint(function, *args, use_reentrant=False)
    devices = [a.device if torch.is_tensor(a) else None for a in args]
    on_host = [a.to("cpu") if torch.is_tensor(a) else a for a in args]

    def on_device(*host_args):
        return function(*(a.to(d) if d is not None else a for a, d in zip(host_args, devices)))

    return torch_checkpoint(on_device, *on_host, use_reentrant=False)
