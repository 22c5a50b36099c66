"""Backward, as the reducer's tracker follows it: when each unit's gradients are complete,
and in which order the ranks reduce the units.

[Note: ZeRO-1 reduces in backward] ZeRO-1 reduces as ZeRO-2 does, each unit as its
gradients are complete, overlapping the rest of backward, into a pooled shard; it keeps
the whole gradients until backward ends (ZeRO-2 frees each once packed), then lets them
go: the reduced rows are what the step and the loop (``p.grad``) see. Accumulation outside
``no_sync`` reduces each backward and adds the shards, as DDP all-reduces each backward;
under ``no_sync`` the whole gradients accumulate on the parameters and the next reducing
backward (or, failing one, the step) reduces their sum.

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
parameters as soon as its gradients are packed, waiting or not, unless the unit has
frozen parameters and its backward is still to reach its inputs: their gradients need
the frozen weights after the unit's last gradient (a LoRA block's base weights, after
its adapters'), and freed they would be gathered again and held to backward's end. Such
a unit, and one with no gradients at all, is freed once its backward is done (the next
note).

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
"""
from __future__ import annotations

import enum
import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.units import ParamSlot, Unit


class BackwardPhase(enum.Enum):
    """Where backward is, as the tracker follows it (one variable, as FSDP2's
    ``TrainingState``)."""
    IDLE = "idle"                  # no backward under way
    REDUCING = "reducing"          # each unit reduced as it completes
    ACCUMULATING = "accumulating"  # under no_sync: the gradients stay on the parameters


