"""Collectives over one process group, counted by kind, with a bounded in-flight queue.

Every collective carries a ``record_function`` label so profiles read well. Counts are in
elements of the full (gathered / pre-scatter) buffer: one all-gather or reduce-scatter of
a unit counts that unit's padded parameter count.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

# torch 2.13 renamed the flat collectives; 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    def __init__(self, group, max_inflight_numel: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.step_counts: Counter = Counter()     # elements in the step under way
        self.last_step: Counter = Counter()       # elements of the last finished step
        self._queue: deque = deque()              # (work, numel, on_done)
        self._inflight_numel = 0
        self._max_inflight = max_inflight_numel
        # [Note: gloo collectives] gloo's all-gather and reduce-scatter allocate a flat copy
        # of the whole buffer in its worker thread on every call (measured with torch 2.13:
        # +23 MB of peak memory for a 23 MB all-gather, and glibc keeps such blocks), and its
        # all-gather is slow. One in-place broadcast per rank's chunk, and one reduce per
        # chunk to its owner, move the same bytes with no temporary: at 2 ranks, 23 MB,
        # all-gather 9.5 vs 13.3 ms, reduce-scatter 22.5 vs 22.0 ms (best of 15); at 4 ranks
        # 2.6x and 1.8x faster. NCCL's own collectives are in place already.
        self._in_place = dist.get_backend(group) == "gloo"
        self._global = [dist.get_global_rank(group, r) for r in range(self.world)] \
            if group is not None else list(range(self.world))

    def _count(self, kind: str, numel: int, dtype: torch.dtype) -> None:
        self.step_counts[kind] += numel
        self.step_counts[kind + "_bytes"] += numel * dtype.itemsize

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self._count("all_gather", out.numel(), out.dtype)
        with record_function("zerofn::all_gather"):
            if not self._in_place:
                return _all_gather(out, shard, group=self.group, async_op=async_op)
            chunks = out.view(self.world, -1)
            if shard.data_ptr() != chunks[self.rank].data_ptr():   # else already in place
                chunks[self.rank].copy_(shard)
            return self._finish(async_op, [
                dist.broadcast(chunks[r], src=self._global[r], group=self.group, async_op=True)
                for r in range(self.world)])

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """Sum-reduce-scatter. Averaging is the caller's division: gloo's AVG is unreliable.
        On gloo ``full`` is scratch afterwards."""
        self._count("reduce_scatter", full.numel(), full.dtype)
        with record_function("zerofn::reduce_scatter"):
            if not self._in_place:
                return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=self.group,
                                       async_op=async_op)
            chunks = full.view(self.world, -1)
            return self._finish(async_op, [
                dist.reduce(chunks[r], dst=self._global[r], op=dist.ReduceOp.SUM,
                            group=self.group, async_op=True)
                for r in range(self.world)], then=lambda: out.copy_(chunks[self.rank]))

    @staticmethod
    def _finish(async_op: bool, works: list, then=None):
        done = _Works(works, then)
        if async_op:
            return done
        done.wait()
        return None

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        self._count("all_reduce", t.numel(), t.dtype)
        with record_function("zerofn::all_reduce"):
            dist.all_reduce(t, op=op, group=self.group)

    def broadcast(self, t: torch.Tensor, src_rank: int = 0) -> None:
        with record_function("zerofn::broadcast"):
            dist.broadcast(t, src=dist.get_global_rank(self.group, src_rank), group=self.group)

    def enqueue(self, work, numel: int, on_done: Callable[[], None]) -> None:
        """Track an async collective; wait the oldest ones once too much is in flight."""
        self._queue.append((work, numel, on_done))
        self._inflight_numel += numel
        while self._inflight_numel > self._max_inflight and len(self._queue) > 1:
            self._finish_oldest()

    def make_room(self, numel: int) -> None:
        """Wait the oldest collectives until ``numel`` more elements fit the in-flight bound,
        before a buffer for them is taken."""
        while self._queue and self._inflight_numel + numel > self._max_inflight:
            self._finish_oldest()

    def drain(self) -> None:
        while self._queue:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, numel, on_done = self._queue.popleft()
        work.wait()
        self._inflight_numel -= numel
        on_done()

    def end_step(self) -> None:
        self.last_step = self.step_counts
        self.step_counts = Counter()


class _Works:
    """Several collectives waited as one, then a last local step (see [Note: gloo
    collectives])."""

    def __init__(self, works: list, then: Callable[[], object] | None):
        self._works, self._then = works, then

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._then is not None:
            self._then()
            self._then = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)
