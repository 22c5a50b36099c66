"""The runtime's buffer pool (runtime/pool.py), replayed over a candidate's steps: the
pool's own best-fit rule (``best_fit``, ``new_size``: a request takes the smallest free
buffer at most ``MAX_WASTE`` times its size, else a new one, made as large as the largest
expected request it could serve), over the requests the runtime makes, in its order
(backward.py's ``first_order``), through the runtime's own in-flight queue on
collectives (runtime/comm.py's ``InFlight``, its bound and gloo's scratch). What the pool ends up holding depends on the units' sizes
and not only the largest: a unit too small for the free buffers (a convolutional net's
early blocks beside its late ones) gets buffers of its own.

The requests, per step (one rank, no accumulation):

- ZeRO-3's gathers (runtime/params.py): a unit's receive buffer, then its gathered
  buffer before the receive buffer goes back; ``prefetch`` units ahead (from the second
  forward, once the order is known); each unit freed
  after its forward (the root after the whole forward) and in backward once its
  gradients are packed (a unit with none, once its backward is done), every one at
  backward's end;
- reductions (runtime/grads.py): a unit's send buffer, its gloo scratch past two ranks,
  and where the shards are lent (ZeRO-1, or an offloaded step) its gradient shard, kept
  to ``zero_grad``; each reduction's buffers go back once it is waited for, which the
  in-flight bound forces, or at backward's end;
- the step (runtime/step_grads.py, shards.py): under mixed precision without offload every
  unit's gradient rows copied to the masters' dtype, held through the step; ZeRO-1/2's
  all-gather of each unit's updated rows, under the in-flight bound.
"""
from __future__ import annotations

from zerofn.core.plan import ShardingPolicy
from zerofn.runtime.backward import first_order
from zerofn.runtime.comm import InFlight, inflight_bytes, scratch_numel
from zerofn.runtime.pool import best_fit, new_size


class _Buffer:
    __slots__ = ("numel", "itemsize")

    def __init__(self, numel: int, itemsize: int):
        self.numel, self.itemsize = numel, itemsize


class _Pool:
    """BufferPool's best fit (runtime/pool.py's rule) over sizes only (one free list per
    element size)."""

    def __init__(self, expected=()):
        self.free: dict[int, list[_Buffer]] = {}
        self.owned: list[_Buffer] = []
        self.expected = {n for n in expected if n > 0}

    def take(self, numel: int, itemsize: int) -> _Buffer | None:
        if numel == 0:
            return None
        free = self.free.setdefault(itemsize, [])
        fit = best_fit([b.numel for b in free], numel)
        if fit is not None:
            return free.pop(fit)
        buf = _Buffer(new_size(self.expected, numel), itemsize)
        self.owned.append(buf)
        return buf

    def give(self, *bufs: _Buffer | None) -> None:
        for b in bufs:
            if b is not None:
                self.free[b.itemsize].append(b)

    def nbytes(self) -> int:
        return sum(b.numel * b.itemsize for b in self.owned)


class _Waited:
    """A collective's work as gloo's: waited for when the bound needs room."""

    @staticmethod
    def wait() -> None:
        pass


