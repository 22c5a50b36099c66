"""A runtime's compute parameters made equal to its masters again (after a step, or a
load), and full tensors gathered from this rank's rows."""
from __future__ import annotations

import torch

from ..core.units import gather_from_ranks


class Refresh:
    """The part of ``Runtime`` that refreshes compute parameters from the masters (a
    mixin, runtime.py)."""

    def _refresh_compute(self) -> None:
        """Compute params from the updated masters of every unit (after a torch.optim step
        or a load; CPU Adam refreshes each unit as it steps it)."""
        for unit in self.units:
            self._refresh_unit(unit, self._updated_rows(unit))
        self._await_shards()

    def _updated_rows(self, unit) -> torch.Tensor | None:
        """This rank's updated rows of ``unit`` in the compute dtype where one exists; None
        where the compute params' own rows are the ones the optimizer updated."""
        if self.offload is not None:
            return self.offload.updated_rows(unit)
        return unit.master

    @torch.no_grad()
    def _refresh_unit(self, unit, rows: torch.Tensor | None) -> None:
        """This rank's compute rows of ``unit`` from its updated ``rows``: copied into the
        ZeRO-3 shard, or copied into a send buffer and all-gathered into the full params."""
        if not unit.slots:
            return
        if unit in self._sharded_params:
            if rows is not None and rows is not unit.shard:
                self.copies.to_device(unit, unit.shard, rows)
            return
        # The rows go straight into this rank's slot of the gather buffer: an in-place
        # all-gather, with no separate send buffer.
        recv = self.pool.take(self.world * unit.shard_numel, unit.compute_dtype, unit.device)
        send = recv.view(self.world, unit.shard_numel)[self.rank]
        if rows is not None:
            self.copies.to_device(unit, send, rows)
            self.copies.device_wait(unit)
        else:
            for s in unit.slots:
                send[s.offset:s.offset + s.local_numel].copy_(s.rows_of(s.param.detach()).reshape(-1))
        work = self.timing.issue("all_gather", "gather[step]", unit.name,
                                 lambda: self.comm.all_gather(recv, send, async_op=True),
                                 "gather_wait")
        self.comm.enqueue(work, recv.nbytes,
                          lambda u=unit, rv=recv, own=rows is None: self._params_arrived(u, rv, own))

    def _await_shards(self) -> None:
        """ZeRO-3's next forward gathers from the refreshed shards: device work from here on
        waits for their copies (the host does not)."""
        for unit in self._sharded_params:
            self.copies.device_wait(unit)

    def _settle_copies(self) -> None:
        """Block until every copy to the device has read its host rows, which the host is
        about to rewrite. Long done by the next step; a load may come sooner."""
        for unit in self.units:
            self.copies.before_host_write(unit)

    def _params_arrived(self, unit, recv, own_current: bool) -> None:
        """The gathered rows into the full params; this rank's own rows only where they are
        not the ones the optimizer updated in place (``own_current``)."""
        ranks = recv.view(self.world, unit.shard_numel)
        r = self.rank
        with torch.no_grad():
            for s in unit.slots:
                if not own_current:
                    gather_from_ranks(ranks[:, s.cols], s.param.detach())
                    continue
                full, width = s.param.detach().view(-1), s.chunk * s.inner
                gather_from_ranks(ranks[:r, s.cols], full[:r * width])
                gather_from_ranks(ranks[r + 1:, s.cols], full[(r + 1) * width:])
        self.pool.give(recv)

    def refresh_params(self) -> None:
        """Make the compute parameters equal the masters again (after a load). Collective."""
        if self.offload is not None:
            self.offload.recast()
        self._refresh_compute()
        self.comm.drain()
        self._settle_copies()   # NVMe's materialized rows are let go at the next step

    def prepare_state_dict(self) -> None:
        """Bring NVMe-resident state into memory (until the next step), so the optimizer's
        tensors hold values. Every state dict access starts here."""
        self._settle_copies()   # a load may write host rows a copy to the device still reads
        if self.gatherer is not None:   # nor may a gather started before the load be used
            self.gatherer.discard_pending()
        if self.offload is not None:
            self.offload.materialize(self.optimizer)

    def gather_unit(self, unit) -> torch.Tensor:
        """Every rank's master rows of ``unit`` as one rank-major ``(world, shard)`` buffer,
        on the runtime's device, in the masters' dtype. Collective."""
        dtype = unit.slots[0].opt_param.dtype
        recv = torch.empty(self.world * unit.shard_numel, dtype=dtype, device=self.device)
        send = recv.view(self.world, unit.shard_numel)[self.rank]    # gathered in place
        send.zero_()
        for s in unit.slots:
            send[s.offset:s.offset + s.local_numel].copy_(s.opt_param.detach().reshape(-1))
        self.comm.all_gather(recv, send)
        return recv.view(self.world, unit.shard_numel)

    def full_tensor(self, slot, local: torch.Tensor, device=None) -> torch.Tensor:
        """Gather a tensor sharded like ``slot`` (this rank's rows) into a new full tensor on
        ``device`` (default: where ``local`` is). Collective.

        The gather runs on the runtime's device whatever ``local``'s: under offload the rows
        live on the host, and NCCL gathers only device tensors.
        """
        width = slot.chunk * slot.inner
        out = torch.empty(self.world * width, dtype=local.dtype, device=self.device)
        mine = out.view(self.world, width)[self.rank]    # gathered in place
        mine[local.numel():].zero_()
        mine[:local.numel()].copy_(local.reshape(-1))
        self.comm.all_gather(out, mine)
        return out[:slot.numel].view(slot.shape).to(device or local.device, copy=True)
