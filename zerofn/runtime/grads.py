"""Gradient reduction: reduce-scatter each unit's gradients into this rank's shard.

ZeRO-2/3 reduce a unit as soon as all its gradients have been accumulated during
backward (counted by post-accumulate-grad hooks), overlapping the rest of backward; an
end-of-backward callback reduces units some of whose parameters got no gradient. ZeRO-1
keeps full gradients on the parameters and reduces once, when the optimizer steps.
Reduction averages over ranks: NCCL's reduce-scatter averages itself, elsewhere the sum
is divided by the world size.

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

import torch

from .units import ParamSlot, Unit, scatter_to_ranks


class GradReducer:
    def __init__(self, comm, pool, units: list[Unit], stage: int, on_reduced=None,
                 reduce_dtype: torch.dtype | None = None):
        self.comm, self.pool, self.units, self.stage = comm, pool, units, stage
        self.reduce_dtype = reduce_dtype       # None: the compute dtype
        self.on_reduced = on_reduced           # ZeRO-3 frees a unit's params once reduced
        # Offload (ZeRO-2/3): on_shard_ready(unit, shard) starts the shard's copy to the
        # host once a backward's reduction of it is final (runtime/copies.py).
        self.on_shard_ready = None
        self.no_sync = False
        self.grad_shard: dict[Unit, torch.Tensor | None] = {}   # made at the first reduction
        self._fresh = {u: True for u in units}  # next reduction overwrites instead of adds
        self._send: dict[Unit, torch.Tensor] = {}
        self._packed: dict[Unit, set] = {}      # slots whose gradient is in the send buffer
        self._remaining: dict[Unit, int] = {}
        self._held: dict[Unit, list] = {}       # slots whose gradient waits on the parameter
        self._in_backward = False
        self._dirty = False                     # ZeRO-1: a backward ran since the last reduce
        self._hooks = []
        # [Note: the reduce stream], for the reductions during backward (ZeRO-1 reduces in
        # the step, where there is no compute to overlap).
        self.device = next((u.device for u in units if u.device is not None), None)
        self.stream = torch.cuda.Stream(self.device) if stage >= 2 and \
            self.device is not None and self.device.type == "cuda" else None
        for u in units:
            for s in u.trainable:
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, u, s)))

    def _dtype(self, unit: Unit) -> torch.dtype:
        return self.reduce_dtype or unit.dtype

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    # -- during backward (ZeRO-2/3) ----------------------------------------------------
    def _on_grad(self, unit: Unit, slot: ParamSlot, param) -> None:
        self._dirty = True
        if self.stage == 1:
            return
        if not self._in_backward:
            self._in_backward = True
            self._remaining = {u: len(u.trainable) for u in self.units}
            self._held = {}
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.no_sync:
            return
        self._held.setdefault(unit, []).append(slot)
        self._remaining[unit] -= 1
        if self._remaining[unit] == 0 or unit in self._send or self._worth_a_buffer(unit):
            for s in self._held.pop(unit):
                self._pack(unit, s)
        if self._remaining[unit] == 0:
            self._reduce(unit)

    def _worth_a_buffer(self, unit: Unit) -> bool:
        """[Note: late send buffers] A unit's first gradients can arrive long before its
        last: the root's final norm at the start of backward, its tied embedding at the very
        end. Taking the unit's send buffer then would hold a whole unit's worth of memory
        through backward for a few small tensors, so gradients wait on their parameters
        until they make up half the unit."""
        held = sum(s.numel for s in self._held[unit])
        return 2 * held >= self.comm.world * unit.shard_numel

    def _end_backward(self) -> None:
        for unit in self.units if not self.no_sync else ():
            if self._remaining.get(unit, 0) > 0:
                self._held.pop(unit, None)
                for s in unit.trainable:
                    if s.param.grad is not None:
                        self._pack(unit, s)
                self._reduce(unit)
        self.comm.drain()
        self._join()
        self._in_backward = False
        if self.on_reduced is not None:
            self.on_reduced(None)

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
                self.comm.make_room(self.comm.world * unit.shard_numel * self._dtype(unit).itemsize)
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
        if self.stream is None:
            work = self.comm.reduce_scatter(out, send, async_op=True)
            self.comm.enqueue(work, send.nbytes, functools.partial(self._reduced, unit, send, out))
        else:   # [Note: the reduce stream]
            with self._on_stream():
                self.comm.reduce_scatter(out, send, async_op=True).wait()
                spent = self._post_reduce(unit, out)
                ready = self.stream.record_event()
            self.comm.enqueue(None, send.nbytes, functools.partial(self._give, [send] + spent, ready))
        if self.on_reduced is not None:
            self.on_reduced(unit)

    def _reduction_target(self, unit: Unit) -> torch.Tensor:
        """Where this reduction lands: the unit's gradient shard when it starts afresh, else
        a temporary that is then added to the shard (accumulation)."""
        shard = self.grad_shard.get(unit)
        fresh = self._fresh[unit] or shard is None
        self._fresh[unit] = False
        if not fresh:
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device, self.stream)
        if shard is None:
            shard = self._new_shard(unit)
            self.grad_shard[unit] = shard
        return shard

    def _new_shard(self, unit: Unit) -> torch.Tensor:
        """ZeRO-1's reduced rows, and the lent shards of offload, come from the pool (given
        back at zero_grad); otherwise the shard is the unit's gradient memory, kept."""
        if self.stage == 1 or self.on_shard_ready is not None:
            return self.pool.take(unit.shard_numel, self._dtype(unit), unit.device, self.stream)
        return torch.empty(unit.shard_numel, dtype=self._dtype(unit), device=unit.device)

    def _on_stream(self):
        """The reduce stream, ordered after the current stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _join(self) -> None:
        """The current stream waits for every reduction so far (CUDA)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _reduced(self, unit: Unit, send: torch.Tensor, out: torch.Tensor) -> None:
        self._give([send] + self._post_reduce(unit, out))

    def _give(self, buffers: list[torch.Tensor], ready=None) -> None:
        for b in buffers:
            self.pool.give(b, ready)

    def _post_reduce(self, unit: Unit, out: torch.Tensor) -> list[torch.Tensor]:
        """Average, then put the reduced rows where the step reads them; returns the
        buffers this spent."""
        if not self.comm.averages and self.comm.world > 1:
            out.div_(self.comm.world)
        if self.stage == 1 and out.dtype == unit.dtype:
            self._write_back(unit, out)
            return [out]
        if self.stage == 1:
            return []     # a wider reduce dtype: keep the reduced shard for the step
        target = self.grad_shard[unit]
        spent = []
        if out is not target:
            target.add_(out)
            spent.append(out)
        if self.on_shard_ready is not None:
            self.on_shard_ready(unit, target)
        return spent

    def _write_back(self, unit: Unit, out: torch.Tensor) -> None:
        """ZeRO-1: the reduced shard goes into this rank's rows of the full gradients, so no
        gradient memory beyond the full gradients (DESIGN.md §4) outlives the reduction."""
        for s in unit.trainable:
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
            s.rows_of(s.param.grad).copy_(s.shard_of(out))
        del self.grad_shard[unit]

    # -- at the optimizer step -----------------------------------------------------------
    def sync(self) -> None:
        """Make every unit's reduced gradient shard ready. ZeRO-1 reduces here.

        ZeRO-1's full gradients stay on the parameters (they accumulate there, as in plain
        PyTorch) and the reduced rows are written back into them.
        """
        if self.stage == 1 and self._dirty:
            for unit in self.units:
                if not unit.trainable:
                    continue
                for s in unit.trainable:
                    if s.param.grad is not None:
                        self._pack_grad(unit, s, s.param.grad)
                self._fresh[unit] = True
                self._reduce(unit)
        self._dirty = False
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
        for unit in self.units:
            self._fresh[unit] = True
            if lent and self.grad_shard.get(unit) is not None:
                self.pool.give(self.grad_shard.pop(unit))
            for s in unit.slots:
                s.param.grad = None