class BackwardTracker:
    """Follows backward for its reducer: counts each unit's gradients, finds when a unit
    is done, and calls the reducer's ``pack`` and ``reduce`` in the ranks' common order
    (the notes). Owned by the reducer; its hooks live as long as it does
    (``remove_hooks``).

    Args:
        reducer: the ``GradReducer`` it tells.
        gatherer: ZeRO-3's: a unit's gathered parameters are freed once its gradients are
            packed, and its forward order gives the first backward's reduction order.
    """

    def __init__(self, reducer, ctx, gatherer=None):
        self.reducer, self.gatherer = reducer, gatherer
        units = ctx.units
        self.units = units
        # backward's entry points, through the guard (the hooks call these)
        self.grad_arrived = ctx.guard(self._on_grad)
        self.unit_done = ctx.guard(self.backward_done)
        self._end = ctx.guard(self._end_backward)
        self.phase = BackwardPhase.IDLE
        self._remaining: dict[Unit, int] = {}
        self._held: dict[Unit, list] = {}       # slots whose gradient waits on the parameter
        # [Note: one reduction order]
        trainable = [u for u in units if u.trainable]
        self._order = trainable[-2::-1] + trainable[-1:]
        self._learned = False                   # _order is still the first backward's
        self._completed: list[Unit] = []        # the first backward's, as they completed
        self._next = 0                          # _order's first unit not reduced yet
        # [Note: a unit's backward is done] each unit's forwards whose backward is to come:
        # their identities' contexts, which die with a graph backward never reaches.
        self._forwards: dict[Unit, weakref.WeakSet] = {u: weakref.WeakSet() for u in units}
        self._hooks = []
        mine = weakref.ref(self)
        # What each unit's identity calls in backward (made once: forwards are a hot path).
        self._done = {u: functools.partial(backward_done_hook, mine, ui)
                      for ui, u in enumerate(units)}
        for ui, u in enumerate(units):
            for si, s in enumerate(u.trainable):
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    functools.partial(grad_hook, mine, ui, si)))

    @property
    def in_backward(self) -> bool:
        return self.phase is not BackwardPhase.IDLE

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    def _on_grad(self, unit: Unit, slot: ParamSlot, param) -> None:
        self.reducer.unreduced = True
        self.reducer.got.add(slot)
        if self.phase is BackwardPhase.IDLE:
            self._begin_backward()
        if self.phase is not BackwardPhase.REDUCING:
            return
        self._held.setdefault(unit, []).append(slot)
        self._remaining[unit] -= 1
        if self._remaining[unit] == 0 or self.reducer.has_send_buffer(unit) \
                or self._worth_a_buffer(unit):
            for s in self._held.pop(unit):
                self.reducer.pack(unit, s)
        if self._remaining[unit] == 0:
            self._complete(unit)

    def _complete(self, unit: Unit) -> None:
        """[Note: one reduction order] Reduce the units now complete (none of their
        gradients remaining) from the first not reduced yet in the common order."""
        if not self._learned:
            self._completed.append(unit)
        if self.gatherer is not None and not self._frozen_still_needed(unit):
            self.gatherer.free(unit)      # its gradients are packed: ZeRO-3 lets it go
        while self._next < len(self._order) and self._remaining[self._order[self._next]] == 0:
            self.reducer.reduce(self._order[self._next])
            self._next += 1

    def track_forward(self, unit: Unit, args: tuple, kwargs: dict):
        """``(args, kwargs)`` of a forward of ``unit``, those that need a gradient passed
        through the identity whose backward reports when the unit's backward is done
        ([Note: a unit's backward is done]); None where none needs one."""
        if not unit.trainable and self.gatherer is None:
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
        if self.phase is BackwardPhase.IDLE:
            self._begin_backward()
        self._forwards[unit].discard(forward)
        if self._forwards[unit] or self.phase is not BackwardPhase.REDUCING:
            return
        if self._remaining[unit] <= 0:
            if self.gatherer is not None:   # (kept for its frozen weights, or none to pack)
                self.gatherer.free(unit)
            return
        self._pack_the_rest(unit)
        self._remaining[unit] = 0
        self._complete(unit)

    def _frozen_still_needed(self, unit: Unit) -> bool:
        """Whether ``unit`` has frozen parameters and a forward whose backward has not yet
        reached its inputs (the note on the reduction order)."""
        return len(unit.trainable) < len(unit.slots) and bool(self._forwards[unit])

    def _begin_backward(self) -> None:
        self.phase = BackwardPhase.ACCUMULATING if self.reducer.no_sync else BackwardPhase.REDUCING
        self._remaining = {u: len(u.trainable) for u in self.units}
        self._held = {}
        self._completed, self._next = [], 0
        if not self._learned and self.gatherer is not None:
            ran = [u for u in reversed(self.gatherer.order) if u in self._order]
            self._order = ran + [u for u in self._order if u not in ran]
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _worth_a_buffer(self, unit: Unit) -> bool:
        """[Note: late send buffers] A unit's first gradients can arrive long before its
        last: the root's final norm at the start of backward, its tied embedding at the very
        end. Taking the unit's send buffer then would hold a whole unit's worth of memory
        through backward for a few small tensors, so gradients wait on their parameters
        until they make up half the unit."""
        held = sum(s.numel for s in self._held[unit])
        return 2 * held >= self.reducer.comm_of(unit).world * unit.shard_numel

    def _pack_the_rest(self, unit: Unit) -> None:
        """Pack the gradients of an incomplete unit that are on its parameters: those held
        back, and those accumulated under no_sync that this backward did not add to."""
        self._held.pop(unit, None)
        for s in unit.trainable:
            if s.param.grad is not None:
                self.reducer.pack(unit, s)

    def _end_backward(self) -> None:
        reducing = self.phase is BackwardPhase.REDUCING
        for unit in self._order[self._next:] if reducing else ():
            if self._remaining[unit] > 0:
                self._pack_the_rest(unit)
            self.reducer.reduce(unit)
        self.reducer.finish_backward(reducing)
        if reducing and not self._learned:
            self._learn_order()
        self.phase = BackwardPhase.IDLE
        if self.gatherer is not None:
            self.gatherer.end_backward()

    def _learn_order(self) -> None:
        """[Note: one reduction order] Adopt rank 0's completion order of this backward."""
        self._learned = True
        mine = self._completed + [u for u in self._order if u not in self._completed]
        reducer = self.reducer
        groups = [c for c in (reducer.ctx.comm, reducer.replicas)
                  if c is not None and c.world > 1]
        if groups:
            index = {u: i for i, u in enumerate(self._order)}
            order = torch.tensor([index[u] for u in mine], device=reducer.ctx.device)
            for comm in groups:     # HSDP: rank 0 of each shard group, then of replicas
                comm.broadcast(order, 0)
            mine = [self._order[i] for i in order.tolist()]
        self._order = mine


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


def backward_done_hook(tracker, ui: int, forward) -> None:
    """What each unit's identity calls in backward; holds neither the tracker nor the unit
    (see ``grad_hook``)."""
    tracker = tracker()
    if tracker is not None:
        tracker.unit_done(tracker.units[ui], forward)


def grad_hook(tracker, ui: int, si: int, param) -> None:
    """The post-accumulate-grad hook. It holds neither the tracker nor the parameter: the
    hook lives in C++, where the garbage collector cannot see a cycle through it, and such
    a cycle would keep the model and all its memory (device, pinned host) after its last
    use."""
    tracker = tracker()
    if tracker is not None:
        unit = tracker.units[ui]
        tracker.grad_arrived(unit, unit.trainable[si], param)
