"""ZeRO-3: gather a unit's full parameters just before it runs, free them after.

[Note: saved tensors] Autograd keeps the full weights a unit's forward used (a Linear
saves its weight, or a transposed view of it) until backward. Keeping them would keep
every unit gathered. Instead, while the model runs forward, a saved-tensor hook swaps any
tensor living in a gathered buffer for a small marker, and the unpack hook gathers the
unit again when backward needs it. Gathered buffers come from the pool, so a freed unit's
memory serves the next unit. With activation checkpointing the recomputed forward runs
inside backward; there the full parameters are kept until the unit's gradients are
reduced.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .hooks import eager, in_backward, on_backward_begin
from .subclass import (SavedSubclass, compute_weight, hooked_slots, is_built_subclass,
                       part_storages, policy_of, start_gather as start_hooked, subclass_of)
from ..core.units import Unit, local_of, set_local


class _SavedView:
    """Where a saved tensor lay in its unit's gathered buffer; ``spec``: the DTensor it was
    the local piece of (a parameter tensor parallelism split), or None; ``slot``: the
    hooked parameter whose post-hook tensor it lay in instead (runtime/subclass.py), or
    None."""

    __slots__ = ("offset", "size", "stride", "unit", "spec", "slot")

    def __init__(self, unit: Unit, t: torch.Tensor, spec=None, slot=None):
        self.unit, self.offset, self.size, self.stride = unit, t.storage_offset(), t.size(), t.stride()
        self.spec, self.slot = spec, slot


class ParamGatherer:
    """ZeRO-3's gathers: ``pre_forward``/``post_forward`` around each unit's forward,
    ``pre_backward`` when backward reaches a unit's outputs, ``end_backward`` after it.
    Owns the gathered buffers (from the pool) between a unit's gather and its free; the
    order units ran in (``order``) lives until the next complete forward.

    Args:
        reader: parameter offload to NVMe: the staged shards come from the swap file
            through it (nvme.ParamReads), read ahead in ``order``; else None, and they are
            the unit's compute shard (``table[unit].shard``).
    """

    def __init__(self, ctx, reader=None):
        pool, units = ctx.pool, ctx.units
        sharding = ctx.plan.sharding
        self.comm_of, self.pool, self.units = ctx.comm_of, pool, units
        self.table = ctx.table
        self.timing = ctx.timing
        self._pre_backward = ctx.guard(self.pre_backward)
        # Parameter offload: each host shard goes to the device on the copy stream when its
        # gather starts (a prefetch, mostly), and the gather follows it there (copies.py).
        self.staged = ctx.plan.offload.params
        self.copies = ctx.copies
        self.reader = reader
        self.prefetch = sharding.prefetch
        self.reshard_after_forward = sharding.reshard_after_forward
        self.full: dict[Unit, torch.Tensor] = {}
        self._pending: dict[Unit, tuple] = {}
        self._by_storage: dict[int, Unit] = {}
        self._by_hooked: dict[int, tuple] = {}     # post-hook tensors' storage: (unit, slot)
        self._built: dict = {}      # slot -> its post-hook's subclass, while gathered
        self.mesh = ctx.groups.mesh    # the 1-D mesh a subclass's pre-hook is given
        self.policy = policy_of(ctx.plan)
        self.order: list[Unit] = []            # forward order of the last complete forward
        self._recording: list[Unit] = []
        self._placeholders: dict[tuple, torch.Tensor] = {}
        self._hooks_ctx = None
        self._root_depth = 0     # the root's forwards running, nested ones included
        # The saved-tensor hooks hold the gatherer weakly: a collective started under them
        # (a prefetch) keeps them, in C++, in the thread-local state its work captured, and
        # a gather left pending by a forward that raised would close a cycle the collector
        # cannot see (gatherer, work, hooks), keeping the model and all its memory. The
        # hooks on the units' outputs keep the gatherer for any backward that unpacks.
        mine = weakref.ref(self)
        self._saved_hooks = (eager(functools.partial(_pack_for, mine)),
                             eager(functools.partial(_unpack_for, mine)))
        # Gathered buffers of every unit (and backward's send buffers, the same size) share
        # the pool: its buffers are made to fit the largest ([Note: expected sizes]).
        pool.expect(ctx.comm_of(u).world * u.shard_numel for u in units)

    # -- gathering -------------------------------------------------------------------
    def start_gather(self, unit: Unit) -> None:
        if unit in self.full or unit in self._pending or not unit.slots:
            return
        comm, plain = self.comm_of(unit), unit.plain_numel
        recv = self.pool.take(comm.world * plain, unit.compute_dtype, unit.device)
        rows = self.table[unit].shard
        if self.staged and self.reader is not None:
            rows = self.reader.take(unit, lambda: self.copies.before_host_write(unit))
        # A subclass's pre-hook reads its rows where they are: under parameter offload on
        # the host, so that what goes to the device is its outputs (runtime/subclass.py).
        hooked = None
        if hooked_slots(unit):
            hooked = start_hooked(unit, self._hooked_shards(unit, rows), comm, self.mesh,
                                  self.policy, lambda start: self._issue(unit, start))
        work = None
        if plain and not self.staged:
            work = self._all_gather(unit, recv, rows[:plain])
        elif plain:
            # An offloaded shard is copied into this rank's slot and gathered in place.
            # NVMe's staging buffer is reused once this copy has read it.
            mine = recv.view(comm.world, plain)[comm.rank]
            self.copies.to_device(unit, mine, rows[:plain])
            with self.copies.after_to_device(unit):
                work = self._all_gather(unit, recv, mine)
        self._pending[unit] = (work, recv, hooked)

    def _hooked_shards(self, unit: Unit, rows: torch.Tensor) -> list:
        """Each hooked slot and its subclass over the rows its pre-hook reads: the masters
        where they are not the compute rows (mixed precision: FSDP2 hands its hooks the
        full-precision shard), else its rows of ``rows``, the unit's shard."""
        mixed = unit.compute_dtype != unit.master_dtype
        return [(s, subclass_of(s, self.table[s].opt_param if mixed else s.shard_of(rows)))
                for s in hooked_slots(unit)]

    def _all_gather(self, unit: Unit, recv: torch.Tensor, shard: torch.Tensor):
        """The unit's asynchronous all-gather, labelled by the pass that asked for it."""
        return self._issue(unit, lambda: self.comm_of(unit).all_gather(recv, shard,
                                                                       async_op=True))

    def _issue(self, unit: Unit, start):
        """A collective of the unit's gather, started by ``start``, labelled by the pass
        that asked for it."""
        what = "gather[backward]" if in_backward() else "gather[forward]"
        return self.timing.issue("all_gather", what, unit.name, start, "gather_wait")

    def ensure(self, unit: Unit) -> torch.Tensor:
        """The unit's gathered buffer (param-major, each param padded to world*chunk rows)."""
        full = self.full.get(unit)
        if full is not None or not unit.slots:
            return full
        self.start_gather(unit)
        work, recv, hooked = self._pending.pop(unit)
        if work is not None:
            work.wait()
        full = self.pool.take(recv.numel(), unit.compute_dtype, unit.device)
        world = self.comm_of(unit).world
        ranks = recv.view(world, recv.numel() // world)
        for s in unit.slots:
            if s.hooks is not None:
                continue
            n = s.chunk * s.inner
            full[world * s.offset:world * s.offset + world * n].view(world, n).copy_(ranks[:, s.cols])
            set_local(s.param, full[world * s.offset:world * s.offset + s.numel].view(s.shape))
        self.pool.give(recv)
        if hooked is not None:
            hooked.finish(lambda t, s: self._hooked_built(unit, s, t))
        self.full[unit] = full
        if full.numel():
            self._by_storage[full.untyped_storage().data_ptr()] = unit
        return full

    def _hooked_built(self, unit: Unit, s, built: torch.Tensor) -> None:
        """Where the post-hook's weight for ``s`` lies, for the saved tensors; a tensor
        subclass is kept aside (``register_built``), the plain parameter a placeholder."""
        if not is_built_subclass(built):
            self._by_hooked[built.untyped_storage().data_ptr()] = (unit, s)
            return
        self._built[s] = built
        for ptr in part_storages(built):
            self._by_hooked[ptr] = (unit, s)
        set_local(s.param, self.placeholder(s, unit))

    def register_built(self, unit: Unit) -> None:
        """Give the unit's modules the post-hook's subclass to compute with where one was
        built (runtime/subclass.py's [Note: a subclass as the compute weight]). Called once
        the unit's inputs are tracked: its autograd node must come after their identity
        (backward.py's [Note: a unit's backward is done]), so its gradient is in before
        the unit counts as done."""
        for s in hooked_slots(unit):
            built = self._built.get(s)
            if built is not None:
                _register(s, compute_weight(s, built))

    def free(self, unit: Unit) -> None:
        full = self.full.pop(unit, None)
        if full is None:
            return
        self._by_storage.pop(full.untyped_storage().data_ptr(), None)
        for s in unit.slots:
            if s.hooks is not None:
                built = self._built.pop(s, None)
                for ptr in part_storages(built) if built is not None else \
                        [local_of(s.param).untyped_storage().data_ptr()]:
                    self._by_hooked.pop(ptr, None)
            set_local(s.param, self.placeholder(s, unit))
            _register(s, self.table[s].sharded)
        self.pool.give(full)

    def placeholder(self, s, unit: Unit) -> torch.Tensor:
        """A one-element stand-in with the parameter's shape, so autograd metadata holds."""
        key = (unit.compute_dtype, unit.device)
        if key not in self._placeholders:
            self._placeholders[key] = torch.zeros(1, dtype=key[0], device=key[1])
        return self._placeholders[key].expand(s.shape)

    def prefetch_after(self, unit: Unit, step: int) -> None:
        """Start gathering the units that ran after (step=1) or before (step=-1) this one,
        and reading from NVMe the shards of the units after those."""
        if unit not in self.order:
            return
        i = self.order.index(unit)
        ahead = self.order[i + step::step] if 0 <= i + step < len(self.order) else []
        for u in ahead[:self.prefetch]:
            self.start_gather(u)
        if self.reader is not None and len(ahead) > self.prefetch:   # else keep its plan
            self.reader.read_ahead(u for u in ahead[self.prefetch:]
                                   if u not in self.full and u not in self._pending)

    # -- forward hooks ---------------------------------------------------------------
    def pre_forward(self, unit: Unit, is_root: bool) -> None:
        if is_root and not in_backward():
            # A root called inside its own forward (Lightning's training_step calling the
            # module it is a method of) is one forward: its hooks pushed once, popped once.
            self._root_depth += 1
            if self._root_depth == 1:
                self._recording = []
                if torch.is_grad_enabled():
                    self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(
                        *self._saved_hooks)
                    self._hooks_ctx.__enter__()
        if not in_backward() and unit not in self._recording:
            self._recording.append(unit)
        self.ensure(unit)
        for s in unit.slots:
            _register(s, s.param)
        if not in_backward():
            self.prefetch_after(unit, 1)

    def post_forward(self, unit: Unit, is_root: bool, output) -> None:
        if in_backward():
            return   # a checkpointed recompute: backward is about to use these params
        if torch.is_grad_enabled():
            on_backward_begin(output, eager(lambda grad, u=unit: self._pre_backward(u)))
        if self.reshard_after_forward:
            self.free(unit)
        if is_root:
            self._root_depth -= 1
            if self._root_depth == 0:
                self._forward_done()

    def _forward_done(self) -> None:
        """The outermost root forward ended: its saved-tensor hooks go, its units' order
        is the next forward's prefetch order."""
        backward_follows = self._hooks_ctx is not None
        if backward_follows:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        self.order = self._recording
        if backward_follows and self.reader is not None:
            # Backward starts at the root, then goes through the units in reverse.
            first = self.order[:1] + self.order[:0:-1]
            self.reader.read_ahead(u for u in first if u not in self.full)

    def pre_backward(self, unit: Unit) -> None:
        """Gradients reached the unit's outputs: gather and register its parameters, so a
        checkpointed recompute of its forward (which bypasses the unit's own hooks) sees
        them, and start gathering the unit that ran before it."""
        gathered = unit in self.full
        self.ensure(unit)
        for s in unit.slots:
            _register(s, s.param)
        self.register_built(unit)
        if not gathered:
            self.prefetch_after(unit, -1)

    def end_backward(self) -> None:
        for unit in list(self.full):
            self.free(unit)
        self.discard_pending()
        if self.reader is not None:
            # The next forward's first shards: read now, or again after a step rewrites them.
            self.reader.read_ahead(iter(self.order))

    def discard_pending(self) -> None:
        """Wait for and drop the gathers nothing used: a prefetch of a unit that backward
        had already done (nested units) or skipped, or one a forward started for a unit
        that did not run. They hold the shards as they were, which the optimizer step (or
        a load) is about to rewrite: the next forward must gather again. (Normally no
        gather is pending here; the next forward's own prefetches start afresh.)"""
        for work, recv, hooked in self._pending.values():
            for w in [work] + ([hooked.work] if hooked else []):
                if w is not None:
                    w.wait()
            self.pool.give(recv)
        self._pending.clear()

    # -- saved tensors ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        """[Note: saved tensors] A marker for a tensor in a gathered buffer; any other
        tensor detached. Kept as given, a tensor the saving node output would hold that
        node (its grad_fn), which holds it: a cycle through C++ that the collector cannot
        see, leaking the graph of every forward backward never reaches (an evaluation with
        gradients enabled). Autograd keeps the grad_fn and restores it at unpack."""
        if isinstance(t, DTensor):
            local = t._local_tensor
            if local.__class__ is not torch.Tensor:   # (a collective's result, still owed)
                return t
            unit = self._by_storage.get(local.untyped_storage().data_ptr())
            return t.detach() if unit is None else _SavedView(unit, local, t._spec)
        if t.__class__ not in (torch.Tensor, nn.Parameter) or t.is_sparse:
            return self._pack_subclass(t) if self._built and is_built_subclass(t) else t
        ptr = t.untyped_storage().data_ptr()
        unit = self._by_storage.get(ptr)
        if unit is None and ptr in self._by_hooked:
            unit, slot = self._by_hooked[ptr]
            return _SavedView(unit, t, slot=slot)
        return t.detach() if unit is None else _SavedView(unit, t)

    def _pack_subclass(self, t: torch.Tensor):
        """A post-hook's subclass weight, or a view of it, saved by autograd: a marker that
        rebuilds it from the unit's next gather; any other subclass as it is."""
        names, _ = t.__tensor_flatten__()
        for n in names:
            found = self._by_hooked.get(getattr(t, n).untyped_storage().data_ptr())
            if found is not None and found[1] in self._built:
                unit, slot = found
                return SavedSubclass(unit, slot, t, self._built[slot])
        return t

    def _unpack(self, saved):
        if not isinstance(saved, (_SavedView, SavedSubclass)):
            return saved
        gathered = saved.unit in self.full
        full = self.ensure(saved.unit)
        if not gathered:
            self.prefetch_after(saved.unit, -1)
        if isinstance(saved, SavedSubclass):
            return saved.rebuild(self._built[saved.slot])
        if saved.slot is not None:     # the hooked parameter's tensor, built anew
            full = local_of(saved.slot.param)
        local = full.as_strided(saved.size, saved.stride, saved.offset)
        return local if saved.spec is None else DTensor(local, saved.spec, requires_grad=False)


def _pack_for(gatherer, t: torch.Tensor):
    return gatherer()._pack(t)


def _unpack_for(gatherer, saved):
    return gatherer()._unpack(saved)


def _register(slot, param: nn.Parameter) -> None:
    for module, name in slot.owners:
        module._parameters[name] = param
