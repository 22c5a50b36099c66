"""Several homes behind one ``Home``: each unit's state in exactly one of them (the device,
the host or NVMe), each call going to the home that holds the unit.

The step runs the device's home first (on a GPU its kernels run while the host steps),
then the host's, then NVMe's. Checkpoints do not see the homes: state dicts hold the same
keys and shapes wherever a unit lives, so a checkpoint saved under one placement loads
under another.
"""
from __future__ import annotations

import torch

from ...core.plan import HOMES
from ...core.units import Unit
from .base import Home
from .device import DeviceHome



class Homes(Home):
    """``parts``: at most one home per kind; ``home_of(unit)`` names the unit's."""

    kind = "mixed"

    def __init__(self, parts: list[Home]):
        self.parts = sorted(parts, key=lambda p: HOMES.index(p.kind))
        self.part_of = {u: p for p in self.parts for u in p.units}
        self.units = [u for p in self.parts for u in p.units]
        self.grads = {u: g for p in self.parts for u, g in p.grads.items()}
        self.defers_scaling = any(p.defers_scaling for p in self.parts)
        self.ring = next((p.ring for p in self.parts if p.ring is not None), None)
        self.param_reader = next((p.param_reader for p in self.parts
                                  if p.param_reader is not None), None)
        self.timing = self.parts[0].timing

    @property
    def cpu_adam(self) -> bool:
        return any(p.cpu_adam for p in self.parts)

    @property
    def time_series(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for p in self.parts for t in p.time_series))

    def _of(self, unit: Unit) -> Home:
        return self.part_of[unit]

    def home_of(self, unit: Unit) -> str:
        return self._of(unit).kind

    def device_part(self) -> DeviceHome | None:
        return next((p for p in self.parts if isinstance(p, DeviceHome)), None)

    # -- per unit --------------------------------------------------------------------
    def place_masters(self, unit, keep: bool):
        return self._of(unit).place_masters(unit, keep)

    def param_shard(self, unit, dtype: torch.dtype) -> torch.Tensor:
        return self._of(unit).param_shard(unit, dtype)

    def updated_rows(self, unit):
        return self._of(unit).updated_rows(unit)

    def masters_on_device(self, unit) -> bool:
        return self._of(unit).masters_on_device(unit)

    def exact_dtypes(self, unit) -> tuple[torch.dtype, torch.dtype]:
        return self._of(unit).exact_dtypes(unit)

    def unread(self, unit) -> bool:
        return self._of(unit).unread(unit)

    def read_unit(self, unit):
        return self._of(unit).read_unit(unit)

    def write_rows(self, unit, slot, rows) -> None:
        self._of(unit).write_rows(unit, slot, rows)

    def steps_early(self, unit) -> bool:
        return self._of(unit).steps_early(unit)

    def step_unit(self, optimizer, unit, grads: dict) -> None:
        self._of(unit).step_unit(optimizer, unit, grads)

    # -- every part ------------------------------------------------------------------
    def arenas(self) -> list:
        return [a for p in self.parts for a in p.arenas()]

    def bind(self, optimizer) -> None:
        for p in self.parts:
            p.bind(optimizer)

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        for p in self.parts:
            p.step(optimizer, grads, after_unit, grad_scale, copies, early)

    def recast(self) -> None:
        for p in self.parts:
            p.recast()

    def materialize(self, optimizer) -> None:
        for p in self.parts:
            p.materialize(optimizer)

    def forget_state(self) -> None:
        for p in self.parts:
            p.forget_state()

    def compute_copies(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.compute_copies()]

    def state_buffers(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.state_buffers()]

    def unseen_bytes(self) -> dict[str, dict[str, int]]:
        out: dict = {}
        for p in self.parts:
            for where, roles in p.unseen_bytes().items():
                for role, n in roles.items():
                    out.setdefault(where, {}).setdefault(role, 0)
                    out[where][role] += n
        return out

    def on_device(self) -> list[Unit]:
        return [u for p in self.parts for u in p.on_device()]

    # -- ratio="auto" ----------------------------------------------------------------
    def move(self, units, optimizer) -> None:
        """Move ``units`` from the host's home to the device's, state and all; the host
        gives their memory back."""
        device = self.device_part()
        host = next(p for p in self.parts if p.kind == "host")
        host.materialize(optimizer)
        for u in units:
            device.adopt(u, optimizer)
            self.part_of[u] = device
            self.grads.pop(u, None)
        host.release(units)
