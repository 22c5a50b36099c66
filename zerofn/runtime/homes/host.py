"""Optimizer offload: master params and optimizer state on the host, the step in C++.

[Note: one arena] Every unit's host buffers are views of a few allocations made at
set-up (one per dtype: a unit's masters and state keep its parameters' dtype),
page-locked at their exact size when the runtime's device is CUDA (page-locked memory is
what lets copies overlap; see [Note: exact pinning] in pinned.py for why not
``pin_memory()``). On a CPU device, GPU or not, the same code runs on plain host memory
with synchronous copies.

For Adam and AdamW the step runs in ``zerofn.optim.adam_step`` over each parameter's rows
of the unit's flat buffers (fp32 masters; a unit of another dtype steps as torch.optim's
own Adam does, in its dtype); their views are registered as the optimizer's own state
(``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts see nothing different. Any other
torch.optim optimizer steps the host masters itself, a unit at a time, from the unit's
gradients cast to the masters' dtype.

[Note: the layout before the optimizer] The masters, the gradients' landing buffers (in
the reduce dtype, whatever steps them) and the ring are laid out at set-up from the
offload policy alone; the optimizer, found later where the transform was not given one
(``bind``), adds only Adam's moments, in an arena of their own. So a backward, a clip or
a vote before the first step does the same as under the optimizer it will find.
"""
from __future__ import annotations

import torch

from ..pinned import pins
from ..optimizer import step_without_hooks
from ...core.units import Unit
from .adam import adam_unit, cast_the_rest, groups_by_param
from .base import (HomeSpec, HostArena, Home, cpu_adam_steps, decoupled_weight_decay, device_of,
                   rows_into)
from .ring import HostRing


