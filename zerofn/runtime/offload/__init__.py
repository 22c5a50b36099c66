"""Offload: master rows and optimizer state off the device, behind one interface
(``Offload``, base.py): in host memory (host.py, host_lowp.py for fewer bits) or in a swap
file (nvme.py), for all units or, with ``ratio``, for a share of them (split.py). The
runtime chooses once, here, and never asks again."""
from __future__ import annotations

import torch

from .base import ALIGN, HostArena, Offload, cpu_adam_steps
from .host import HostOffload
from .host_lowp import LowpHostOffload
from .nvme import NvmeOffload
from .nvme_file import nvme_problems, swap_bytes
from .split import DeviceShare, SplitOffload, split_units
from .stored import StoredForm

__all__ = ["ALIGN", "HostArena", "HostOffload", "LowpHostOffload", "NvmeOffload", "Offload",
           "auto_problems", "cpu_adam_steps", "make_offload", "offload_problems",
           "split_units"]


def offload_problems(policy, optimizer, units, param_dtypes: dict, compute_dtype,
                     order: dict) -> list[str]:
    """What stops the offload ``policy`` asks for: checked on every rank before any
    collective. ``order``: the model's parameters' indices (which units stay, split.py)."""
    problems = lowp_problems(policy, optimizer, units, compute_dtype)
    if policy.device == "nvme":
        host, _ = split_units(units, policy.ratio, order)
        problems += nvme_problems(policy.path, swap_bytes(host, param_dtypes, form_of(policy)),
                                  optimizer, units)
    return problems


def form_of(policy) -> StoredForm:
    """How the offload stores masters and moments (stored.py)."""
    return StoredForm(policy.state_dtype, policy.master_dtype, policy.seed)


def auto_problems(policy, device, replicated: bool) -> list[str]:
    """What ratio="auto" cannot do yet, or cannot measure."""
    if policy.ratio != "auto" or policy.device is None:
        return []
    why = []
    if policy.device != "cpu" or policy.params or (policy.state_dtype, policy.master_dtype) != (
            torch.float32, torch.float32):
        why.append("it moves offload('cpu')'s fp32 state; the swap file, parameter offload "
                   "and state in fewer bits take a number")
    if replicated:
        why.append("under HSDP give a number: the replicas would each measure their own peak")
    if device.type != "cuda" and not isinstance(policy.device_budget, int):
        why.append("on a CPU device the host is the device: give device_budget in bytes")
    return [f"offload(ratio='auto'): {w}." for w in why]


def lowp_problems(policy, optimizer, units, compute_dtype) -> list[str]:
    """Low-precision offloaded state is stepped by zerofn's CPU Adam from fp32 masters'
    values."""
    asked = [f"{name}={value}" for name, value in (("state_dtype", policy.state_dtype),
                                                  ("master_dtype", policy.master_dtype))
             if value != torch.float32]
    if not asked or policy.device is None:
        return []
    what = f"offload({', '.join(asked)})"
    problems = []
    if not cpu_adam_steps(optimizer):
        problems.append(f"{what} stores Adam's state, which zerofn's CPU Adam steps: use "
                        f"torch.optim.Adam, AdamW or zerofn.optim.CPUAdam (without amsgrad), "
                        f"not {type(optimizer).__name__}, or leave the dtypes at fp32.")
    if any(u.master_dtype not in (None, torch.float32) for u in units):
        problems.append(f"{what} needs fp32 masters (their values): add "
                        "zf.mixed_precision(torch.bfloat16), whose masters are fp32 whatever "
                        "the model's dtype.")
    if policy.master_dtype == torch.bfloat16 and compute_dtype != torch.bfloat16:
        problems.append(f"{what}: bf16 masters are the rows the device computes with, so the "
                        "compute dtype must be bf16: add zf.mixed_precision(torch.bfloat16).")
    return problems


def make_offload(policy, units, optimizer, grad_dtype_of, param_dtypes: dict,
                 rank: int, timing, order: dict, device) -> Offload | None:
    """The offload ``policy`` names (None where it names none), timed by ``timing``.
    ``rank``, the global one, names NVMe's swap file: HSDP's replicas share shard ranks.
    ``order`` (parameter -> index in the model) decides which units stay on ``device``
    under ``ratio`` < 1."""
    if policy.device is None:
        return None
    offloaded, staying = split_units(units, policy.ratio, order)
    params = {u: dtype for u, dtype in param_dtypes.items() if u in offloaded}
    host = _offload_of(policy, offloaded, optimizer, grad_dtype_of, params, rank, timing)
    if not staying and policy.ratio != "auto":
        return host
    return SplitOffload(host, DeviceShare(staying, grad_dtype_of, optimizer, device, timing))


def _offload_of(policy, units, optimizer, grad_dtype_of, param_dtypes, rank,
                timing) -> Offload:
    if policy.device == "nvme":
        return NvmeOffload(units, optimizer, policy.path, rank, policy.units_in_flight,
                           grad_dtype_of, param_dtypes, timing, form_of(policy))
    if (policy.state_dtype, policy.master_dtype) != (torch.float32, torch.float32):
        return LowpHostOffload(units, grad_dtype_of, optimizer, timing,
                               ring=_rings(policy), state_dtype=policy.state_dtype,
                               master_dtype=policy.master_dtype, seed=policy.seed)
    return HostOffload(units, grad_dtype_of, optimizer, timing,
                       per_unit=policy.ratio == "auto", ring=_rings(policy))


def _rings(policy) -> bool:
    """Whether the host's gradients and updated rows pass through a ring (offload/ring.py):
    not where they must land during backward (the host steps then, under overlap_step),
    where ratio="auto" may move a unit's landing buffer to the device, or where the
    compute rows live on the host (params=True: they are the parameter shards)."""
    return not (policy.overlap_step or policy.ratio == "auto" or policy.params)
