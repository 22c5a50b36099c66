"""offload(..., ratio=r): only a share of the optimizer state is offloaded; the rest of
the units keep their masters and optimizer state on the device and step there, while the
host steps its share.

[Note: which units stay] The units whose first parameter comes first in the model's
parameter order stay on the device, up to (1 - r) of the parameters: in a transformer
those are the embeddings and the first blocks, whose gradients arrive last in backward
(so the host has its share's gradients earliest) and whose parameters the next forward
needs first (so they are refreshed on the device, with no copy up, before anything
else). DeepSpeed's Twin-Flow keeps the first sub-groups in parameter order the same way.

The device share steps Adam and AdamW in torch's own single-tensor arithmetic on the
device (other optimizers step its masters themselves, as they step the host's), queued
before the host's step so that on a GPU both run at once. Checkpoints do not see the
split: state dicts hold the same keys and shapes whatever the ratio, so a checkpoint
saved at one ratio loads at another.
"""
from __future__ import annotations

import torch

from ...core.units import Unit
from ..timing import UNTIMED
from .adam import adam_unit, groups_by_param
from .base import Offload, cpu_adam_steps, decoupled_weight_decay, rows_into


def in_parameter_order(units, order: dict) -> list:
    """``units`` by their first parameter's place in the model ([Note: which units stay])."""
    return sorted(units, key=lambda u: min(order.get(s.param, 0) for s in u.slots))


def split_units(units: list[Unit], ratio, order: dict) -> tuple[list, list]:
    """``(offloaded, on the device)``: the device keeps the units first in parameter order
    (``order``: parameter -> index) while they total at most (1 - ratio) of the
    parameters ([Note: which units stay])."""
    sized = [u for u in units if u.slots]
    total = sum(s.numel for u in sized for s in u.slots)
    room = 0 if ratio == "auto" else (1 - ratio) * total     # (auto: placed after a step)
    device = []
    for u in in_parameter_order(sized, order):
        n = sum(s.numel for s in u.slots)
        if n > room:
            break
        device.append(u)
        room -= n
    return [u for u in units if u not in device], device


class DeviceShare(Offload):
    """The units that keep their masters (and Adam's state) on the device: what
    ``offload`` would hold for them, held in device memory instead."""

    def __init__(self, units, grad_dtype_of, optimizer, device, timing=UNTIMED):
        self.timing, self.units, self.device = timing, list(units), device
        self.cpu_adam = cpu_adam_steps(optimizer)
        self.decoupled = decoupled_weight_decay(optimizer)
        self.master = {u: torch.zeros(u.shard_numel, dtype=u.master_dtype, device=device)
                       for u in units}
        self.grads = {u: torch.zeros(u.shard_numel, dtype=grad_dtype_of(u), device=device)
                      for u in units}
        self.exp_avg: dict = {}
        self.exp_avg_sq: dict = {}
        self.shards: dict = {}     # ZeRO-3 params=True: the compute shards, on the device

    def arenas(self) -> list:
        return []

    def place_masters(self, unit: Unit, keep: bool) -> torch.Tensor:
        return rows_into(unit, self.master[unit])

    def param_shard(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """Parameter offload leaves these units' shards on the device."""
        shard = self.master[unit] if dtype == unit.master_dtype else self.master[unit].to(dtype)
        self.shards[unit] = shard
        return shard

    def register_state(self, optimizer) -> None:
        """Adam's state as device tensors (its ``step`` on the host, as torch keeps it); a
        torch optimizer makes its own, next to the masters."""
        if not self.cpu_adam:
            return
        self.exp_avg.update({u: torch.zeros_like(self.master[u]) for u in self.units})
        self.exp_avg_sq.update({u: torch.zeros_like(self.master[u]) for u in self.units})
        for u in self.units:
            for s in u.trainable:
                before = optimizer.state.get(s.opt_param, {})
                state = {"step": torch.zeros((), dtype=torch.float32),
                         "exp_avg": s.shard_of(self.exp_avg[u]),
                         "exp_avg_sq": s.shard_of(self.exp_avg_sq[u])}
                for k, value in before.items():   # state the optimizer had (a load) moves in
                    state[k].copy_(value)
                optimizer.state[s.opt_param] = state

    @torch.no_grad()
    def adopt(self, unit: Unit, optimizer, grad_dtype: torch.dtype) -> None:
        """Take ``unit`` over from the offload: its masters and Adam's moments, as the
        optimizer shows them, copied to the device, and the optimizer's tensors moved
        there in place (``.data``: the optimizer's keys keep their identity)."""
        master = torch.zeros(unit.shard_numel, dtype=unit.master_dtype, device=self.device)
        for s in unit.slots:
            s.shard_of(master).copy_(s.opt_param)
            s.opt_param.data = s.shard_of(master)
        self.master[unit] = master
        self.grads[unit] = torch.zeros(unit.shard_numel, dtype=grad_dtype, device=self.device)
        if self.cpu_adam:
            moments = (torch.zeros_like(master), torch.zeros_like(master))
            for s in unit.trainable:
                state = optimizer.state[s.opt_param]
                for key, flat in zip(("exp_avg", "exp_avg_sq"), moments):
                    state[key] = s.shard_of(flat).copy_(state[key])
            self.exp_avg[unit], self.exp_avg_sq[unit] = moments
        self.units.append(unit)

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None) -> None:
        group_of = groups_by_param(optimizer)
        for u in self.units:
            adam_unit(optimizer, group_of, u, grads, self.master[u], self.exp_avg[u],
                      self.exp_avg_sq[u], self.decoupled, None, grad_scale, on_device=True)
            after_unit(u, self.updated_rows(u))

    def updated_rows(self, unit: Unit) -> torch.Tensor:
        return self.master[unit]

    def compute_copies(self) -> list[torch.Tensor]:
        return [t for u, t in self.shards.items() if t is not self.master[u]]


