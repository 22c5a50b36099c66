"""Offload: master rows and optimizer state off the device, behind one interface
(``Offload``, base.py): in host memory (host.py) or in a swap file (nvme.py). The
runtime chooses the kind once, here, and never asks again."""
from __future__ import annotations

from .base import ALIGN, HostArena, Offload, cpu_adam_steps
from .host import HostOffload
from .nvme import NvmeOffload
from .nvme_file import nvme_problems, swap_bytes

__all__ = ["ALIGN", "HostArena", "HostOffload", "NvmeOffload", "Offload", "cpu_adam_steps",
           "make_offload", "offload_problems"]


def offload_problems(policy, optimizer, units, param_dtypes: dict) -> list[str]:
    """What stops the offload ``policy`` asks for: checked on every rank before any
    collective."""
    if policy.device != "nvme":
        return []
    return nvme_problems(policy.path, swap_bytes(units, param_dtypes), optimizer, units)


def make_offload(policy, units, optimizer, grad_dtype_of, param_dtypes: dict,
                 compute_dtype, rank: int, timing) -> Offload | None:
    """The offload ``policy`` names (None where it names none), timed by ``timing``.
    ``rank``, the global one, names NVMe's swap file: HSDP's replicas share shard ranks."""
    if policy.device == "nvme":
        return NvmeOffload(units, optimizer, policy.path, rank, policy.units_in_flight,
                           grad_dtype_of, param_dtypes, compute_dtype, timing)
    if policy.device == "cpu":
        return HostOffload(units, grad_dtype_of, optimizer, compute_dtype, timing)
    return None
