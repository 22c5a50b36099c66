"""Gradient reduction: reduce-scatter each unit's gradients into this rank's shard.

Every stage reduces a unit as soon as all its gradients have been accumulated during
backward (counted by post-accumulate-grad hooks) and every unit before it in the ranks'
common order is reduced, overlapping the rest of backward; an end-of-backward callback
reduces units some of whose parameters got no gradient. ZeRO-2/3 free each parameter's
gradient once it is packed; ZeRO-1 keeps the whole gradients until backward ends. Every
backward outside ``no_sync`` reduces (its shards add up over micro-batches, as DDP's
all-reduced gradients do), and then shows the reduced rows on ``p.grad`` (visible.py's
[Note: gradients as a loop sees them]). Reduction averages
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

When to reduce which unit is the tracker's (backward.py), which the reducer owns and which
calls its ``pack`` and ``reduce``; what a reduction does is the reducer's.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .backward import BackwardTracker
from .to_owner import ToOwner
from ..core.units import ParamSlot, Unit, scatter_to_ranks


def lends_shards(stage: int, crosses: bool) -> bool:
    """Whether the pool lends the gradient shards ([Note: lent gradient shards]): ZeRO-1's,
    and where the shards cross to a home (``crosses``: some unit's state lives off the
    device). The planner asks the same (planner/memory.py)."""
    return stage == 1 or crosses


class GradReducer:
    """Reduce-scatters each unit's gradients into this rank's shard and keeps the shards
    until ``zero_grad``: ``grad_of`` reads them, ``got`` says which parameters got a
    gradient. Owns the ``tracker`` that follows backward and tells it when to reduce.

    Args:
        visible: shows the reduced rows on ``p.grad`` (visible.py).
        landing: the step's landing target (landing.py's ``Landing``): where a reduced shard
            goes as soon as it is final, under offload.
        gatherer: ZeRO-3's gatherer (a unit's gathered parameters are freed once its
            gradients are packed; the reduction order follows its forward order), or None.
    """

    def __init__(self, ctx, visible, landing, gatherer=None):
        self.ctx, self.visible, self.landing = ctx, visible, landing
        self.comm_of, self.pool, self.replicas, self.timing = \
            ctx.comm_of, ctx.pool, ctx.replicas, ctx.timing
        self.stage = ctx.stage
        self.reduce_dtype = ctx.plan.precision.reduce_dtype    # None: the compute dtype
        self.no_sync = False
        self.grad_shard: dict[Unit, torch.Tensor | None] = {}   # made at the first reduction
        # Slots that got a gradient on this rank since zero_grad (step_grads.py's [Note:
        # parameters without a gradient]).
        self.got: set[ParamSlot] = set()
        # [Note: a gradient no rank gave]: whether this rank's ``got`` is every rank's
        # (one rank, no replicas, no tensor parallelism), and whether backward asks them.
        self.alone = ctx.comm.world == 1 and self.replicas is None and ctx.groups.model is None
        self.asks_union = False
        self.unreduced = False                  # gradients on the params no reduction took
        self._kept: dict[Unit, torch.Tensor] = {}   # ZeRO-2/3 without offload: their memory
        self._fresh = {u: True for u in ctx.units}  # next reduction overwrites, not adds
        self._send: dict[Unit, torch.Tensor] = {}
        self._packed: dict[Unit, set] = {}      # slots whose gradient is in the send buffer
        self._spread_fresh: dict[Unit, bool] = {}   # a compact reduction's: copy, not add
        self._to_average = None                 # [Note: HSDP's average] (unit, work, ...)
        # to_owner.py's [Note: gradients reduced to their owner]: None, or the owned slots'
        # layout, from a reduction that starts afresh on (``pending`` until then).
        self.to_owner: ToOwner | None = None
        self._pending: tuple | None = None      # (the layout, or None,) to come
        # [Note: the reduce stream], for the reductions during backward (at the step there
        # is no compute to overlap).
        device = ctx.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.tracker = BackwardTracker(self, ctx, gatherer)

    def _dtype(self, unit: Unit) -> torch.dtype:
        return self.reduce_dtype or unit.compute_dtype

    def remove_hooks(self) -> None:
        self.tracker.remove_hooks()
        self.visible.withdraw(keep_edits=False)
        self.visible.remove_hooks()

    # -- packing and reducing ------------------------------------------------------------
    def reduce_to_owners(self, to_owner: ToOwner | None) -> None:
        """Owned gradients go to their owners (to_owner.py's note), or (None) none, from
        the first reduction of a step on: now, where no unit holds gradients yet, else
        after ``zero_grad``. The same on every rank (an optimizer's binding)."""
        if all(self._fresh.values()):
            self.to_owner, self._pending = to_owner, None
            return
        held = self.to_owner.reduced if self.to_owner is not None else set()
        if held and (to_owner is None or to_owner.owner != self.to_owner.owner):
            raise ValueError(
                "zerofn: another optimizer takes over after a backward that reduced "
                f"{len(held)} owned gradients whole to the ranks that stepped them "
                "(shard_params(reduce_to_owner=True)), and it would step them elsewhere or "
                "on rows no rank keeps; call zero_grad() before the first step of the new "
                "optimizer, and run backward again.")
        self._pending = (to_owner,)

    def to_its_owner(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s gradient since ``zero_grad`` was reduced to its owner."""
        return self.to_owner is not None and slot in self.to_owner.reduced

    def _width(self, unit: Unit) -> int:
        """Columns per rank of the unit's send buffer: its shard's, but for owned slots
        reduced to their owners."""
        if self.to_owner is None:
            return unit.shard_numel
        return self.to_owner.width.get(unit, unit.shard_numel)

    def _cols(self, unit: Unit, slot: ParamSlot) -> slice:
        if self.to_owner is None or unit not in self.to_owner.width:
            return slot.cols
        return self.to_owner.cols(slot)

    def has_send_buffer(self, unit: Unit) -> bool:
        return unit in self._send

    def _send_buffer(self, unit: Unit) -> torch.Tensor:
        """A pooled rank-major buffer, not zeroed: padding is never read back, and the
        columns of parameters without a gradient are zeroed when the unit is reduced."""
        send = self._send.get(unit)
        if send is None:
            if self.tracker.in_backward:
                # Backward's send buffers count against the in-flight bound while they
                # fill, not only once their reduction starts. (Packing at the step
                # overlaps the previous unit's reduction instead.)
                comm = self.comm_of(unit)
                full = comm.world * self._width(unit)
                comm.make_room((full + comm.scratch_numel(full)) * self._dtype(unit).itemsize)
            send = self.pool.take(self.comm_of(unit).world * self._width(unit),
                                  self._dtype(unit), unit.device)
            self._send[unit] = send
            self._packed[unit] = set()
        return send

    def _pack_grad(self, unit: Unit, slot: ParamSlot, grad: torch.Tensor) -> None:
        world = self.comm_of(unit).world
        if self.to_owner is not None and slot in self.to_owner.owner:
            self.to_owner.pack(slot, _local_grad(slot, grad), self._dtype(unit), world)
            return
        send = self._send_buffer(unit).view(world, self._width(unit))
        scatter_to_ranks(_local_grad(slot, grad), send[:, self._cols(unit, slot)])
        self._packed[unit].add(slot)

    def pack(self, unit: Unit, slot: ParamSlot) -> None:
        """``slot``'s gradient into the unit's send buffer; ZeRO-2/3 let it go."""
        self._pack_grad(unit, slot, slot.param.grad)
        if self.stage >= 2:     # ZeRO-1 keeps its full gradients until backward ends
            slot.param.grad = None

    def reduce(self, unit: Unit) -> None:
        """Reduce-scatter the unit's packed gradients (zeros for those it has none of) into
        its shard, on the reduce stream during backward (the note)."""
        comm = self.comm_of(unit)
        if self.to_owner is not None and unit in self.to_owner.width:
            self._reduce_to_owners(unit, comm)
        send = self._send_buffer(unit)
        ranks = send.view(comm.world, self._width(unit))
        owned = self.to_owner.owner if self.to_owner is not None else {}
        for s in unit.trainable:
            if s not in self._packed[unit] and s not in owned:
                ranks[:, self._cols(unit, s)].zero_()
        del self._send[unit], self._packed[unit]
        out = self._reduction_target(unit)
        stream = self._reduce_stream()
        buffers = [send]
        scratch = None
        if comm.scratch_numel(send.numel()):
            scratch = self.pool.take(comm.scratch_numel(send.numel()), send.dtype,
                                     unit.device, stream)
            buffers.append(scratch)
        nbytes = sum(b.nbytes for b in buffers)
        if stream is None:
            work = self.timing.issue(
                "reduce_scatter", "reduce", unit.name,
                lambda: comm.reduce_scatter(out, send, True, scratch), "reduce_wait")
            if self.replicas is None:
                comm.enqueue(work, nbytes, functools.partial(self._reduced, unit, buffers, out))
            else:   # [Note: HSDP's average]
                self._average()
                self._to_average = (unit, work, buffers, out)
        else:   # [Note: the reduce stream]
            with self._on_stream():
                # (this wait holds the side stream, not the step: _join's does)
                self.timing.issue(
                    "reduce_scatter", "reduce", unit.name,
                    lambda: comm.reduce_scatter(out, send, True, scratch), "reduce_wait",
                    stall=False).wait()
                if self.replicas is not None:   # (a fixed point in order: on the stream)
                    self._average_over_replicas(unit, out, stall=False).wait()
                spent = self._post_reduce(unit, out)
                ready = self.stream.record_event()
            comm.enqueue(None, nbytes, functools.partial(self._give, buffers + spent, ready))

    def _reduce_to_owners(self, unit: Unit, comm) -> None:
        """Each owned slot's gradient reduced whole to its owner, before the unit's
        reduce-scatter (to_owner.py's note), every rank in the same order. Each is waited
        for at once, on the current stream: gloo's rooted collectives left in flight
        together have delivered wrong rows (comm.py's [Note: gather and scatter wait]).
        Under HSDP the owner then averages it over its replicas, which own the same slots
        (the same rank of their shard groups), so every replica group issues them alike."""
        fresh = self._fresh[unit] or self.grad_shard.get(unit) is None
        dtype, divisor = self._dtype(unit), self.ctx.divisor(unit)
        for s in unit.trainable:
            owner = self.to_owner.owner.get(s)
            if owner is None:
                continue
            send = self.to_owner.send_of(s, dtype, comm.world, unit.device)
            self.timing.issue("reduce", "reduce", unit.name,
                              lambda: comm.reduce(send, owner, async_op=True),
                              "reduce_wait").wait()
            if comm.rank == owner:
                if self.replicas is not None:   # the replicas' owners: the same rank of each
                    op = dist.ReduceOp.AVG if self.replicas.averages else dist.ReduceOp.SUM
                    with self.timing.collective("replicate.all_reduce"):
                        self.replicas.all_reduce(send, op)
                self.to_owner.reduced_into(s, send, divisor, fresh)
            self.to_owner.reduced.add(s)

    def _average(self) -> None:
        """HSDP: wait for the last unit's reduce-scatter and start its all-reduce over the
        replicas ([Note: HSDP's average]); the step's reads of it wait in the queue."""
        if self._to_average is None:
            return
        unit, work, buffers, out = self._to_average
        self._to_average = None
        work.wait()
        self.comm_of(unit).enqueue(self._average_over_replicas(unit, out),
                                   sum(b.nbytes for b in buffers),
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
        if self.to_owner is not None and unit in self.to_owner.width:
            # to_owner.py's note: the kept columns, compact, spread out once reduced
            if shard is None:
                self.grad_shard[unit] = self._new_shard(unit)
            self._spread_fresh[unit] = fresh
            return self.pool.take(self._width(unit), self._dtype(unit), unit.device,
                                  self._reduce_stream())
        if not fresh:
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device,
                                  self._reduce_stream())
        if shard is None:
            shard = self._new_shard(unit)
            self.grad_shard[unit] = shard
        return shard

    def _lent(self) -> bool:
        return lends_shards(self.stage, self.landing.crosses)

    def _new_shard(self, unit: Unit) -> torch.Tensor:
        """Lent shards come from the pool (given back at zero_grad); otherwise the shard is
        the unit's gradient memory, kept: every unit's is a view of one buffer per dtype,
        made at the first reduction (one large allocation, where one per unit in backward
        would fragment the host heap among the activations)."""
        if self._lent():
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device,
                                  self._reduce_stream())
        if not self._kept:
            for dtype in {self._dtype(u) for u in self.ctx.units}:
                mine = [u for u in self.ctx.units if self._dtype(u) == dtype]
                flat = torch.empty(sum(u.shard_numel for u in mine), dtype=dtype,
                                   device=unit.device)
                self._kept.update(zip(mine, flat.split([u.shard_numel for u in mine])))
        return self._kept[unit]

    def _reduce_stream(self):
        """The side stream reductions run on (CUDA, during backward), else None."""
        return self.stream if self.tracker.in_backward else None

    def _on_stream(self):
        """The reduce stream, ordered after the current stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
        return torch.cuda.stream(self.stream)

    def _join(self) -> None:
        """The current stream waits for every reduction so far (CUDA)."""
        if self.stream is not None:
            with self.timing.span("reduce_wait", "reduce_wait"):
                torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)

    def _reduced(self, unit: Unit, buffers: list[torch.Tensor], out: torch.Tensor) -> None:
        self._give(buffers + self._post_reduce(unit, out))

    def _give(self, buffers: list[torch.Tensor], ready=None) -> None:
        for b in buffers:
            self.pool.give(b, ready)

    def _post_reduce(self, unit: Unit, out: torch.Tensor) -> list[torch.Tensor]:
        """Average, then put the reduced rows where the step reads them; returns the
        buffers this spent."""
        divisor = self.ctx.divisor(unit)    # [Note: experts' gradients] in context.py
        if divisor > 1:
            out.div_(divisor)
        target = self.grad_shard[unit]
        spent = []
        if self.to_owner is not None and unit in self.to_owner.width:
            fresh = self._spread_fresh.pop(unit)
            if not fresh and self.landing.crosses:
                self.ctx.copies.before_device_write(unit)
            self.to_owner.spread(unit, out, target, fresh)
            spent.append(out)
        elif out is not target:
            if self.landing.crosses:    # a copy of the shard to its home may still read it
                self.ctx.copies.before_device_write(unit)
            target.add_(out)
            spent.append(out)
        self.landing.shard_ready(unit, target, self.got)
        return spent

    def finish_backward(self, reduced: bool) -> None:
        """The end of backward: every reduction issued is waited for; after a reducing one
        ZeRO-1's whole gradients go, and the reduced rows are shown on ``p.grad``."""
        self._average()
        for comm in self.ctx.comms:
            comm.drain()
        self._join()
        if reduced:
            self.unreduced = False
            if self.stage == 1:
                self._free_whole_grads()
            held = {s: self.to_owner.owner[s] for s in self.to_owner.reduced} \
                if self.to_owner is not None else {}
            self.visible.show(self.grad_shard, self.union(), held)   # visible.py's [Note:
            # gradients as a loop sees them]

    def union(self) -> set[ParamSlot] | None:
        """[Note: a gradient no rank gave] The trainable slots some rank's backwards since
        ``zero_grad`` gave a gradient, where known at the end of backward; else None (the
        step's vote learns it). On one rank, this rank's. On more, once a step's vote found a
        parameter no rank used (every rank learnt it from the same vote, so all ask
        together), from the next backward on: one small all-reduce of the same ballot the
        vote takes, at each reducing backward's end. Before that, and under HSDP, tensor
        parallelism or ``groups=``, None."""
        if self.alone:
            return self.got
        # (Under groups= the ranks' slots are different experts: one ballot cannot hold them.)
        other_layouts = (self.replicas is not None or self.ctx.groups.model is not None
                         or self.ctx.own)
        if not self.asks_union or other_layouts:
            return None
        trainable = [s for u in self.ctx.units for s in u.trainable]
        device = self.ctx.device
        ballot = torch.tensor([s in self.got for s in trainable], dtype=torch.float32,
                              device=device)
        with self.timing.collective("all_reduce"):
            self.ctx.comm.all_reduce(ballot)
        return {s for s, n in zip(trainable, ballot.tolist()) if n > 0}

    # -- at the optimizer step -----------------------------------------------------------
    def sync(self) -> None:
        """Make every unit's reduced gradient shard ready. ZeRO-1 reduces here what
        backwards under ``no_sync`` left on its parameters with no reducing one after them."""
        if self.stage == 1 and self.unreduced:
            for unit in self.ctx.units:
                if not unit.trainable:
                    continue
                for s in unit.trainable:
                    grad = s.param.grad     # (not the reduced rows shown on it)
                    if grad is not None and grad is not self.visible.shown.get(s):
                        self._pack_grad(unit, s, grad)
                self.reduce(unit)
            self._free_whole_grads()
        self.unreduced = False
        self._average()
        for comm in self.ctx.comms:
            comm.drain()
        self._join()

    def has_grads(self, unit: Unit) -> bool:
        return not self._fresh[unit]

    def grad_of(self, unit: Unit, slot: ParamSlot) -> torch.Tensor | None:
        """The reduced gradient of this rank's rows of ``slot``, once ``sync`` has run."""
        if not self.has_grads(unit) or not slot.requires_grad:
            return None
        if self.to_its_owner(slot):
            return self.to_owner.grad(slot, self.to_owner.owner[slot] == self.comm_of(unit).rank,
                                      self._dtype(unit), unit.device)
        return slot.shard_of(self.grad_shard[unit])

    def _free_whole_grads(self) -> None:
        """ZeRO-1, once a reduction took them: the whole gradients are spent."""
        for unit in self.ctx.units:
            for s in unit.trainable:
                s.param.grad = None

    def zero_rows(self, slots) -> None:
        """The loop's ``zero_grad`` reached only ``slots``: their reduced rows start over
        (the next reduction adds to zeros), and they got no gradient since."""
        for unit in self.ctx.units:
            shard = self.grad_shard.get(unit)
            for s in unit.trainable:
                if s in slots:
                    self.got.discard(s)
                    if self.to_owner is not None:
                        self.to_owner.forget([s])
                    if shard is not None:
                        s.shard_of(shard).zero_()

    def zero_grad(self) -> None:
        """What ``optimizer.zero_grad()`` means for the shards: the next reduction starts
        over; shards taken from the pool go back to it (the caller has waited for their
        copies to the host)."""
        lent = self._lent()
        self.visible.withdraw(keep_edits=False)
        self.visible.unwatch()
        self.got.clear()
        if self.to_owner is not None:
            self.to_owner.clear()
        if self._pending is not None:
            (self.to_owner,), self._pending = self._pending, None
        for unit in self.ctx.units:
            self._fresh[unit] = True
            if lent and self.grad_shard.get(unit) is not None:
                self.pool.give(self.grad_shard.pop(unit))
            for s in unit.slots:
                s.param.grad = None


def _local_grad(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    """What is reduced of a gradient: a DTensor parameter's ([Note: parameters another
    parallelism split] in core/units.py) in its parameter's own placements first (a
    ``Partial`` sum over the tensor-parallel ranks is summed there, as FSDP2 does), then
    its local piece."""
    if not isinstance(grad, DTensor):
        return grad
    if slot.spec is not None and tuple(grad.placements) != tuple(slot.spec.placements):
        grad = grad.redistribute(placements=slot.spec.placements)
    return grad._local_tensor
