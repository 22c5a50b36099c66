"""Homes: where each unit's master rows and optimizer state live, behind one interface
(``Home``, base.py): on the device (device.py), in host memory (host.py, host_lowp.py for
fewer bits) or in a swap file (nvme.py), each unit in one of them (composed.py routes), the
map chosen by assignment.py. The runtime chooses once, here, and never asks again."""
from __future__ import annotations

import torch

from ...core.plan import HOMES
from ..chain import members_of
from ..owned import is_whole
from .base import ALIGN, FlatBuffers, HomeSpec, HostArena, Home, cpu_adam_steps
from .device import DeviceHome
from .composed import Homes
from .host import HostHome
from .host_lowp import LowpHostHome
from .nvme import NvmeHome
from .nvme_file import nvme_problems, state_bytes, swap_bytes
from .stored import StoredForm
from .assignment import in_parameter_order, placement_problems, homes_of

__all__ = ["ALIGN", "DeviceHome", "FlatBuffers", "Home", "HomeSpec", "Homes", "HostArena", "HostHome",
           "LowpHostHome", "NvmeHome", "auto_problems", "cpu_adam_steps", "form_of",
           "HostCosts", "in_parameter_order", "make_homes", "offload_problems",
           "optimizer_problems"]


def offload_problems(policy, optimizer, units, param_dtypes: dict, order: dict) -> list[str]:
    """What stops the offload ``policy`` asks for: checked on every rank before any
    collective. ``order``: the model's parameters' indices (which units stay, assignment.py).
    ``optimizer``: where the transform was given one (else None: ``optimizer_problems``
    checks it once it is found)."""
    problems = lowp_problems(policy, units)
    problems += placement_problems(units, policy)
    if problems or policy.device is None:
        return problems
    cpu_adam = optimizer is None or cpu_adam_steps(optimizer)
    try:
        where = homes_of(units, policy, order, HostCosts(policy, cpu_adam))
    except ValueError as e:
        return problems + [str(e)]
    swapped = [u for u in units if where[u] == "nvme"]
    if optimizer is not None:
        problems += optimizer_problems(policy, optimizer, bool(swapped))
    if swapped and not problems:
        problems += nvme_problems(policy.path, swap_bytes(swapped, param_dtypes, form_of(policy)),
                                  swapped)
    return problems


def optimizer_problems(policy, optimizer, swapped: bool) -> list[str]:
    """What ``optimizer`` cannot do under the offload ``policy``: state in fewer bits, and
    the swap file (``swapped``: some unit lives there), are Adam's, which zerofn's CPU Adam
    steps."""
    if policy.device is None or cpu_adam_steps(optimizer):
        return []
    name = " + ".join(type(m).__name__ for m in members_of(optimizer))
    lowp = [f"{n}={v}" for n, v in (("state_dtype", policy.state_dtype),
                                     ("master_dtype", policy.master_dtype))
            if v != torch.float32]
    if lowp:
        return [f"offload({', '.join(lowp)}) stores Adam's state, which zerofn's CPU Adam "
                f"steps: use torch.optim.Adam, AdamW or zerofn.optim.CPUAdam (without "
                f"amsgrad), not {name}, or leave the dtypes at fp32."]
    if swapped and not _adam_beside_whole(optimizer):
        return [f"offload('nvme') steps Adam and AdamW only, alone or beside whole-tensor "
                f"optimizers such as Muon and Adafactor (got {name}); use offload('cpu') "
                "for other optimizers (docs/optimizers.md)."]
    return []


def _adam_beside_whole(optimizer) -> bool:
    """One optimizer zerofn's CPU Adam steps (or none) beside whole-tensor ones, whose
    parameters keep their masters in the swap file and their state on the owner
    (owned.py, nvme.py's [Note: owned rows in the file])."""
    members = members_of(optimizer)
    rest = [m for m in members if not is_whole(m)]
    return len(rest) < len(members) and len(rest) <= 1 and all(map(cpu_adam_steps, rest))


def form_of(policy) -> StoredForm:
    """How the host and the swap file store masters and moments (stored.py)."""
    return StoredForm(policy.state_dtype, policy.master_dtype, policy.seed)


