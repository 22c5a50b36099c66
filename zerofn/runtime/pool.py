"""Reusable flat buffers for communication and gathered parameters.

After the first step the hot path allocates nothing: every gather, reduce-scatter and
copy lands in memory the pool already holds.

[Note: best fit] Units differ in size (a transformer's root unit, with the embeddings,
is larger than its blocks), and a pool keyed by exact size would keep separate buffers
for each size even when they are never in use at the same time. Instead a request is
served by the smallest free buffer that is large enough, as a view of its front, so the
pool holds about as many buffers as are ever in use at once. A request is only served
from a buffer at most ``MAX_WASTE`` times its size, so a small request (a shard is half
a gathered unit at two ranks) never pins a large buffer.

[Note: expected sizes] Best fit only shares a buffer that is large enough. A pool that
grows in request order would make the root unit's buffers first, at its own size, and
those are too small for any block: under ZeRO-3 at 112M parameters one root-sized buffer
(24 MB) then sat free through every backward, beside the block-sized ones made later.
Whoever knows the sizes to come says so with ``expect``, and a new buffer is made as large
as the largest expected request it could serve (within ``MAX_WASTE``).

[Note: buffers freed on a side stream] On CUDA a buffer may be given back while work on
a side stream (a reduce-scatter) still uses it. It comes back with an event recorded
after that work, and whoever takes it next makes its own stream wait for the event, so
the compute stream waits for a side stream only when it reuses that stream's buffer.
"""
from __future__ import annotations

from collections import defaultdict

import torch

MAX_WASTE = 1.5


def best_fit(sizes: list[int], numel: int) -> int | None:
    """The index of the smallest of the free buffers' ``sizes`` (elements) that serves a
    request of ``numel``, within ``MAX_WASTE``; None where none does ([Note: best fit]).
    The planner replays the pool with this rule (planner/pool_replay.py)."""
    fits = [i for i, n in enumerate(sizes) if numel <= n <= MAX_WASTE * numel]
    return min(fits, key=lambda i: sizes[i]) if fits else None


def new_size(expected, numel: int) -> int:
    """Elements of a new buffer for a request of ``numel``: the largest ``expected``
    request it could serve, else ``numel`` ([Note: expected sizes])."""
    return max((n for n in expected if numel <= n <= MAX_WASTE * numel), default=numel)


class BufferPool:
    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)   # (dtype, device)
        self._owned: dict[int, torch.Tensor] = {}                          # data_ptr -> buffer
        self._ready: dict[int, object] = {}     # data_ptr -> event its last use ends with
        self._expected: set[int] = set()        # request sizes to come, in elements

    def expect(self, numels) -> None:
        """Request sizes (elements) to come: new buffers are made to fit the largest one
        they could serve (see [Note: expected sizes])."""
        self._expected.update(n for n in numels if n > 0)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device,
             stream=None) -> torch.Tensor:
        """A buffer of ``numel`` elements, usable on ``stream`` (default: the current one)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=device)
        free = self._free[(dtype, torch.device(device))]
        fit = best_fit([b.numel() for b in free], numel)
        if fit is not None:
            buf = free.pop(fit)
            ready = self._ready.pop(buf.data_ptr(), None)
            if ready is not None:   # (the buffer's own device: not always the current one)
                ready.wait(stream if stream is not None else torch.cuda.current_stream(buf.device))
            return buf[:numel]
        buf = torch.empty(new_size(self._expected, numel), dtype=dtype, device=device)
        self._owned[buf.data_ptr()] = buf
        return buf[:numel]

    def give(self, view: torch.Tensor, ready=None) -> None:
        """Take back the buffer ``view`` lies in; ``ready``: an event that its last use
        (on another stream) ends with, for the next taker to wait for."""
        if view.numel() == 0:
            return
        buf = self._owned[view.data_ptr()]
        if ready is not None:
            self._ready[buf.data_ptr()] = ready
        self._free[(buf.dtype, buf.device)].append(buf)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of the pool's buffers (taken or free)."""
        return t.untyped_storage().data_ptr() in self._owned

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, taken or free (accounting counts what they hold)."""
        return list(self._owned.values())

    def nbytes(self) -> int:
        """Bytes the pool holds, taken or free."""
        return sum(b.numel() * b.element_size() for b in self._owned.values())

    def clear(self) -> None:
        self._free.clear()
        self._owned.clear()
        self._ready.clear()
