"""Where a runtime's rows live: each unit's masters (what the optimizer steps) and compute
parameters, laid out at set-up from the full parameters (or, for a meta-built model,
initialized unit by unit), and the device's flat buffers that hold them."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .materialize import Materializer


class Layout:
    """The part of ``Runtime`` that lays out each unit's rows (a mixin: the runtime's
    state is its own, runtime.py)."""

    @torch.no_grad()
    def _lay_out_shards(self) -> None:
        """Every unit's masters and compute params (see ``_lay_out_unit``). A meta-built
        model is materialized and initialized module by module on the way, each unit laid
        out as soon as its modules are initialized (runtime/materialize.py)."""
        self._flats = self._allocate_flats()
        if self.meta:
            self._materialize()
        else:
            for unit in self.units:
                self._lay_out_unit(unit)
        self.flats = [f for f in self._flats.values() if f.views]
        del self._flats
        if self.offload is not None:
            self.offload.recast()   # rows CPU Adam never steps (frozen) must be right too

    def _lay_out_unit(self, unit) -> None:
        """Masters (what the optimizer steps) and compute params of one unit, from its full
        parameters.

        The master is a flat buffer of this rank's rows, except in plain ZeRO-1/2 where this
        rank's rows of the full parameters serve (fp32 params are their own master). ZeRO-3
        computes on a flat shard (the master itself, or its cast copy) and registers it as
        Shard(0) DTensor parameters; the full parameters are then let go.
        """
        sharded = unit in self._sharded_params
        compute = unit.compute_dtype
        master = self._place_masters(unit, sharded)
        if sharded:
            unit.shard = self._compute_shard(unit, compute, master)
        elif compute != unit.dtype:
            for s in unit.slots:
                s.param.data = s.param.data.to(compute)
        # Under offload the masters are the offload's; its rows here are transient.
        unit.master = master if self.offload is None else None
        for s in unit.slots if sharded else ():
            s.sharded = nn.Parameter(s.as_dtensor(s.shard_of(unit.shard), self.mesh,
                                                 self.placements),
                                     requires_grad=s.requires_grad)
            s.param.data = self.gatherer.placeholder(s, unit)
            for module, name in s.owners:
                module._parameters[name] = s.sharded

    def _materialize(self) -> None:
        """Meta construction: initialize and lay out unit by unit; any rank's problem (an
        uninitialized parameter or buffer, an init that raised) is raised on every rank,
        with the model's meta tensors put back."""
        m = Materializer(self.model, self.units, self.plan.sharding.init, self.device)
        m.run(self._lay_out_unit)
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, m.problems, group=self.group)
        failed = next(((r, p) for r, p in enumerate(gathered) if p), None)
        if failed is not None:
            m.undo()
            raise ValueError(f"zerofn could not initialize the meta-built model (rank "
                             f"{failed[0]}): " + " ".join(failed[1]))
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [m.new_of.get(p, p) for p in group["params"]]
        for old, new in m.new_of.items():
            if old in opt.state:
                opt.state[new] = opt.state.pop(old)

    def _offloaded_param_dtypes(self, units) -> dict:
        """ZeRO-3 parameter offload: each sharded unit's compute dtype (what NVMe stores)."""
        if not self.plan.offload.params:
            return {}
        return {u: u.compute_dtype for u in units if u.slots and not u.replicated}

    def _place_masters(self, unit, sharded: bool) -> torch.Tensor | None:
        """The unit's master rows: the offload's, or the device's flat buffer, or (plain
        ZeRO-1/2, fp32) this rank's rows of the full parameters themselves (None)."""
        if self.offload is not None:
            return self.offload.place_masters(unit, keep=sharded)
        master = self._flats["master"].views.get(unit)
        for s in unit.slots:
            rows = s.rows_of(s.param.detach())
            s.opt_param = rows if master is None else s.shard_of(master).copy_(rows)
        return master

    def _compute_shard(self, unit, compute: torch.dtype, master) -> torch.Tensor:
        """ZeRO-3's flat compute shard: held by the offload under parameter offload (for
        NVMe, in the swap file, with a stand-in here); else the master itself where it is
        on the device in the compute dtype, or a cast copy of it."""
        if self.plan.offload.params:
            return self.offload.param_shard(unit, compute)
        if compute == unit.master_dtype and self.offload is None:
            return master
        return self._flats["compute"].views[unit].copy_(master)

    def _allocate_flats(self) -> dict[str, dict]:
        """The device's master rows (where they are not the full parameters' own) and
        ZeRO-3's compute shards (where they are not the masters), one allocation per kind
        and dtype, handed out per unit: many small long-lived blocks made while a meta
        model's transient full units come and go would fragment the host heap."""
        sharded = set(self._sharded_params)
        masters = {u: (u.master_dtype, u.shard_numel) for u in self.units if self.offload is None
                   and (u in sharded or u.compute_dtype != u.master_dtype)}
        shards = {u: (u.compute_dtype, u.shard_numel) for u in sharded
                  if not self.plan.offload.params
                  and (u.compute_dtype != u.master_dtype or self.offload is not None)}
        return {"master": FlatBuffers(masters, self.device),
                "compute": FlatBuffers(shards, self.device)}


class FlatBuffers:
    """``{key: (dtype, numel)}`` as zeroed views of one buffer per dtype (``views``), each
    starting ``align`` elements apart (256 bytes for fp32), as vector kernels like.
    ``holds`` tells accounting which storage they share (see ``accounting._extents``)."""

    def __init__(self, sizes: dict, device: torch.device, align: int = 64):
        self.views: dict = {}
        self._storages = []
        for dtype in {dt for dt, _ in sizes.values()}:
            mine = {k: n for k, (dt, n) in sizes.items() if dt == dtype}
            padded = {k: -(-n // align) * align for k, n in mine.items()}
            buf = torch.zeros(sum(padded.values()), dtype=dtype, device=device)
            self._storages.append(buf.untyped_storage())
            at = 0
            for k, n in mine.items():
                self.views[k] = buf[at:at + n]
                at += padded[k]
        self.where = device.type

    def holds(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(s.data_ptr() == ptr for s in self._storages)