class HostHome(Home):
    """Per unit on the host: master rows, a gradient landing buffer and, for Adam, its state."""

    time_series = ("d2h", "h2d")

    def __init__(self, units: list[Unit], spec: HomeSpec, per_unit: bool = False,
                 ring: bool = False):
        grad_dtype_of = spec.grad_dtype
        self.timing, self.table = spec.timing, spec.table
        # per_unit: an arena for each unit (not one for all), so that ``release`` gives a
        # unit's host memory back (offload's ratio="auto" moves units to the device).
        self._groups = per_unit_groups if per_unit else by_dtype_groups
        self._arenas_of: dict = {}
        self.pin = pins(device_of(units))
        # (units without parameters have no dtype; they take no room either)
        self.master_dtype = {u: u.master_dtype or torch.float32 for u in units}
        self.compute_dtype = {u: u.compute_dtype or self.master_dtype[u] for u in units}
        self.master, self.exp_avg, self.exp_avg_sq = {}, {}, {}
        self._arenas = []
        self.units = units
        self._allocate_state()
        self._steps = None
        self.compute_copy = {}
        self.grads = {}
        self.decoupled = True
        # ring: the step brings each unit's gradients down and sends its rows up through a
        # few slots ([Note: the host ring] in ring.py), so there is no per-unit host buffer
        # for either.
        self.ring = HostRing([u for u in units if u.slots], grad_dtype_of, self._rows_dtype,
                             self.pin) if ring else None
        if self.ring is not None:
            self._arenas.append(self.ring.arena)
        else:
            self._allocate_landing(grad_dtype_of)

    def _allocate_landing(self, grad_dtype_of) -> None:
        """Without the ring, per unit: a landing buffer for its gradients and, under mixed
        precision, the compute copy of its rows.

        The compute copy is kept in this (pinned) arena, where CPU Adam writes it in its
        pass (another optimizer's rows are cast into it): what goes back to the device is
        already in its dtype, and page-locked. A copy that also casts would cast on the host
        into pageable memory and hold the step meanwhile. Under parameter offload this copy
        is the parameter shard (``param_shard``)."""
        units = self.units
        self.compute_copy = self._shards({u: self._rows_dtype(u) for u in units
                                          if self._rows_dtype(u) is not None})
        self.grads = self._shards({u: grad_dtype_of(u) for u in units})

    def _shards(self, dtype_of: dict) -> dict:
        """A pinned buffer of each unit's shard size in ``{unit: dtype}``'s dtype."""
        out = {}
        for dtype, mine in self._groups(dtype_of):
            arena = HostArena([u.shard_numel for u in mine], dtype, self.pin)
            out.update({u: arena.take(u.shard_numel) for u in mine})
            self._keep(arena, mine)
        return out

    def _rows_dtype(self, unit: Unit) -> torch.dtype | None:
        """The dtype of the unit's rows that go up, where the masters are not those rows."""
        compute = self.compute_dtype[unit]
        return compute if compute != self.master_dtype[unit] else None

    def _allocate_state(self) -> None:
        """The masters, in their dtype ([Note: the layout before the optimizer])."""
        self._allocate({u: self.master_dtype[u] for u in self.units}, [self.master])

    def _allocate_moments(self) -> None:
        """Adam's two moments, in the masters' dtype, once CPU Adam is the kernel."""
        self._allocate({u: self.master_dtype[u] for u in self.units},
                       [self.exp_avg, self.exp_avg_sq])

    def _allocate(self, dtype_of: dict, tables: list) -> None:
        """A view of each unit's shard size per table (zeros: a fresh arena), one arena per
        dtype (or unit)."""
        for dtype, mine in self._groups(dtype_of):
            arena = HostArena([u.shard_numel for u in mine] * len(tables), dtype, self.pin)
            for table in tables:
                table.update({u: arena.take(u.shard_numel) for u in mine})
            self._keep(arena, mine)

    def _keep(self, arena: HostArena, units) -> None:
        self._arenas.append(arena)
        for u in units:
            self._arenas_of.setdefault(u, []).append(arena)

    def release(self, units) -> None:
        """Stop holding ``units`` (another part took them over): with per-unit arenas their
        host memory goes back once the optimizer no longer views it."""
        gone = set(units)
        self.units = [u for u in self.units if u not in gone]
        for u in gone:
            for table in (self.master, self.exp_avg, self.exp_avg_sq, self.compute_copy,
                          self.grads):
                table.pop(u, None)
            for arena in self._arenas_of.pop(u, []):
                if all(arena not in held for held in self._arenas_of.values()):
                    self._arenas.remove(arena)

    def place_masters(self, unit: Unit, keep: bool) -> torch.Tensor:
        return rows_into(unit, self.master[unit], self.table)

    def param_shard(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """ZeRO-3 parameter offload: the unit's compute shard on the host is the copy the
        step writes, the compute-dtype rows (or the masters themselves, in their dtype):
        no second host copy of the rows, and no copy into it after each step."""
        assert dtype == self.compute_dtype[unit], (unit.name, dtype)   # one plan made both
        copy = self.compute_copy.get(unit)
        return self.master[unit] if copy is None else copy.copy_(self.master[unit])

    def arenas(self) -> list[HostArena]:
        return [a for a in (*self._arenas, self._steps) if a]

    def updated_rows(self, unit: Unit) -> torch.Tensor:
        """CPU Adam writes the compute copy in its pass; a torch optimizer stepped the
        masters only, so they are cast into it first. With the ring (no compute copy: a
        load's refresh) the masters are cast into a new tensor, which the copy up has
        read by the time it returns (pageable memory)."""
        copy = self.compute_copy.get(unit)
        if self.ring is not None and self._rows_dtype(unit) is not None:
            return self.master[unit].to(self._rows_dtype(unit))
        if copy is None:
            return self.master[unit]
        if not self.cpu_adam:
            copy.copy_(self.master[unit])
        return copy

    def recast(self) -> None:
        """(A torch optimizer's copies are cast whenever they are read, by
        ``updated_rows``.)"""
        if not self.cpu_adam:
            return
        for u, copy in self.compute_copy.items():
            copy.copy_(self.master[u])

    def unseen_bytes(self) -> dict[str, dict[str, int]]:
        """The ring's slots, which no tensor views between steps."""
        return {"host": self.ring.bytes_by_role()} if self.ring is not None else {}

    def compute_copies(self) -> list[torch.Tensor]:
        return list(self.compute_copy.values())

    def bind(self, optimizer) -> None:
        """zerofn's CPU Adam steps Adam and AdamW: its moments are made now, and their
        views registered as the optimizer's own state; another optimizer keeps its own."""
        self.cpu_adam = cpu_adam_steps(optimizer)
        self.decoupled = decoupled_weight_decay(optimizer)
        if not self.cpu_adam:
            return
        self.time_series = tuple(dict.fromkeys(self.time_series + ("cpu_adam",)))
        if not self.exp_avg:
            self._allocate_moments()
        units = self.units
        trainable = [s for u in units for s in u.trainable]
        self._steps = HostArena([1] * len(trainable), torch.float32)
        for u in units:
            for s in u.trainable:
                before = optimizer.state.get(self.table[s].opt_param, {})
                state = {"step": self._steps.take(1).view(()),
                         "exp_avg": s.shard_of(self.exp_avg[u]),
                         "exp_avg_sq": s.shard_of(self.exp_avg_sq[u])}
                for k, v in before.items():   # state the optimizer had (e.g. loaded) moves in
                    state[k].copy_(v)
                optimizer.state[self.table[s].opt_param] = state

    def forget_state(self) -> None:
        for t in (*self.exp_avg.values(), *self.exp_avg_sq.values()):
            t.zero_()

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        """Unit by unit. Without the ring, the rows each unit's ``after_unit`` copies out
        are rewritten only by the next step, which settles those copies first."""
        if self.ring is not None:
            return self._step_through_ring(optimizer, grads, after_unit, grad_scale, copies)
        group_of = groups_by_param(optimizer)
        for u in self.units:
            if early is None or not early.take(u):   # (stepped during backward)
                self._step_rows(optimizer, group_of, u, grads, self.compute_copy.get(u),
                                grad_scale)
            after_unit(u, self.updated_rows(u))

    def _step_rows(self, optimizer, group_of: dict, unit: Unit, grads: dict, rows,
                   grad_scale: float) -> list:
        """Step ``unit``'s masters with the kernel ``bind`` chose; CPU Adam writes ``rows``
        in the compute dtype too where given. Returns the slots whose rows it wrote."""
        if self.cpu_adam:
            return self._adam(optimizer, group_of, unit, grads, rows, grad_scale)
        self._torch_unit(optimizer, unit, grads, grad_scale)
        return []

    def _torch_unit(self, optimizer, unit: Unit, grads: dict, grad_scale: float) -> None:
        """Another optimizer steps the unit's host masters itself (without its step hooks:
        they fire once, for the user's own call), from the landed gradients cast to the
        masters' dtype and times ``grad_scale`` as they are read, given as its ``.grad``."""
        slots = [s for s in unit.trainable if grads.get(s) is not None]
        if not slots:
            return
        cast = torch.empty(unit.shard_numel, dtype=self.master_dtype[unit])
        for s in slots:
            g = s.shard_of(cast).copy_(grads[s])
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            self.table[s].opt_param.grad = g
        try:
            step_without_hooks(optimizer)
        finally:
            for s in slots:
                self.table[s].opt_param.grad = None

    def _step_through_ring(self, optimizer, grads: dict, after_unit, grad_scale: float,
                           copies) -> None:
        """[Note: the host ring]: each unit's gradients come down (``grads`` holds the
        device's rows) while the unit before steps; its rows go up from the same slot."""
        group_of = groups_by_param(optimizer)
        units = [u for u in self.units if u.slots]
        if units:
            self._bring_down(0, units[0], grads, copies)
        for i, u in enumerate(units):
            if i + 1 < len(units):
                self._bring_down(i + 1, units[i + 1], grads, copies)
            copies.host_wait(u)
            landed = self.ring.grads(i, u)
            rows = self.ring.rows(i, u)
            mine = {s: s.shard_of(landed) for s in u.slots if grads.get(s) is not None}
            written = self._step_rows(optimizer, group_of, u, mine, rows, grad_scale)
            if rows is None:
                rows = self.master[u]
            else:
                cast_the_rest(rows, self.master[u], written)
            after_unit(u, rows)

    def _bring_down(self, i: int, unit: Unit, grads: dict, copies) -> None:
        """Start copying ``unit``'s device gradients into slot ``i``, once the rows that
        last went up from it have left."""
        before = self.ring.take(i, unit)
        if before is not None:
            copies.before_host_write(before)
        landed = self.ring.grads(i, unit)
        for s in unit.trainable:
            if grads.get(s) is not None and s.local_numel:
                copies.to_host(unit, s.shard_of(landed), grads[s])

    def steps_early(self, unit: Unit) -> bool:
        return self.cpu_adam and unit in self.grads

    def step_unit(self, optimizer, unit: Unit, grads: dict) -> None:
        self._adam(optimizer, groups_by_param(optimizer), unit, grads,
                   self.compute_copy.get(unit), 1.0)

    def _adam(self, optimizer, group_of: dict, unit: Unit, grads: dict, rows,
              grad_scale: float) -> list:
        """CPU Adam over ``unit``'s host state (adam.py), writing ``rows`` in the compute
        dtype too where given; returns the slots it wrote."""
        return adam_unit(optimizer, group_of, unit, grads, self.master[unit],
                         self.exp_avg[unit], self.exp_avg_sq[unit], self.decoupled, rows,
                         grad_scale, self.timing, self.kernel_options, table=self.table)

    kernel_options = None   # slot -> adam_step's keywords for the state's stored form


def by_dtype_groups(dtype_of: dict) -> list:
    """``[(dtype, [units])]`` from ``{unit: dtype}``, in the units' order: one arena each."""
    out: dict = {}
    for u, dtype in dtype_of.items():
        out.setdefault(dtype, []).append(u)
    return list(out.items())


def per_unit_groups(dtype_of: dict) -> list:
    """``[(dtype, [unit])]``: an arena for each unit."""
    return [(dtype, [u]) for u, dtype in dtype_of.items()]