class SplitOffload(Offload):
    """An offload (host or NVMe) for most units and a ``DeviceShare`` for the rest, as one
    ``Offload``: each call goes to the part that holds the unit."""

    def __init__(self, host: Offload, device: DeviceShare):
        self.host, self.device = host, device
        self.part = {u: device for u in device.units}
        self.grads = {**host.grads, **device.grads}
        self.cpu_adam = host.cpu_adam
        self.ring = host.ring
        self.param_reader = host.param_reader
        self.time_series = host.time_series
        self.timing = host.timing

    def staying(self) -> list[Unit]:
        return list(self.device.units)

    def move(self, units, optimizer) -> None:
        """Move ``units`` from the offload to the device, state and all (ratio="auto");
        the offload gives their host memory back."""
        self.host.materialize(optimizer)
        for u in units:
            self.device.adopt(u, optimizer, self.host.grads[u].dtype)
            self.part[u] = self.device
            self.grads[u] = self.device.grads[u]
        self.host.release(units)

    def steps_early(self, unit) -> bool:
        return unit not in self.part and self.host.steps_early(unit)

    def step_unit(self, optimizer, unit, grads: dict) -> None:
        self.host.step_unit(optimizer, unit, grads)

    def attach_early(self, early) -> None:
        self.host.attach_early(early)

    def _of(self, unit) -> Offload:
        return self.part.get(unit, self.host)

    def arenas(self) -> list:
        return self.host.arenas()

    def place_masters(self, unit, keep: bool):
        return self._of(unit).place_masters(unit, keep)

    def param_shard(self, unit, dtype: torch.dtype) -> torch.Tensor:
        return self._of(unit).param_shard(unit, dtype)

    def register_state(self, optimizer) -> None:
        self.host.register_state(optimizer)
        self.device.register_state(optimizer)

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None) -> None:
        """The device's share first: on a GPU its kernels run while the host steps."""
        self.device.step(optimizer, grads, after_unit, grad_scale, copies)
        self.host.step(optimizer, grads, after_unit, grad_scale, copies)

    def updated_rows(self, unit):
        return self._of(unit).updated_rows(unit)

    def exact_dtypes(self, unit) -> tuple[torch.dtype, torch.dtype]:
        return self._of(unit).exact_dtypes(unit)

    def recast(self) -> None:
        self.host.recast()

    def materialize(self, optimizer) -> None:
        self.host.materialize(optimizer)

    def compute_copies(self) -> list[torch.Tensor]:
        return self.host.compute_copies() + self.device.compute_copies()

    def state_buffers(self) -> list[torch.Tensor]:
        return self.host.state_buffers()

    def unseen_bytes(self) -> dict[str, dict[str, int]]:
        return self.host.unseen_bytes()
