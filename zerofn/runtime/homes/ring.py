"""The host ring: a few unit-sized host buffers that a step's gradients come down into and
its updated rows go up from, instead of a landing buffer and a compute copy per unit.

[Note: the host ring] A unit's reduced gradient shard stays on the device from its first
reduction until ``zero_grad`` (grads.py's [Note: lent gradient shards]) whatever the
offload does, so it need not cross during backward: the step copies it down, into one of
``DEPTH`` slots, just before CPU Adam needs it. The kernel then writes the unit's updated
rows in the compute dtype over those gradients, in the same pass (each element's gradient
is read before its row is written), and the rows go up from the slot. A slot is reused
once the copy up from it has read it. So the host holds masters and moments, plus
``DEPTH`` units' rows, whatever the model's size: 4 bytes a parameter fewer under bf16
mixed precision (a bf16 landing buffer and a bf16 compute copy). The copies down overlap
the step of the unit before (one slot coming down, one stepping, one going up), where
during backward they overlapped the backward of the units after.

Where the gradients' dtype is not the compute dtype (fp32 reductions under bf16 compute)
a slot has a second part for the rows. Where the masters are the compute rows (no mixed
precision, or bf16 masters) it has none: the rows go up from the masters.
"""
from __future__ import annotations

import torch

from ...core.estimate import HOST_RING_DEPTH
from .base import HostArena

# slots: a unit's gradients coming down, a unit stepping, a unit's rows going up
DEPTH = HOST_RING_DEPTH


class HostRing:
    """``DEPTH`` slots (fewer for fewer units), each as large as the largest unit's
    gradients (and rows, where they need their own part), page-locked where ``pin``."""

    def __init__(self, units, grad_dtype_of, rows_dtype_of, pin: bool):
        self.grad_dtype = {u: grad_dtype_of(u) for u in units}
        # (None: the rows are the masters; the gradients' dtype: the rows overwrite them)
        self.rows_dtype = {u: rows_dtype_of(u) for u in units}
        self.grad_bytes = max((_bytes(u.shard_numel, self.grad_dtype[u]) for u in units),
                              default=0)
        self.rows_bytes = max((_bytes(u.shard_numel, self.rows_dtype[u]) for u in units
                               if self._apart(u)), default=0)
        size = self.grad_bytes + self.rows_bytes
        self.depth = max(1, min(DEPTH, len(units)))
        self.arena = HostArena([size] * self.depth, torch.uint8, pin)
        self.slots = [self.arena.take(size) for _ in range(self.depth)]
        self.owner = [None] * self.depth     # the unit whose rows last went up from each

    def _apart(self, unit) -> bool:
        rows = self.rows_dtype[unit]
        return rows is not None and rows != self.grad_dtype[unit]

    def grads(self, i: int, unit) -> torch.Tensor:
        """Slot ``i``'s (modulo the depth) part for ``unit``'s gradient rows."""
        return _view(self.slots[i % self.depth], 0, unit.shard_numel, self.grad_dtype[unit])

    def rows(self, i: int, unit) -> torch.Tensor | None:
        """Where the kernel writes ``unit``'s updated rows in the compute dtype: over its
        gradients, in their own part, or nowhere (None: the masters are the rows)."""
        if self.rows_dtype[unit] is None:
            return None
        if not self._apart(unit):
            return self.grads(i, unit)
        return _view(self.slots[i % self.depth], self.grad_bytes, unit.shard_numel,
                     self.rows_dtype[unit])

    def take(self, i: int, unit):
        """Slot ``i`` (modulo the depth) for ``unit``; returns the unit it last held (None
        at first), whose copy up from it must be done before it is written again."""
        before, self.owner[i % self.depth] = self.owner[i % self.depth], unit
        return before

    def bytes_by_role(self) -> dict[str, int]:
        return {"grads": self.depth * self.grad_bytes, "params": self.depth * self.rows_bytes}


LINE = 256   # bytes: every part starts where the vector kernels want it


def _bytes(numel: int, dtype) -> int:
    """A part's bytes, rounded up to whole lines."""
    return -(-numel * dtype.itemsize // LINE) * LINE


def _view(slot: torch.Tensor, start: int, numel: int, dtype) -> torch.Tensor:
    return slot[start:start + numel * dtype.itemsize].view(dtype)
