"""Where each unit's parameter rows live for compute, and how they follow the masters.

At set-up each unit is laid out: its home takes this rank's rows as masters
(homes/base.py), and under ZeRO-3 the unit gets a flat compute shard registered as
``Shard(0)`` DTensor parameters, as FSDP2 registers them: the masters themselves where they
are device memory in the compute dtype, else a copy of them in it (a flat buffer here), or
under ``params=True`` the shard its home holds. A model built on the meta device is
materialized and initialized module by module on the way (materialize.py), each unit laid
out as soon as its modules are.

After each step (or a load) the compute rows follow the updated masters: copied into the
ZeRO-3 shard, or all-gathered into the full parameters (ZeRO-1/2, one unit overlapping the
next's step). ``full_tensor`` and ``gather_unit`` gather rows back into whole tensors.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..core.units import aligned, gather_from_ranks, local_of, set_local
from .agree import gather
from .materialize import Materializer, meta_state
from .homes import FlatBuffers
from .subclass import subclass_of


def _cast(slot, data: torch.Tensor) -> None:
    """The slot's whole parameter now holds ``data``, in ``data``'s dtype. A DTensor
    parameter keeps its dtype for good: it is replaced by one of ``data``'s dtype (its
    modules register the new one; ``slot.aliases`` keeps the user's, which an optimizer
    built before may hold)."""
    param = slot.param
    if not isinstance(param, DTensor) or param.dtype == data.dtype:
        return set_local(param, data)
    spec = DTensorSpec(param._spec.mesh, param._spec.placements,
                       TensorMeta(param.shape, param.stride(), data.dtype))
    new = nn.Parameter(DTensor(data, spec, requires_grad=param.requires_grad),
                       requires_grad=param.requires_grad)
    slot.aliases.append(param)
    slot.param = new
    for module, name in slot.owners:
        module._parameters[name] = new


class Shards:
    """Lays out every unit's rows (``lay_out``) and keeps the compute rows current
    (``refresh_unit``, ``refresh_compute``); see the module note.

    Args:
        model: the model (its meta-built parameters are materialized here).
        homes: where each unit's masters live (homes/).
        gatherer: ZeRO-3's gatherer (its placeholders stand for unsharded parameters), or
            None.
    """

    def __init__(self, ctx, model: nn.Module, homes, gatherer):
        self.ctx, self.model, self.homes, self.gatherer = ctx, model, homes, gatherer
        self.table = ctx.table
        self.meta = meta_state(model) is True      # built on the meta device: materialize
        # ZeRO-3's sharded units: a unit without parameters has no rows to shard, and the
        # persistent one stays whole on every rank.
        self.sharded_units = [u for u in ctx.units
                        if ctx.stage == 3 and not u.replicated and u.slots]
        self.flats: list[FlatBuffers] = []       # the compute shards' buffers, for accounting
        self._compute: dict = {}                  # unit -> its compute shard's buffer
        self._unit_of = {s: u for u in ctx.units for s in u.slots}
        # Slots whose full parameters this step wrote whole on every rank (owned.py's
        # broadcast at ZeRO-1/2): the units' all-gathers leave them out.
        self.written: set = set()

    def unit_of(self, slot):
        return self._unit_of[slot]

    # -- set-up ------------------------------------------------------------------------
    @torch.no_grad()
    def lay_out(self, optimizer) -> None:
        """Every unit's masters and compute params (``_lay_out_unit``); a meta-built model is
        materialized and initialized on the way, the optimizer's groups following its new
        parameters."""
        flats = FlatBuffers(self._compute_sizes(), self.ctx.device)
        self._compute = flats.views
        if self.meta:
            self._materialize(optimizer)
        else:
            for unit in self.ctx.units:
                self._lay_out_unit(unit)
        self.flats = [flats]
        self.homes.recast()   # rows the optimizer never steps (frozen) must be right too

    def _compute_sizes(self) -> dict:
        """The compute shards that need a buffer of their own: not the masters (device
        memory in the compute dtype already), not a home's (``params=True``)."""
        params = self.ctx.plan.offload.params
        return {u: (u.compute_dtype, u.shard_numel) for u in self.sharded_units if not params
                and not (self.homes.masters_on_device(u) and u.compute_dtype == u.master_dtype)}

    def _lay_out_unit(self, unit) -> None:
        """Masters (what the optimizer steps) and compute params of one unit, from its full
        parameters. ZeRO-3 computes on a flat shard registered as Shard(0) DTensor
        parameters; the full parameters are then let go."""
        sharded = unit in self.sharded_units
        master = self.homes.place_masters(unit, keep=sharded)
        if sharded:
            self.table[unit].shard = self._compute_shard(unit, master)
        elif unit.compute_dtype != unit.dtype:
            for s in unit.slots:
                _cast(s, local_of(s.param).data.to(unit.compute_dtype))
        groups = self.ctx.groups
        for s in unit.slots if sharded else ():
            # A hooked parameter's shard is its subclass over the rows, as FSDP2's is.
            rows = s.shard_of(self.table[unit].shard)
            local = rows if s.hooks is None else subclass_of(s, rows)
            self.table[s].sharded = nn.Parameter(
                s.as_dtensor(local, groups.mesh, groups.placements), requires_grad=s.requires_grad)
            _cast(s, self.gatherer.placeholder(s, unit))
            for module, name in s.owners:
                module._parameters[name] = self.table[s].sharded

    def _compute_shard(self, unit, master) -> torch.Tensor:
        """ZeRO-3's flat compute shard: the home's under ``params=True`` (for NVMe, in the
        swap file, with a stand-in here); the masters where they are its own buffer; else
        a cast copy of them."""
        if self.ctx.plan.offload.params:
            return self.homes.param_shard(unit, unit.compute_dtype)
        if unit not in self._compute:
            return master
        return self._compute[unit].copy_(master)

    def _materialize(self, optimizer) -> None:
        """Meta construction: initialize and lay out unit by unit; any rank's problem (an
        uninitialized parameter or buffer, an init that raised) is raised on every rank,
        with the model's meta tensors put back."""
        m = Materializer(self.model, list(self.ctx.units), self.ctx.plan.sharding.init,
                         self.ctx.device)
        m.run(self._lay_out_unit)
        group = self.ctx.groups.everyone
        gathered = gather(m.problems, group)
        failed = next(((r, p) for r, p in enumerate(gathered) if p), None)
        if failed is not None:
            m.undo()
            raise ValueError(f"zerofn could not initialize the meta-built model (rank "
                             f"{failed[0]}): " + " ".join(failed[1]))
        if optimizer is None:    # (built after the transform, over the new parameters)
            return
        for group in optimizer.param_groups:
            group["params"] = [m.new_of.get(p, p) for p in group["params"]]
        for old, new in m.new_of.items():
            if old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)

    # -- after a step or a load ----------------------------------------------------------
    def refresh_compute(self) -> None:
        """Compute params from every unit's current masters (after a load)."""
        for unit in self.ctx.units:
            self.refresh_unit(unit, self.homes.updated_rows(unit))
        self.await_shards()

    @torch.no_grad()
    def refresh_unit(self, unit, rows: torch.Tensor | None) -> None:
        """This rank's compute rows of ``unit`` from its updated ``rows`` (None: the whole
        parameters' own rows are the masters, updated in place): copied into the ZeRO-3
        shard, or into this rank's slot of a gather buffer and all-gathered into the full
        params in place. Parameters the step wrote whole (``written``) stay out of the
        all-gather."""
        if not unit.slots:
            return
        ctx = self.ctx
        if unit in self.sharded_units:
            if rows is not None and rows is not self.table[unit].shard:
                ctx.copies.to_device(unit, self.table[unit].shard, rows)
            return
        layout, width = self._gather_layout(unit)
        if not layout:
            return
        comm = ctx.comm_of(unit)
        recv = ctx.pool.take(comm.world * width, unit.compute_dtype, unit.device)
        send = recv.view(comm.world, width)[comm.rank]
        if width == unit.shard_numel:
            self._fill(unit, send, rows)
        else:
            self._fill_packed(unit, send, rows, layout)
        work = ctx.timing.issue("all_gather", "gather[step]", unit.name,
                                lambda: comm.all_gather(recv, send, async_op=True),
                                "gather_wait")
        comm.enqueue(work, recv.nbytes, lambda u=unit, rv=recv, own=rows is None, lay=layout:
                     self._arrived(u, rv, own, lay))

    def _gather_layout(self, unit) -> tuple[list, int]:
        """The slots ``unit``'s all-gather carries, each with its columns in a rank's piece,
        and the piece's width: every slot where it lies in the shard, or (where the step
        wrote some whole: owned.py's broadcast) the rest packed, aligned as in the shard."""
        slots = [s for s in unit.slots if s not in self.written]
        if len(slots) == len(unit.slots):
            return [(s, s.cols) for s in slots], unit.shard_numel
        layout, width = [], 0
        for s in slots:
            layout.append((s, slice(width, width + s.chunk * s.inner)))
            width += aligned(s.chunk * s.inner)
        return layout, width

    def _fill(self, unit, send, rows) -> None:
        """This rank's piece of the gather: its whole shard of ``unit``."""
        ctx = self.ctx
        if rows is not None:
            ctx.copies.to_device(unit, send, rows)
            ctx.copies.device_wait(unit)
            return
        for s in unit.slots:
            send[s.offset:s.offset + s.local_numel].copy_(
                s.rows_of(local_of(s.param).detach()).reshape(-1))

    def _fill_packed(self, unit, send, rows, layout) -> None:
        """This rank's piece of the gather: the ``layout`` slots' rows only, packed."""
        ctx = self.ctx
        staged = None
        if rows is not None:
            staged = ctx.pool.take(unit.shard_numel, unit.compute_dtype, unit.device)
            ctx.copies.to_device(unit, staged, rows)
            ctx.copies.device_wait(unit)
        for s, cols in layout:
            source = staged[s.offset:s.offset + s.local_numel] if staged is not None \
                else s.rows_of(local_of(s.param).detach()).reshape(-1)
            send[cols.start:cols.start + s.local_numel].copy_(source)
        if staged is not None:
            ctx.pool.give(staged)

    def _arrived(self, unit, recv, own_current: bool, layout: list) -> None:
        """The gathered rows into the full params; this rank's own rows only where they are
        not the ones the optimizer updated in place (``own_current``)."""
        world, r = self.ctx.comm_of(unit).world, self.ctx.comm_of(unit).rank
        ranks = recv.view(world, -1)
        with torch.no_grad():
            for s, cols in layout:
                if not own_current:
                    gather_from_ranks(ranks[:, cols], local_of(s.param).detach())
                    continue
                full, width = local_of(s.param).detach().view(-1), s.chunk * s.inner
                gather_from_ranks(ranks[:r, cols], full[:r * width])
                gather_from_ranks(ranks[r + 1:, cols], full[(r + 1) * width:])
        self.ctx.pool.give(recv)

    def await_shards(self) -> None:
        """ZeRO-3's next forward gathers from the refreshed shards: device work from here on
        waits for their copies (the host does not). The step's whole writes are done."""
        self.written.clear()
        for unit in self.sharded_units:
            self.ctx.copies.device_wait(unit)

    def settle_copies(self) -> None:
        """Block until every copy to the device has read its host rows, which the host is
        about to rewrite. Long done by the next step; a load may come sooner."""
        for unit in self.ctx.units:
            self.ctx.copies.before_host_write(unit)

    # -- whole tensors -------------------------------------------------------------------
    def gather_unit(self, unit) -> torch.Tensor:
        """Every rank's master rows of ``unit`` as one rank-major ``(world, shard)`` buffer,
        on the runtime's device, in the masters' dtype. Collective."""
        comm = self.ctx.comm_of(unit)
        dtype = self.table[unit.slots[0]].opt_param.dtype
        recv = torch.empty(comm.world * unit.shard_numel, dtype=dtype, device=self.ctx.device)
        send = recv.view(comm.world, unit.shard_numel)[comm.rank]    # gathered in place
        send.zero_()
        for s in unit.slots:
            send[s.offset:s.offset + s.local_numel].copy_(
                self.table[s].opt_param.detach().reshape(-1))
        comm.all_gather(recv, send)
        return recv.view(comm.world, unit.shard_numel)

    def full_tensor(self, slot, local: torch.Tensor, device=None) -> torch.Tensor:
        """Gather a tensor sharded like ``slot`` (this rank's rows) into a new full tensor on
        ``device`` (default: where ``local`` is). Collective.

        The gather runs on the runtime's device whatever ``local``'s: under offload the rows
        live on the host, and NCCL gathers only device tensors.
        """
        comm = self.ctx.comm_of(self._unit_of[slot])
        width = slot.chunk * slot.inner
        out = torch.empty(comm.world * width, dtype=local.dtype, device=self.ctx.device)
        mine = out.view(comm.world, width)[comm.rank]    # gathered in place
        mine[local.numel():].zero_()
        mine[:local.numel()].copy_(local.reshape(-1))
        comm.all_gather(out, mine)
        whole = out[:slot.numel].view(slot.shape)
        if slot.spec is not None:    # the parameter's own local piece: whole over its mesh
            whole = DTensor(whole, DTensorSpec(slot.spec.mesh, slot.spec.placements, TensorMeta(
                slot.global_shape, slot.stride, whole.dtype)), requires_grad=False).full_tensor()
        return whole.to(device or local.device, copy=True)
