"""Reusable flat buffers for communication and gathered parameters.

Buffers are taken and given back by exact (numel, dtype, device), so after the first
step the hot path allocates nothing: every gather, reduce-scatter and copy lands in
memory the pool already holds.
"""
from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._owned: dict[int, torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, device)]
        if free:
            return free.pop()
        buf = torch.empty(numel, dtype=dtype, device=device)
        self._owned[id(buf)] = buf
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[(buf.numel(), buf.dtype, buf.device)].append(buf)

    def nbytes(self) -> int:
        """Bytes the pool holds, taken or free."""
        return sum(b.numel() * b.element_size() for b in self._owned.values())

    def clear(self) -> None:
        self._free.clear()
        self._owned.clear()
