"""Collectives over one process group, counted by kind, with a bounded in-flight queue.

Every collective carries a ``record_function`` label so profiles read well. Counts are in
elements of the full (gathered / pre-scatter) buffer: one all-gather or reduce-scatter of
a unit counts that unit's padded parameter count.

[Note: in-flight bound] Async collectives wait in a queue until their buffers are needed
again. The bound is in bytes (``bucket_size`` fp32 elements' worth, so bf16 buffers count
half), and the two newest collectives are never waited for to make room: a unit's
backward may run while the reductions of the two units before it are still in flight,
however large units are.

[Note: host collectives] That exception is for device streams, where waiting would stall
the compute stream behind the reduction. A host collective (gloo: works to wait) is
waited for as soon as a new buffer would exceed the bound. On the host a unit's
reduction is long done by the time the next unit's backward takes its send buffer, yet
kept in the queue it held that buffer, and the pool grew by two blocks' send buffers
(54 MB at 112M parameters) that a wait costing nothing gives back.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

KEEP_IN_FLIGHT = 2   # collectives the in-flight bound always allows (see the Note)

# torch 2.13 renamed the flat collectives; 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_for(group, device: torch.device) -> str:
    """The backend that runs ``group``'s collectives on ``device``'s tensors, "" if none: a
    group made without naming a backend reports "undefined" for itself and serves each
    device type with its own (cpu:gloo, cuda:nccl)."""
    return serving(dist.get_backend_config(group), device.type)


def serving(config: str, device_type: str) -> str:
    """``device_type``'s backend in a backend config such as "cpu:gloo,cuda:nccl"."""
    for part in config.split(","):
        kind, sep, name = part.partition(":")
        if not sep:
            return kind    # (a bare name serves every device)
        if kind == device_type:
            return name
    return ""


def device_problems(device: torch.device, backend: str, current: int | None) -> list[str]:
    """What stops collectives on ``device``: no backend of the group serves it (``backend``
    is ""), or it is a CUDA device other than the current one (``current``), on whose
    streams NCCL's collectives and their waits are queued."""
    problems = []
    if not backend:
        problems.append(f"the process group has no backend for {device.type} tensors (the "
                        f"model is on {device}): initialize it with backend 'nccl' for GPUs "
                        f"or 'gloo' for the CPU, or name none (cpu:gloo,cuda:nccl).")
    if device.type == "cuda" and current is not None and device.index != current:
        problems.append(f"the model is on {device} but the current CUDA device is "
                        f"cuda:{current}, whose streams NCCL's collectives would run and wait "
                        f"on: call torch.cuda.set_device({device.index}) before the "
                        f"transforms (under torchrun: "
                        f"torch.cuda.set_device(int(os.environ['LOCAL_RANK']))).")
    return problems


def inflight_bytes(bucket_size: int) -> int:
    """The in-flight bound in bytes: ``bucket_size`` fp32 elements' worth (the Note)."""
    return 4 * bucket_size


def scratch_numel(full_numel: int, world: int, in_place: bool) -> int:
    """Elements of scratch a reduce-scatter of ``full_numel`` takes: zerofn's in-place gloo
    one past two ranks brings every other rank's chunk into it ([Note: gloo collectives])."""
    return full_numel if in_place and world > 2 else 0


class InFlight:
    """Async collectives whose buffers wait to go back, at most ``bound`` bytes of them
    but the newest ``KEEP_IN_FLIGHT`` ([Note: in-flight bound]). The planner replays the
    runtime's pool through this same queue (planner/pool_replay.py)."""

    def __init__(self, bound: int):
        self._queue: deque = deque()              # (work or None, nbytes, on_done)
        self._inflight = 0                        # bytes
        self._max_inflight = bound

    def enqueue(self, work, nbytes: int, on_done: Callable[[], None]) -> None:
        """Track an async collective on buffers of ``nbytes``; ``on_done`` runs once it is
        waited, when the in-flight bound needs room or at ``drain``. ``work`` may be None
        where the caller has ordered the wait itself (CUDA side streams) and only its
        buffers remain to be let go."""
        self._queue.append((work, nbytes, on_done))
        self._inflight += nbytes
        while self._inflight > self._max_inflight and len(self._queue) > KEEP_IN_FLIGHT:
            self._finish_oldest()

    def make_room(self, nbytes: int) -> None:
        """Wait the oldest collectives until ``nbytes`` more fit the in-flight bound, before
        a buffer for them is taken. The newest ``KEEP_IN_FLIGHT`` are never waited here
        where they run on a device's side stream (no work: [Note: host collectives])."""
        while self._queue and self._inflight + nbytes > self._max_inflight and (
                len(self._queue) > KEEP_IN_FLIGHT or self._queue[0][0] is not None):
            self._finish_oldest()

    def drain(self) -> None:
        while self._queue:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, nbytes, on_done = self._queue.popleft()
        if work is not None:
            work.wait()
        self._inflight -= nbytes
        on_done()