class HostCosts:
    """What units cost in host memory under ``policy``, for ratio="auto"'s ``host_budget``
    (assignment.py): a unit on the host holds its stored state (masters and Adam's moments in
    their stored form where zerofn's CPU Adam steps, ``cpu_adam``; masters alone for
    another optimizer, which makes its own state elsewhere) and, where the compute dtype is
    not the masters', a copy of its rows; every offloaded unit's gradients land in a host
    buffer; and once any unit is in the swap file, its staging ring holds
    ``units_in_flight`` of the largest block."""

    def __init__(self, policy, cpu_adam: bool):
        self.form, self.in_flight = form_of(policy), policy.units_in_flight
        self.cpu_adam = cpu_adam

    def on_host(self, unit) -> int:
        """The unit's state and rows on the host (its landing buffer is ``landing``)."""
        master = self.form.master_dtype_of(unit)
        state = self.form.state_bytes(unit) if self.cpu_adam else unit.shard_numel * master.itemsize
        rows = unit.shard_numel * unit.compute_dtype.itemsize if unit.compute_dtype != master else 0
        return state + rows

    @staticmethod
    def landing(unit) -> int:
        return unit.shard_numel * unit.compute_dtype.itemsize

    def staging(self, units) -> int:
        """The swap file's staging ring in host memory, for a file holding ``units``."""
        return self.in_flight * max((state_bytes(u, self.form) for u in units), default=0)


def auto_problems(policy, device, replicated: bool) -> list[str]:
    """What ratio="auto" cannot do, or cannot measure."""
    if policy.ratio != "auto" or policy.device is None:
        return []
    why = []
    if policy.params:
        why.append("it moves optimizer state, and a unit's parameter shard would have to "
                   "move with it: give params=True a number")
    if policy.device == "nvme" and policy.host_budget is None:
        why.append("with NVMe it fills the host up to host_budget first: give host_budget "
                   "(bytes), or a ratio")
    if replicated:
        why.append("under HSDP give a number: the replicas would each measure their own peak")
    if device.type != "cuda" and not isinstance(policy.device_budget, int):
        why.append("on a CPU device the host is the device: give device_budget in bytes")
    return [f"offload(ratio='auto'): {w}." for w in why]


def lowp_problems(policy, units) -> list[str]:
    """Low-precision offloaded state is stepped by zerofn's CPU Adam from fp32 masters'
    values (which optimizer steps is ``optimizer_problems``')."""
    asked = [f"{name}={value}" for name, value in (("state_dtype", policy.state_dtype),
                                                  ("master_dtype", policy.master_dtype))
             if value != torch.float32]
    if not asked or policy.device is None:
        return []
    if all(u.master_dtype in (None, torch.float32) for u in units):
        return []
    return [f"offload({', '.join(asked)}) needs fp32 masters (their values): add "
            "zf.mixed_precision(torch.bfloat16), whose masters are fp32 whatever the model's "
            "dtype."]


def make_homes(spec: HomeSpec, units, order: dict, sharded, per_unit: bool) -> Home:
    """The home of every unit's state under ``spec.policy`` (assignment.py chooses each unit's):
    one home, or ``Homes`` over several. ``order``: parameter name -> index in the model;
    ``sharded``: ZeRO-3's sharded units; ``per_unit``: the device steps one unit at a time."""
    policy = spec.policy
    where = homes_of(units, policy, order, HostCosts(policy, spec.adam))
    of = {t: [u for u in units if u.slots and where[u] == t] for t in HOMES}
    # (a device home exists under ratio="auto" even empty: units move into it)
    empty_device = policy.ratio == "auto" or not any(of.values())
    used = [t for t in HOMES if of[t] or (t == "device" and empty_device)]
    # Units without parameters (a root whose parameters all live in blocks) hold no
    # state: the first home takes them, so that every unit has one.
    of[used[0]] = of[used[0]] + [u for u in units if not u.slots]
    parts = []
    if "device" in used:
        parts.append(DeviceHome(of["device"], spec, sharded, per_unit))
    if "host" in used:
        lowp = (policy.state_dtype, policy.master_dtype) != (torch.float32, torch.float32)
        parts.append((LowpHostHome if lowp else HostHome)(
            of["host"], spec, policy.ratio == "auto", _rings(policy)))
    if "nvme" in used:
        parts.append(NvmeHome(of["nvme"], spec, form_of(policy)))
    return parts[0] if len(parts) == 1 else Homes(parts)


def _rings(policy) -> bool:
    """Whether the host's gradients and updated rows pass through a ring (homes/ring.py):
    not where they must land during backward (the host steps then, under overlap_step),
    where ratio="auto" may move a unit's state to the device, or where the compute rows
    live on the host (params=True: they are the parameter shards)."""
    return not (policy.overlap_step or policy.ratio == "auto" or policy.params)
