"""The device home: units whose masters and optimizer state live in device memory, stepped
there by the user's own optimizer.

It is what "no offload" is, and what ``offload``'s ``ratio`` and ``placement`` keep on the
device: one home, whatever chose it (Home's module note). A unit's masters are

- this rank's rows of its whole parameters, where those are the masters already (ZeRO-1/2,
  and ZeRO-3's persistent parameters, computing in the masters' dtype): no copy;
- else a flat buffer of its rows in the masters' dtype (``FlatBuffers``), which a ZeRO-3
  unit computing in that dtype also computes on (shards.py).

The step hands each unit's gradients to the user's optimizer as ``.grad`` of its shard
parameters and calls ``optimizer.step()`` on them, so every elementwise torch.optim
optimizer (fused or foreach kernels included) steps exactly as it would on full tensors;
torch.optim leaves parameters without a gradient alone. Under ZeRO-1/2 with several units
it steps one unit at a time, so each unit's all-gather runs while the next one steps.
Where another home steps with zerofn's CPU Adam, which unscales and clips as it reads,
the gradients here get the same factor first (step_grads.py's [Note: deferred scaling]).
"""
from __future__ import annotations

import torch

from ...core.units import Unit, local_of
from ..optimizer import step_without_hooks
from .base import FlatBuffers, Home, HomeSpec, rows_into


class DeviceHome(Home):
    """The units whose masters and optimizer state live on the device (see the module note).

    Args:
        sharded: ZeRO-3's sharded units (their masters are a flat buffer always).
        per_unit: step one unit at a time (ZeRO-1/2 with several units: each all-gather
            overlaps the next unit's step).
    """

    kind = "device"
    defers_scaling = False     # (the step's gradients are unscaled in place here)

    def __init__(self, units, spec: HomeSpec, sharded=(), per_unit: bool = False):
        self.units, self.per_unit = list(units), per_unit
        self.device, self.timing, self.table = spec.device, spec.timing, spec.table
        self.grads: dict = {}        # (the step reads the reduced rows where they lie)
        flat = {u: (u.master_dtype, u.shard_numel) for u in self.units
                if u.slots and (u in sharded or u.compute_dtype != u.master_dtype)}
        self.flats = FlatBuffers(flat, self.device)
        self.master: dict = dict(self.flats.views)   # unit -> flat masters, where not the params'
        self.shards: dict = {}       # ZeRO-3 params=True: the compute shards, on the device

    def arenas(self) -> list:
        return [self.flats]

    def place_masters(self, unit: Unit, keep: bool) -> torch.Tensor | None:
        master = self.master.get(unit)
        if master is not None:
            return rows_into(unit, master, self.table)
        for s in unit.slots:   # the whole parameters' own rows are the masters
            self.table[s].opt_param = s.rows_of(local_of(s.param).detach())
        return None

    def masters_on_device(self, unit: Unit) -> bool:
        return True

    def param_shard(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """Parameter offload leaves these units' shards on the device."""
        master = self.master[unit]
        shard = master if dtype == master.dtype else master.to(dtype)
        self.shards[unit] = shard
        return shard

    def bind(self, optimizer) -> None:
        """The user's optimizer steps here, and makes its own state, next to the masters, at
        its first step."""

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        units = [u for u in self.units if u.slots]
        for batch in ([u] for u in units) if self.per_unit else [units]:
            self._step(optimizer, batch, grads, grad_scale)
            for u in batch:
                after_unit(u, self.updated_rows(u))

    def _step(self, optimizer, units, grads: dict, grad_scale: float) -> None:
        """The user's optimizer over ``units``' rows, without its step hooks (they fire
        once, for the user's own call)."""
        slots = [s for u in units for s in u.trainable]
        for s in slots:
            self.table[s].opt_param.grad = grads.get(s)
        present = [self.table[s].opt_param.grad for s in slots
                   if self.table[s].opt_param.grad is not None]
        if grad_scale != 1.0 and present:
            torch._foreach_mul_(present, grad_scale)
        try:
            step_without_hooks(optimizer)
        finally:
            for s in slots:
                self.table[s].opt_param.grad = None

    def updated_rows(self, unit: Unit) -> torch.Tensor | None:
        return self.master.get(unit)

    def on_device(self) -> list[Unit]:
        return [u for u in self.units if u.slots]

    def exact_dtypes(self, unit: Unit) -> tuple[torch.dtype, torch.dtype]:
        return unit.master_dtype, unit.master_dtype

    def compute_copies(self) -> list[torch.Tensor]:
        return [t for u, t in self.shards.items() if t is not self.master.get(u)]

    @torch.no_grad()
    def adopt(self, unit: Unit, optimizer) -> None:
        """Take ``unit`` over from another home (ratio="auto"): its masters and state, as
        the optimizer shows them, copied to the device, the optimizer's tensors moved in
        place (``.data``: the optimizer keys on their identity), laid out as torch.optim
        keeps its own state."""
        master = torch.zeros(unit.shard_numel, dtype=unit.master_dtype, device=self.device)
        group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        for s in unit.slots:
            s.shard_of(master).copy_(self.table[s].opt_param)
            self.table[s].opt_param.data = s.shard_of(master)
            state = optimizer.state.get(self.table[s].opt_param)
            if state:
                optimizer.state[self.table[s].opt_param] = _on_device(
                    state, s, self.device, group_of.get(self.table[s].opt_param, {}))
        self.master[unit] = master
        self.units.append(unit)


def _on_device(state: dict, slot, device: torch.device, group: dict) -> dict:
    """A parameter's optimizer state moved to the device: tensors of its rows' shape move,
    a step count stays on the host unless the group's kernels want it on the device
    (fused or capturable, as torch.optim makes it)."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == slot.local_shape:
            out[key] = value.to(device, copy=True)
        elif torch.is_tensor(value) and key == "step" and (group.get("fused")
                                                           or group.get("capturable")):
            out[key] = value.to(device, copy=True)
        else:
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out
