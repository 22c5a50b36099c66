"""Gradient reduction: reduce-scatter each unit's gradients into this rank's shard.

ZeRO-2/3 reduce a unit as soon as all its gradients have been accumulated during
backward (counted by post-accumulate-grad hooks) and every unit before it in the ranks'
common order is reduced, overlapping the rest of backward; an end-of-backward callback
reduces units some of whose parameters got no gradient. ZeRO-1
keeps full gradients on the parameters and reduces them once per step. Reduction averages
over ranks: NCCL's reduce-scatter averages itself, elsewhere the sum
is divided by the world size. Under HSDP (runtime/mesh.py) each reduced shard is then
all-reduced over the replicate dimension, so it is the mean over every rank's batch.

[Note: HSDP's average] A unit's all-reduce over the replicas needs its reduce-scatter
done. It is not issued from the queue's completion callback: that runs when a rank
happens to wait, a moment that differs by rank, and a rank blocked in one dimension's
collective before issuing what its peers in the other dimension wait for can close a
cycle of waits. Instead the next unit's reduction (or the end of backward, or the step)
waits for it and issues the all-reduce: every rank issues the same collectives in the
same order, and each reduce-scatter still overlaps one unit's backward.

[Note: ZeRO-1 reduces in backward] ZeRO-1 needs the reduction of the gradients as they
stand at the step. Reducing at the step leaves the reduction outside backward, where DDP
overlaps its all-reduce with it; so when a backward looks like the step's only one (it is
the first since ``zero_grad`` outside ``no_sync``, and the last step had one too), each
unit is reduced as its gradients are complete, into a pooled shard, exactly as ZeRO-2
does, but leaving the full gradients in place. The step then writes the shards into this
rank's rows. Should another backward come after all (accumulation without ``no_sync``),
the shards are stale: they are dropped and the step reduces the accumulated gradients as
before, and from then on while steps keep taking several backwards.

[Note: one reduction order] Every rank must issue its reduce-scatters in the same order,
or collectives pair different units: gradients averaged with another unit's of equal
size, a size mismatch (gloo raises, NCCL hangs or corrupts) otherwise. Completion order
is not enough: a parameter some ranks leave without a gradient (a conditional branch, an
expert no token chose, a dropped layer) completes its unit on those ranks only at the end
of backward. So units are reduced in one order known to all ranks, a completed unit
waiting for those before it. The first backward uses the reverse of the order the forward
ran the units in under ZeRO-3 (the same on every rank: their gathers must match), else
the reverse of the units' order with the root last (its embedding's gradient comes at
the end of backward). At its end the ranks adopt rank 0's completion order (one
broadcast, as DDP rebuilds its buckets after its first iteration), units rank 0 left
incomplete going last, where they hold back nothing. ZeRO-3 frees a unit's gathered
parameters as soon as its gradients are packed, waiting or not.

[Note: a unit's backward is done] ZeRO-3's backward gathers too, on the same group, so a
unit's reduction must come at one point in every rank's sequence of collectives: a
reduction held back on one rank (a parameter its batch left without a gradient) would
meet another rank's gather. Counting gradients cannot tell "not yet" from "not this
time". So, as FSDP2 does, each forward of a unit passes its tensor inputs that need a
gradient through an identity autograd function. Its backward runs once the unit's own
backward is done, at the same place on every rank, and before the hooks on those inputs
that gather the unit that produced them (a hook on the inputs themselves would run after
those: registered later). The unit's gradients are all in by then: autograd runs the
ready node created last first (gradient accumulation before any), so every node the
unit's forward created has run before the identity, made before them, does; and outside
its forward a unit's parameters are sharded, unusable.

The unit is complete once the last of its forwards whose graph still lives is done (a
forward that backward never reaches, say an evaluation with gradients enabled, stops
counting when its output is dropped). Under reentrant activation checkpointing the
forward runs without gradients and its recompute in backward is the one tracked, as that
is the graph backward runs through; a non-reentrant recompute's graph dies at once. A
parameter still without a gradient then got none and reduces as zeros. A unit whose
inputs need no gradient completes by counting, or at the end of backward: held back on
some ranks, that is safe only where backward gathers nothing after it (a first block fed
data). As under FSDP2, a unit cannot modify its inputs in place.

[Note: the reduce stream] On CUDA each reduce-scatter is issued on a side stream, after
the compute stream's work so far (the packed gradients), and everything after it (the
division, adding into an accumulated shard, starting the shard's copy to the host) is
queued there too, so backward's compute never waits for a reduction. The compute stream
waits for the side stream only where it reuses a buffer the side stream still uses
(pool.py's ready events, after the in-flight bound of comm.py lets the buffer go), and
once at the end of backward, before anything reads the reduced gradients.

[Note: lent gradient shards] Under offload the gradients live on the host; a unit's
device shard is only where its reductions accumulate until the copy. It is taken from
the pool at the unit's first reduction and given back at ``zero_grad``, so between steps
the device holds no gradient memory (the pool reuses it for forward's gathers).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from .events import unguarded
from .timing import UNTIMED
from .units import ParamSlot, Unit, scatter_to_ranks


class GradReducer:
    """Reduce-scatters each unit's gradients into this rank's shard (ZeRO-2/3 during
    backward, ZeRO-1 at the step or early, see the notes) and keeps the shards until
    ``zero_grad``: ``grad_of`` reads them, ``got`` says which parameters got a gradient.
    Its hooks live as long as it does (``remove_hooks`` at teardown).

    Args:
        on_packed: ZeRO-3: ``on_packed(unit)`` once a unit's gradients are packed (its
            parameters may be freed), ``on_packed(None)`` at the end of backward.
        on_shard_ready: offload: ``(unit, shard)`` once a backward's reduction of the unit
            is final, to copy it to the host (runtime/copies.py).
        before_shard_write: offload: ``(unit)`` before a reduction adds into a shard that
            copy may still read.
        forward_order: ZeRO-3: the units as the last forward ran them ([Note: one
            reduction order]).
        timing: labels and (under a monitor) times its regions.
        guard: wraps backward's entry points: the gradient hooks, a unit's completion and
            the end of backward (runtime/events.py).
    """

    def __init__(self, comm, pool, units: list[Unit], stage: int, on_packed=None,
                 reduce_dtype: torch.dtype | None = None, replicas=None, on_shard_ready=None,
                 before_shard_write=None, forward_order=None, timing=UNTIMED,
                 guard=unguarded):
        self.comm, self.pool, self.units, self.stage = comm, pool, units, stage
        self.timing = timing
        # backward's entry points, through the guard (the hooks call these)
        self.grad_arrived = guard(self._on_grad)
        self.unit_done = guard(self.backward_done)
        self._end = guard(self._end_backward)
        self.replicas = replicas               # HSDP: the replicate dimension's Comm
        self._to_average = None                # [Note: HSDP's average] (unit, work, ...)
        self.reduce_dtype = reduce_dtype       # None: the compute dtype
        # ZeRO-3 frees a unit's params once its gradients are packed (unit), or at the end
        # of backward (None).
        self.on_packed = on_packed
        self.on_shard_ready, self.before_shard_write = on_shard_ready, before_shard_write
        self.no_sync = False
        self.grad_shard: dict[Unit, torch.Tensor | None] = {}   # made at the first reduction
        # Slots that got a gradient on this rank since zero_grad (step.py's [Note:
        # parameters without a gradient]).
        self.got: set[ParamSlot] = set()
        self._kept: dict[Unit, torch.Tensor] = {}   # ZeRO-2/3 without offload: their memory
        self._fresh = {u: True for u in units}  # next reduction overwrites instead of adds
        self._send: dict[Unit, torch.Tensor] = {}
        self._packed: dict[Unit, set] = {}      # slots whose gradient is in the send buffer
        self._remaining: dict[Unit, int] = {}
        self._held: dict[Unit, list] = {}       # slots whose gradient waits on the parameter
        self._in_backward = False
        # [Note: one reduction order]
        trainable = [u for u in units if u.trainable]
        self._order = trainable[-2::-1] + trainable[-1:]
        self._learned = False                   # _order is still the first backward's
        self.forward_order = forward_order      # ZeRO-3: the units as the last forward ran
        self._completed: list[Unit] = []        # the first backward's, as they completed
        self._next = 0                          # _order's first unit not reduced yet
        self._reducing = False                  # this backward reduces
        self._dirty = False                     # ZeRO-1: a backward ran since the last reduce
        # [Note: ZeRO-1 reduces in backward]
        self._backwards = self._last_backwards = 0   # outside no_sync, this step / the last
        self._early = False                     # the shards hold the last backward's reduction
        self._hooks = []
        # [Note: a unit's backward is done] each unit's forwards whose backward is to come:
        # their identities' contexts, which die with a graph backward never reaches.
        self._forwards: dict[Unit, weakref.WeakSet] = {u: weakref.WeakSet() for u in units}
        # [Note: the reduce stream], for the reductions during backward (at the step there
        # is no compute to overlap).
        self.device = next((u.device for u in units if u.device is not None), None)
        self.stream = torch.cuda.Stream(self.device) \
            if self.device is not None and self.device.type == "cuda" else None
        mine = weakref.ref(self)
        # What each unit's identity calls in backward (made once: forwards are a hot path).
        self._done = {u: functools.partial(_backward_done, mine, ui) for ui, u in enumerate(units)}
        for ui, u in enumerate(units):
            for si, s in enumerate(u.trainable):
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    functools.partial(_on_grad, mine, ui, si)))

    def _dtype(self, unit: Unit) -> torch.dtype:
        return self.reduce_dtype or unit.dtype

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    # -- during backward -------------------------------------------------------------
    def _on_grad(self, unit: Unit, slot: ParamSlot, param) -> None:
        self._dirty = True
        self.got.add(slot)
        if not self._in_backward:
            self._begin_backward()
        if not self._reducing:
            return
        self._held.setdefault(unit, []).append(slot)
        self._remaining[unit] -= 1
        if self._remaining[unit] == 0 or unit in self._send or self._worth_a_buffer(unit):
            for s in self._held.pop(unit):
                self._pack(unit, s)
        if self._remaining[unit] == 0:
            self._complete(unit)

    def _complete(self, unit: Unit) -> None:
        """[Note: one reduction order] Reduce the units now complete (none of their
        gradients remaining) from the first not reduced yet in the common order."""
        if not self._learned:
            self._completed.append(unit)
        if self.on_packed is not None:
            self.on_packed(unit)
        while self._next < len(self._order) and self._remaining[self._order[self._next]] == 0:
            self._reduce(self._order[self._next])
            self._next += 1

    def track_forward(self, unit: Unit, args: tuple, kwargs: dict):
        """``(args, kwargs)`` of a forward of ``unit``, those that need a gradient passed
        through the identity whose backward reports when the unit's backward is done
        ([Note: a unit's backward is done]); None where none needs one."""
        if not unit.trainable:
            return None
        leaves, spec = tree_flatten((args, kwargs))
        which = [i for i, t in enumerate(leaves)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if not which:
            return None
        tracked = ZerofnUnitInputs.apply(self._forwards[unit], self._done[unit],
                                         *(leaves[i] for i in which))
        for i, t in zip(which, tracked):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def backward_done(self, unit: Unit, forward) -> None:
        """The backward of ``forward``, one of ``unit``'s, is done; after the last still to
        come, the unit is complete ([Note: a unit's backward is done])."""
        if not self._in_backward:
            self._begin_backward()
        self._forwards[unit].discard(forward)
        if self._forwards[unit] or not self._reducing or self._remaining[unit] <= 0:
            return
        self._pack_the_rest(unit)
        self._remaining[unit] = 0
        self._complete(unit)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._remaining = {u: len(u.trainable) for u in self.units}
        self._held = {}
        self._completed, self._next = [], 0
        if not self._learned and self.forward_order:
            ran = [u for u in reversed(self.forward_order()) if u in self._order]
            self._order = ran + [u for u in self._order if u not in ran]
        torch.autograd.Variable._execution_engine.queue_callback(self._end)
        if self.stage == 1:
            self._drop_early()   # gradients accumulate again: an earlier reduction is stale
        if self.no_sync:
            self._reducing = False
            return
        self._backwards += 1
        # [Note: ZeRO-1 reduces in backward] while this looks like the step's only backward.
        self._reducing = self.stage >= 2 or (self._backwards == 1 and self._last_backwards <= 1)
        if self.stage == 1 and self._reducing:
            for unit in self.units:
                self._fresh[unit] = True

    def _worth_a_buffer(self, unit: Unit) -> bool:
        """[Note: late send buffers] A unit's first gradients can arrive long before its
        last: the root's final norm at the start of backward, its tied embedding at the very
        end. Taking the unit's send buffer then would hold a whole unit's worth of memory
        through backward for a few small tensors, so gradients wait on their parameters
        until they make up half the unit."""
        held = sum(s.numel for s in self._held[unit])
        return 2 * held >= self.comm.world * unit.shard_numel

    def _pack_the_rest(self, unit: Unit) -> None:
        """Pack the gradients of an incomplete unit that are on its parameters: those held
        back, and those accumulated under no_sync that this backward did not add to."""
        self._held.pop(unit, None)
        for s in unit.trainable:
            if s.param.grad is not None:
                self._pack(unit, s)

    def _end_backward(self) -> None:
        for unit in self._order[self._next:] if self._reducing else ():
            if self._remaining[unit] > 0:
                self._pack_the_rest(unit)
            self._reduce(unit)
        self._average()
        self.comm.drain()
        self._join()
        if self._reducing and not self._learned:
            self._learn_order()
        self._early = self.stage == 1 and self._reducing
        self._in_backward = self._reducing = False
        if self.on_packed is not None:
            self.on_packed(None)

    def _learn_order(self) -> None:
        """[Note: one reduction order] Adopt rank 0's completion order of this backward."""
        self._learned = True
        mine = self._completed + [u for u in self._order if u not in self._completed]
        groups = [c for c in (self.comm, self.replicas) if c is not None and c.world > 1]
        if groups:
            index = {u: i for i, u in enumerate(self._order)}
            order = torch.tensor([index[u] for u in mine], device=self.device or "cpu")
            for comm in groups:     # HSDP: rank 0 of each shard group, then of replicas
                comm.broadcast(order, 0)
            mine = [self._order[i] for i in order.tolist()]
        self._order = mine

    # -- packing and reducing ------------------------------------------------------------
    def _send_buffer(self, unit: Unit) -> torch.Tensor:
        """A pooled rank-major buffer, not zeroed: padding is never read back, and the
        columns of parameters without a gradient are zeroed when the unit is reduced."""
        send = self._send.get(unit)
        if send is None:
            if self._in_backward:
                # Backward's send buffers count against the in-flight bound while they
                # fill, not only once their reduction starts. (ZeRO-1 packs at the step,
                # where packing overlaps the previous unit's reduction instead.)
                full = self.comm.world * unit.shard_numel
                self.comm.make_room((full + self.comm.scratch_numel(full))
                                    * self._dtype(unit).itemsize)
            send = self.pool.take(self.comm.world * unit.shard_numel, self._dtype(unit),
                                  unit.device)
            self._send[unit] = send
            self._packed[unit] = set()
        return send

    def _pack_grad(self, unit: Unit, slot: ParamSlot, grad: torch.Tensor) -> None:
        send = self._send_buffer(unit).view(self.comm.world, unit.shard_numel)
        scatter_to_ranks(grad, send[:, slot.cols])
        self._packed[unit].add(slot)

    def _pack(self, unit: Unit, slot: ParamSlot) -> None:
        self._pack_grad(unit, slot, slot.param.grad)
        if self.stage >= 2:     # ZeRO-1 keeps its full gradients
            slot.param.grad = None

    def _reduce(self, unit: Unit) -> None:
        self._remaining[unit] = 0
        send = self._send_buffer(unit)
        ranks = send.view(self.comm.world, unit.shard_numel)
        for s in unit.trainable:
            if s not in self._packed[unit]:
                ranks[:, s.cols].zero_()
        del self._send[unit], self._packed[unit]
        out = self._reduction_target(unit)
        stream = self._reduce_stream()
        buffers = [send]
        scratch = None
        if self.comm.scratch_numel(send.numel()):
            scratch = self.pool.take(self.comm.scratch_numel(send.numel()), send.dtype,
                                     unit.device, stream)
            buffers.append(scratch)
        nbytes = sum(b.nbytes for b in buffers)
        if stream is None:
            work = self.timing.issue(
                "reduce_scatter", "reduce", unit.name,
                lambda: self.comm.reduce_scatter(out, send, True, scratch), "reduce_wait")
            if self.replicas is None:
                self.comm.enqueue(work, nbytes,
                                  functools.partial(self._reduced, unit, buffers, out))
            else:   # [Note: HSDP's average]
                self._average()
                self._to_average = (unit, work, buffers, out)
        else:   # [Note: the reduce stream]
            with self._on_stream():
                # (this wait holds the side stream, not the step: _join's does)
                self.timing.issue(
                    "reduce_scatter", "reduce", unit.name,
                    lambda: self.comm.reduce_scatter(out, send, True, scratch), "reduce_wait",
                    stall=False).wait()
                if self.replicas is not None:   # (a fixed point in order: on the stream)
                    self._average_over_replicas(unit, out, stall=False).wait()
                spent = self._post_reduce(unit, out)
                ready = self.stream.record_event()
            self.comm.enqueue(None, nbytes, functools.partial(self._give, buffers + spent, ready))

    def _average(self) -> None:
        """HSDP: wait for the last unit's reduce-scatter and start its all-reduce over the
        replicas ([Note: HSDP's average]); the step's reads of it wait in the queue."""
        if self._to_average is None:
            return
        unit, work, buffers, out = self._to_average
        self._to_average = None
        work.wait()
        self.comm.enqueue(self._average_over_replicas(unit, out), sum(b.nbytes for b in buffers),
                          functools.partial(self._reduced, unit, buffers, out))

    def _average_over_replicas(self, unit: Unit, out: torch.Tensor, stall: bool = True):
        """Start the all-reduce of a reduced shard over the replicas, timed as the
        ``replicate.all_reduce`` kind (its own TensorBoard series: another group of ranks,
        usually another network)."""
        op = dist.ReduceOp.AVG if self.replicas.averages else dist.ReduceOp.SUM
        return self.timing.issue("replicate.all_reduce", "average", unit.name,
                                 lambda: self.replicas.all_reduce(out, op, async_op=True),
                                 "reduce_wait", stall)

    def _reduction_target(self, unit: Unit) -> torch.Tensor:
        """Where this reduction lands: the unit's gradient shard when it starts afresh, else
        a temporary that is then added to the shard (accumulation)."""
        shard = self.grad_shard.get(unit)
        fresh = self._fresh[unit] or shard is None
        self._fresh[unit] = False
        if not fresh:
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device,
                                  self._reduce_stream())
        if shard is None:
            shard = self._new_shard(unit)
            self.grad_shard[unit] = shard
        return shard

    def _new_shard(self, unit: Unit) -> torch.Tensor:
        """ZeRO-1's reduced rows, and the lent shards of offload, come from the pool (given
        back at zero_grad); otherwise the shard is the unit's gradient memory, kept: every
        unit's is a view of one buffer per dtype, made at the first reduction (one large
        allocation, where one per unit in backward would fragment the host heap among the
        activations)."""
        if self.stage == 1 or self.on_shard_ready is not None:
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device,
                                  self._reduce_stream())
        if not self._kept:
            for dtype in {self._dtype(u) for u in self.units}:
                mine = [u for u in self.units if self._dtype(u) == dtype]
                flat = torch.empty(sum(u.shard_numel for u in mine), dtype=dtype,
                                   device=unit.device)
                self._kept.update(zip(mine, flat.split([u.shard_numel for u in mine])))
        return self._kept[unit]

    def _reduce_stream(self):
        """The side stream reductions run on (CUDA, during backward), else None."""
        return self.stream if self._in_backward else None

    def _on_stream(self):
        """The reduce stream, ordered after the current stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _join(self) -> None:
        """The current stream waits for every reduction so far (CUDA)."""
        if self.stream is not None:
            with self.timing.span("reduce_wait", "reduce_wait"):
                torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _reduced(self, unit: Unit, buffers: list[torch.Tensor], out: torch.Tensor) -> None:
        self._give(buffers + self._post_reduce(unit, out))

    def _give(self, buffers: list[torch.Tensor], ready=None) -> None:
        for b in buffers:
            self.pool.give(b, ready)

    def _post_reduce(self, unit: Unit, out: torch.Tensor) -> list[torch.Tensor]:
        """Average, then put the reduced rows where the step reads them; returns the
        buffers this spent."""
        divisor = 1 if self.comm.averages else self.comm.world
        if self.replicas is not None and not self.replicas.averages:   # summed over replicas
            divisor *= self.replicas.world
        if divisor > 1:
            out.div_(divisor)
        if self.stage == 1 and out.dtype == unit.dtype and not self._in_backward:
            self._write_back(unit, out)
            return [out]
        if self.stage == 1:
            return []     # written back at the step; kept for it in a wider reduce dtype
        target = self.grad_shard[unit]
        spent = []
        if out is not target:
            if self.before_shard_write is not None:
                self.before_shard_write(unit)
            target.add_(out)
            spent.append(out)
        if self.on_shard_ready is not None:
            self.on_shard_ready(unit, target)
        return spent

    def _write_back(self, unit: Unit, out: torch.Tensor) -> None:
        """ZeRO-1: the reduced shard goes into this rank's rows of the full gradients, so no
        gradient memory beyond the full gradients (docs/design.md §4) outlives the step's
        preparation; the shard goes back to the pool."""
        for s in unit.trainable:
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
            s.rows_of(s.param.grad).copy_(s.shard_of(out))
        del self.grad_shard[unit]

    def _drop_early(self) -> None:
        """ZeRO-1: another backward after one reduced early (accumulation): its shards are
        stale; the step reduces the accumulated gradients instead."""
        if self._early:
            for unit in list(self.grad_shard):
                self.pool.give(self.grad_shard.pop(unit))
            self._early = False

    # -- at the optimizer step -----------------------------------------------------------
    def sync(self) -> None:
        """Make every unit's reduced gradient shard ready. ZeRO-1 reduces here.

        ZeRO-1's full gradients stay on the parameters (they accumulate there, as in plain
        PyTorch) and the reduced rows are written back into them.
        """
        if self.stage == 1 and self._dirty and self._early:
            for unit, shard in list(self.grad_shard.items()):
                if shard.dtype == unit.dtype:
                    self._write_back(unit, shard)
                    self.pool.give(shard)
        elif self.stage == 1 and self._dirty:
            self._drop_early()
            for unit in self.units:
                if not unit.trainable:
                    continue
                for s in unit.trainable:
                    if s.param.grad is not None:
                        self._pack_grad(unit, s, s.param.grad)
                self._fresh[unit] = True
                self._reduce(unit)
        self._dirty = self._early = False
        self._average()
        self.comm.drain()
        self._join()

    def has_grads(self, unit: Unit) -> bool:
        return not self._fresh[unit]

    def grad_of(self, unit: Unit, slot: ParamSlot) -> torch.Tensor | None:
        """The reduced gradient of this rank's rows of ``slot``, once ``sync`` has run."""
        if not self.has_grads(unit) or not slot.requires_grad:
            return None
        if self.stage == 1 and unit not in self.grad_shard:
            return slot.rows_of(slot.param.grad)
        return slot.shard_of(self.grad_shard[unit])

    def zero_grad(self) -> None:
        """What ``optimizer.zero_grad()`` means for the shards: the next reduction starts
        over; shards taken from the pool go back to it (the caller has waited for their
        copies to the host)."""
        lent = self.stage == 1 or self.on_shard_ready is not None
        self._last_backwards, self._backwards = self._backwards, 0
        self._early = False
        self.got.clear()
        for unit in self.units:
            self._fresh[unit] = True
            if lent and self.grad_shard.get(unit) is not None:
                self.pool.give(self.grad_shard.pop(unit))
            for s in unit.slots:
                s.param.grad = None


class ZerofnUnitInputs(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward reports that the unit's backward
    is done ([Note: a unit's backward is done]). Named for the error a unit that modifies
    its inputs in place meets: "Output 0 of ZerofnUnitInputs is a view and is being
    modified inplace" (docs/design.md §3)."""

    @staticmethod
    def forward(ctx, forwards, done, *inputs):
        forwards.add(ctx)   # (this context is the forward's mark: it lives as its graph does)
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(ctx)
        return (None, None, *grads)


def _backward_done(reducer, ui: int, forward) -> None:
    """Holds neither the reducer nor the unit (see _on_grad)."""
    reducer = reducer()
    if reducer is not None:
        reducer.unit_done(reducer.units[ui], forward)


def _on_grad(reducer, ui: int, si: int, param) -> None:
    """The post-accumulate-grad hook. It holds neither the reducer nor the parameter: the
    hook lives in C++, where the garbage collector cannot see a cycle through it, and such
    a cycle would keep the model and all its memory (device, pinned host) after its last
    use."""
    reducer = reducer()
    if reducer is not None:
        unit = reducer.units[ui]
        reducer.grad_arrived(unit, unit.trainable[si], param)
