"""What the optimizer steps on: each slot's reduced gradient rows, in the master dtype,
unscaled, and with an overflow verdict every rank agrees on.

In plain fp32 these are views of the reduced gradients, no copies. Under mixed precision
each unit's gradients are upcast into one pooled master-dtype buffer for the step and
given back after it. Under offload they land in the unit's host buffer: ZeRO-2/3 start
that copy during backward, as soon as the unit's shard is reduced (``shard_ready``), so
it overlaps the backward of the units still to come; ZeRO-1, which reduces here, starts
every unit's copy before waiting for the first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .units import ParamSlot


class StepGrads:
    def __init__(self, comm, pool, units, reducer, scaler, device, copies, offload=None):
        self.comm, self.pool, self.units, self.reducer = comm, pool, units, reducer
        self.scaler, self.device, self.copies, self.offload = scaler, device, copies, offload
        self.grads: dict[ParamSlot, torch.Tensor | None] = {}
        self.overflow = False
        self.ready = False
        self._buffers: list[torch.Tensor] = []
        self._streamed: set = set()    # units whose shard is on its way to the host

    def shard_ready(self, unit, shard: torch.Tensor) -> None:
        """Offload: a backward's reduced shard of ``unit`` is final; copy it to the host now.
        Under accumulation each backward copies again: the shard sums on the device and
        the last copy is the one the step reads."""
        self.copies.to_host(unit, self.offload.grads[unit], shard)
        self._streamed.add(unit)

    @torch.no_grad()
    def prepare(self) -> None:
        """Idempotent until ``release``: clipping and the step share one preparation."""
        if self.ready:
            return
        self.reducer.sync()
        inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
        landed = {}
        for unit in self.units:
            dest = self._prepare_unit(unit, inv_scale is not None)
            if dest is not None:
                landed[unit] = dest
        for unit, dest in landed.items():   # later units' copies run while earlier ones wait
            self.copies.host_wait(unit)
            if inv_scale is not None:
                dest.mul_(inv_scale)
        self._streamed.clear()
        self.overflow = self._any_overflow() if self.scaler is not None else False
        self.ready = True

    def _prepare_unit(self, unit, scaled: bool) -> torch.Tensor | None:
        """Point the step at the unit's gradient rows. Returns the buffer they land in, if
        they are copied; the copies may still be running."""
        dest = None
        for s in unit.slots:
            g = self.reducer.grad_of(unit, s)
            if g is not None and (self.offload is not None or g.dtype != s.opt_param.dtype
                                  or scaled):
                if dest is None:
                    dest = self._landing(unit, s.opt_param.dtype)
                if unit not in self._streamed:   # (without offload: device to device, in order)
                    self.copies.to_host(unit, s.shard_of(dest), g)
                g = s.shard_of(dest)
            self.grads[s] = g
        return dest

    def _landing(self, unit, dtype) -> torch.Tensor:
        """Where a unit's step gradients go: its host buffer under offload, else a pooled
        buffer in the master dtype."""
        if self.offload is not None:
            return self.offload.grads[unit]
        buf = self.pool.take(unit.shard_numel, dtype, unit.device)
        self._buffers.append(buf)
        return buf

    def _any_overflow(self) -> bool:
        """One small all-reduce: if any rank saw inf or nan, every rank skips the step."""
        sums = [g.sum(dtype=torch.float32) for g in self.grads.values() if g is not None]
        local = torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)
        flag = (~torch.isfinite(local)).float().reshape(1).to(self.device)  # offload: host sums
        self.comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def present(self) -> list[torch.Tensor]:
        return [g for g in self.grads.values() if g is not None and g.numel()]

    def release(self) -> None:
        for buf in self._buffers:
            self.pool.give(buf)
        self._buffers.clear()
        self.grads.clear()
        self.ready = False