class Comm:
    def __init__(self, group, max_inflight_numel: int, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.step_counts: Counter = Counter()     # elements in the step under way
        self.last_step: Counter = Counter()       # elements of the last finished step
        self.in_flight = InFlight(inflight_bytes(max_inflight_numel))
        # NCCL averages inside the reduce-scatter (a pre-multiplied sum for floats), so fp16
        # gradients of many ranks cannot overflow in the sum; gloo's AVG is unreliable, so
        # there the caller divides the sum.
        self.backend = backend_for(group, device)
        self.averages = self.backend == "nccl"
        # [Note: gloo collectives] gloo's all-gather and reduce-scatter allocate a flat copy
        # of the whole buffer in its worker thread on every call (measured with torch 2.13:
        # +23 MB of peak memory for a 23 MB all-gather, and glibc keeps such blocks), and
        # both are slow. The all-gather is one in-place broadcast per rank's chunk: at 2
        # ranks, 23 MB, 9.5 vs 13.3 ms (best of 15), 2.6x faster at 4 ranks. The
        # reduce-scatter is one all-to-all that brings each rank every other rank's chunk
        # for it, then a sum; at two ranks the split sizes send only the other rank's chunk
        # and receive straight into the output (no scratch). At 2 ranks and 2.8 MB (a block
        # of the benchmarks' 4.2M GPT), medians of 40: 1.8 ms against 4.0 for one gloo
        # reduce per chunk to its owner and 3.4 for an all-reduce. In training (ZeRO-2 on
        # that GPT, 75 shuffled steps against DDP in the same processes) the split
        # all-to-all beat an all-to-all into scratch by 4 % and isend/irecv pairs by 9 %.
        # NCCL's own collectives are in place already.
        self._in_place = self.backend == "gloo"
        self._global = [dist.get_global_rank(group, r) for r in range(self.world)] \
            if group is not None else list(range(self.world))

    def _count(self, kind: str, numel: int, dtype: torch.dtype) -> None:
        self.step_counts[kind] += numel
        self.step_counts[kind + "_bytes"] += numel * dtype.itemsize

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   kind: str = "all_gather"):
        """``kind``: what it is counted as (``subclass_all_gather``: the bytes of tensor
        subclasses' pre-hook outputs, runtime/subclass.py)."""
        self._count(kind, out.numel(), out.dtype)
        with record_function("zerofn::all_gather"):
            if not self._in_place:
                return _all_gather(out, shard, group=self.group, async_op=async_op)
            chunks = out.view(self.world, -1)
            if shard.data_ptr() != chunks[self.rank].data_ptr():   # else already in place
                chunks[self.rank].copy_(shard)
            return self._finish(async_op, [
                dist.broadcast(chunks[r], src=self._global[r], group=self.group, async_op=True)
                for r in range(self.world)])

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False,
                       scratch: torch.Tensor | None = None):
        """Reduce-scatter: the mean over ranks where ``averages`` (NCCL), else the sum, which
        the caller divides. On gloo one all-to-all brings this rank every other rank's
        chunk for it, summed into ``out`` with its own: at two ranks the one chunk lands
        in ``out`` itself, beyond in ``scratch`` (``scratch_numel`` elements)."""
        self._count("reduce_scatter", full.numel(), full.dtype)
        with record_function("zerofn::reduce_scatter"):
            if not self._in_place:
                op = dist.ReduceOp.AVG if self.averages else dist.ReduceOp.SUM
                return _reduce_scatter(out, full, op=op, group=self.group, async_op=async_op)
            if self.world == 1 or not full.numel():   # (every rank's unit is as empty)
                out.copy_(full)
                return self._finish(async_op, [])
            chunks, r = full.view(self.world, -1), self.rank
            if self.world == 2:   # send the other rank its chunk, receive it ours: no scratch
                sizes = [0, 0]
                sizes[1 - r] = chunks.shape[1]
                work = dist.all_to_all_single(out, chunks[1 - r], sizes, sizes,
                                              group=self.group, async_op=True)
                return self._finish(async_op, [work], then=lambda: out.add_(chunks[r]))
            work = dist.all_to_all_single(scratch, full, group=self.group, async_op=True)
            return self._finish(async_op, [work],
                                then=lambda: _sum_rows(scratch.view(self.world, -1), r, out))

    def scratch_numel(self, full_numel: int) -> int:
        """Elements of scratch ``reduce_scatter`` needs for a buffer of ``full_numel``."""
        return scratch_numel(full_numel, self.world, self._in_place)

    @staticmethod
    def _finish(async_op: bool, works: list, then=None):
        done = _Works(works, then)
        if async_op:
            return done
        done.wait()
        return None

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        self._count("all_reduce", t.numel(), t.dtype)
        with record_function("zerofn::all_reduce"):
            return dist.all_reduce(t, op=op, group=self.group, async_op=async_op)

    # [Note: gather and scatter wait] gloo's gathers left in flight together, to different
    # ranks, delivered some rows wrong (torch 2.13: a nan in one matrix of eight at two
    # ranks); each is waited before the next starts.
    def gather(self, t: torch.Tensor, out: torch.Tensor | None, dst_rank: int) -> None:
        """Each rank's ``t`` into row r of ``out`` (given on ``dst_rank`` only): counted
        as the whole buffer, as the other collectives are."""
        self._count("gather", t.numel() * self.world, t.dtype)
        with record_function("zerofn::gather"):
            rows = list(out.unbind(0)) if out is not None else None
            dist.gather(t, rows, dst=self._global[dst_rank], group=self.group)

    def scatter(self, t: torch.Tensor, rows: torch.Tensor | None, src_rank: int) -> None:
        """Row r of ``rows`` (given on ``src_rank`` only) into rank r's ``t``."""
        self._count("scatter", t.numel() * self.world, t.dtype)
        with record_function("zerofn::scatter"):
            pieces = list(rows.unbind(0)) if rows is not None else None
            dist.scatter(t, pieces, src=self._global[src_rank], group=self.group)

    def reduce(self, t: torch.Tensor, dst_rank: int, async_op: bool = False):
        """Every rank's ``t`` summed (averaged where ``averages``) into ``dst_rank``'s:
        counted as the whole buffer, as the reduce-scatter whose share it takes. On gloo
        one all-to-all brings ``dst_rank`` every rank's ``t`` (the bytes the reduce-scatter
        moved for these columns), which it sums chunk by chunk (``t`` holds ``world``) in
        the reduce-scatter's order, each chunk's own rank first: the sum is bit for bit the
        rows the reduce-scatter would have given each rank (gloo's own reduce adds in
        another order, which Muon's bf16 Newton-Schulz magnifies)."""
        self._count("reduce", t.numel(), t.dtype)
        with record_function("zerofn::reduce"):
            if not self._in_place:
                op = dist.ReduceOp.AVG if self.averages else dist.ReduceOp.SUM
                return dist.reduce(t, dst=self._global[dst_rank], op=op, group=self.group,
                                   async_op=async_op)
            if self.world == 1:
                return self._finish(async_op, [])
            mine = self.rank == dst_rank
            recv = torch.empty(self.world * t.numel() if mine else 0, dtype=t.dtype,
                               device=t.device)
            sends = [t.numel() if r == dst_rank else 0 for r in range(self.world)]
            work = dist.all_to_all_single(recv, t, [t.numel() if mine else 0] * self.world,
                                          sends, group=self.group, async_op=True)
            return self._finish(async_op, [work],
                                then=lambda: _sum_chunks(recv, self.world, t) if mine else None)

    def broadcast(self, t: torch.Tensor, src_rank: int = 0) -> None:
        self._count("broadcast", t.numel(), t.dtype)
        with record_function("zerofn::broadcast"):
            dist.broadcast(t, src=dist.get_global_rank(self.group, src_rank), group=self.group)

    def enqueue(self, work, nbytes: int, on_done: Callable[[], None]) -> None:
        """``InFlight.enqueue`` on this group's queue."""
        self.in_flight.enqueue(work, nbytes, on_done)

    def make_room(self, nbytes: int) -> None:
        """``InFlight.make_room`` on this group's queue."""
        self.in_flight.make_room(nbytes)

    def drain(self) -> None:
        self.in_flight.drain()

    def end_step(self) -> None:
        self.last_step = self.step_counts
        self.step_counts = Counter()


def _sum_chunks(recv: torch.Tensor, world: int, out: torch.Tensor) -> None:
    """Each rank's tensor (``recv``'s rows), chunk ``c`` of their sum into ``out``'s chunk
    ``c`` as ``_sum_rows`` adds rank ``c``'s rows of a reduce-scatter."""
    pieces = recv.view(world, world, -1)
    chunks = out.view(world, -1)
    for c in range(world):
        _sum_rows(pieces[:, c], c, chunks[c])


def _sum_rows(rows: torch.Tensor, mine: int, out: torch.Tensor) -> None:
    """``out`` = row ``mine`` + the other rows in rank order (chained adds: 2.4x faster
    than a sum over dim 0 on one CPU thread)."""
    others = [row for j, row in enumerate(rows) if j != mine]
    torch.add(rows[mine], others[0], out=out)
    for row in others[1:]:
        out.add_(row)


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