class PoolReplay:
    """One rank's pool over ``steps`` steps of a candidate.

    Args:
        stage: 1, 2 or 3.
        world: ranks.
        shards: each unit's padded shard (elements), in the runtime's unit order (the
            root, where it has parameters, last).
        trainable: whether each unit has gradients to reduce.
        root: whether the last unit is the root (which runs first and frees last).
        compute, master: bytes an element of the compute and the masters' dtype.
        lent: the gradient shards are the pool's (ZeRO-1, an offloaded step).
        mixed_copies: the step copies the gradient rows to the masters' dtype.
        bucket_size, prefetch: zerofn's options (core/plan.py).
        gloo: the collectives are gloo's (a scratch past two ranks).
        root_first: ZeRO-3's root unit has a parameter that runs after every other unit
            (``Shape.root_first``), so its gradient, and the root's send buffer, come
            first in backward.
    """

    def __init__(self, stage: int, world: int, shards: tuple[int, ...],
                 trainable: tuple[bool, ...], root: bool, compute: int, master: int,
                 lent: bool, mixed_copies: bool,
                 bucket_size: int = ShardingPolicy.bucket_size,
                 prefetch: int = ShardingPolicy.prefetch, gloo: bool = True,
                 root_first: bool = False):
        self.stage, self.world, self.compute, self.master = stage, world, compute, master
        self.root_first = root_first
        self.units = list(range(len(shards)))
        self.shards, self.trainable = shards, trainable
        self.lent_shards, self.mixed_copies = lent, mixed_copies
        self.prefetch, self.gloo = prefetch, gloo
        self.pool = _Pool([world * n for n in shards] if stage == 3 else ())
        # (every collective waited as gloo's: a device's side-stream reductions, which keep
        # KEEP_IN_FLIGHT for room, are not told apart)
        self.queue = InFlight(inflight_bytes(bucket_size))
        # forward order: the root first, then the units as built
        self.order = self.units[-1:] + self.units[:-1] if root else self.units
        self.gathered: dict[int, _Buffer] = {}
        self.pending: dict[int, _Buffer] = {}
        self.lent: dict[int, _Buffer] = {}

    def run(self, steps: int = 2) -> "PoolReplay":
        for step in range(steps):
            self.pool.give(*self.lent.values())      # zero_grad
            self.lent.clear()
            if self.stage == 3:     # (the first forward learns the order: no prefetch)
                self._forward(self.prefetch if step else 0)
            self._backward()
            self._step()
        return self

    def buffer_bytes(self) -> list[tuple[int, int]]:
        """``(bytes, bytes not lent)`` of each buffer the pool holds: the gradient shards it
        has lent are model state, and a shard lent from a larger free buffer (a send
        buffer's, a gathered unit's) leaves the rest of that buffer to the pool."""
        lent = {id(b): self.shards[u] * b.itemsize for u, b in self.lent.items()}
        return [(b.numel * b.itemsize, b.numel * b.itemsize - lent.get(id(b), 0))
                for b in self.pool.owned]

    # -- ZeRO-3's gathers ---------------------------------------------------------------
    def _start_gather(self, u: int) -> None:
        if u not in self.gathered and u not in self.pending:
            self.pending[u] = self.pool.take(self.world * self.shards[u], self.compute)

    def _ensure(self, u: int) -> bool:
        """Gather ``u``; whether it was not gathered already."""
        if u in self.gathered:
            return False
        self._start_gather(u)
        recv = self.pending.pop(u)
        self.gathered[u] = self.pool.take(self.world * self.shards[u], self.compute)
        self.pool.give(recv)
        return True

    def _free(self, u: int) -> None:
        self.pool.give(self.gathered.pop(u, None))

    def _forward(self, prefetch: int) -> None:
        for i, u in enumerate(self.order):
            self._ensure(u)
            for v in self.order[i + 1:i + 1 + prefetch]:
                self._start_gather(v)
            if i:
                self._free(u)
        self._free(self.order[0])

    # -- backward's reductions ----------------------------------------------------------
    def _backward(self) -> None:
        if self.stage == 3:
            first, rest = self.order[0], self.order[:0:-1]
            self._ensure(first)           # the root's output's gradient comes first
            # its send buffer is taken with its first gradient packed: before every other
            # unit's where a root parameter (a final norm, an untied head) runs after them
            early = self._send(first) if self.root_first and self.trainable[first] else None
            for j, u in enumerate(rest):
                if self._ensure(u):
                    for v in rest[j + 1:j + 1 + self.prefetch]:
                        self._start_gather(v)
                send = self._send(u) if self.trainable[u] else None
                self._free(u)
                if send is not None:
                    self._reduce(u, send)
            if self.trainable[first]:     # complete last: packed, freed, reduced
                send = early or self._send(first)
                self._free(first)
                self._reduce(first, send)
        else:
            for u in first_order([u for u in self.units if self.trainable[u]]):
                self._reduce(u, self._send(u))
        self.queue.drain()
        for u in list(self.gathered):
            self._free(u)

    def _scratch(self, u: int) -> int:
        return scratch_numel(self.world * self.shards[u], self.world, self.gloo)

    def _send(self, u: int) -> _Buffer:
        full = self.world * self.shards[u]
        self.queue.make_room((full + self._scratch(u)) * self.compute)
        return self.pool.take(full, self.compute)

    def _reduce(self, u: int, send: _Buffer) -> None:
        scratch = self.pool.take(self._scratch(u), self.compute)
        if self.lent_shards and u not in self.lent:
            self.lent[u] = self.pool.take(self.shards[u], self.compute)
        nbytes = (self.world * self.shards[u] + self._scratch(u)) * self.compute
        self.queue.enqueue(_Waited, nbytes, lambda: self.pool.give(send, scratch))

    # -- the step -----------------------------------------------------------------------
    def _step(self) -> None:
        if self.mixed_copies:
            copies = [self.pool.take(self.shards[u], self.master)
                      for u in self.units if self.trainable[u]]
            self.pool.give(*copies)
        if self.stage < 3:
            for u in self.units:
                recv = self.pool.take(self.world * self.shards[u], self.compute)
                self.queue.enqueue(_Waited, self.world * self.shards[u] * self.compute,
                                   lambda recv=recv: self.pool.give(recv))
            self.queue.drain()
