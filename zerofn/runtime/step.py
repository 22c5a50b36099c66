"""What the optimizer steps on: each slot's reduced gradient rows, in the master dtype,
unscaled, and with an overflow verdict every rank agrees on.

In plain fp32 these are views of the reduced gradients, no copies. Under mixed precision
each unit's gradients are upcast into one pooled master-dtype buffer for the step and
given back after it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .units import ParamSlot


class StepGrads:
    def __init__(self, comm, pool, units, reducer, scaler, device, offload=None):
        self.comm, self.pool, self.units, self.reducer = comm, pool, units, reducer
        self.scaler, self.device, self.offload = scaler, device, offload
        self.grads: dict[ParamSlot, torch.Tensor | None] = {}
        self.overflow = False
        self.ready = False
        self._buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def prepare(self) -> None:
        """Idempotent until ``release``: clipping and the step share one preparation."""
        if self.ready:
            return
        self.reducer.sync()
        inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
        for unit in self.units:
            self._prepare_unit(unit, inv_scale)
        self.overflow = self._any_overflow() if self.scaler is not None else False
        self.ready = True

    def _prepare_unit(self, unit, inv_scale) -> None:
        dest = None
        for s in unit.slots:
            g = self.reducer.grad_of(unit, s)
            if g is not None and (self.offload is not None or g.dtype != s.opt_param.dtype
                                  or inv_scale is not None):
                if dest is None:
                    dest = self._landing(unit, s.opt_param.dtype)
                g = s.shard_of(dest).copy_(g)
            self.grads[s] = g
        if dest is not None and inv_scale is not None:
            dest.mul_(inv_scale)

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
        flag = (~torch.isfinite(local)).float().reshape(1)
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
