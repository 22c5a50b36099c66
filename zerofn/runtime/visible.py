"""The gradients a training loop sees on ``p.grad``, and what the loop did to them.

[Note: gradients as a loop sees them] After a backward that reduced, every trainable
parameter's ``p.grad`` is the gradient the step will use, as FSDP2 shows it: a ``Shard(0)``
DTensor whose local tensor is a view of this rank's reduced rows, at every stage (ZeRO-1
and ZeRO-2 too, whose parameters are whole: torch's ``clip_grad_norm_`` then computes the
global norm over the shards, one all-reduce, as under FSDP2). No copy: what the loop does
to ``p.grad`` before ``step()`` (clipping by norm or value, scaling, noise, zeroing) is done
to the rows the step reads.

Where those rows are not all the step reads, the step learns of the edit (``fold``):

- a tensor the loop put in ``p.grad`` instead (``p.grad = g * 2``) is copied into the rows;
  ``p.grad = None`` means this rank gave the parameter no gradient, as in torch.optim (the
  ranks' union decides, step_grads.py's [Note: parameters without a gradient]);
- where backward already copied a unit's rows elsewhere (a landing buffer on the host,
  NVMe's staging, the device's share under ``ratio``: such units are ``watch``ed), an edit
  is seen by a fingerprint of the rows, a hash of each element's bits and position taken
  at ``show`` and again at the step (version counters cannot tell: torch's foreach kernels, which
  torch's clipping uses, bump none on a DTensor or its local tensor). An edited unit's
  rows are copied again; where the host already stepped the unit during backward
  (``overlap_step``), the edit cannot be honoured and ``step()`` raises on every rank
  (step_grads.py's vote carries the verdict). A clip that multiplies by exactly 1 edits
  nothing;
- where gradients are reduced in a wider dtype than the parameters compute in
  (``mixed_precision(reduce_dtype=...)``), torch refuses a gradient of another dtype than
  its parameter's: ``p.grad`` shows the rows rounded to the compute dtype, and an edited
  copy replaces the rows (else the step keeps the exact ones).

A parameter no rank gave a gradient shows None, as in torch and FSDP2, where that is known
when backward ends (grads.py's [Note: a gradient no rank gave]): on one rank always; on
more, from the backward after a step whose vote found such a parameter. Until then (the
first such step, and always under HSDP, tensor parallelism or groups=) it shows its reduced rows,
zeros, and the step leaves it alone, as torch.optim leaves one whose ``.grad`` is None. A
parameter only this rank left unused shows the other ranks' gradient: a global clip must
see every rank's rows.

Under fp16 loss scaling the rows are still scaled, as plain PyTorch's gradients are before
``GradScaler.unscale_``: clip with ``zf.clip_grad_norm_``, which unscales.

The view is withdrawn at ``zero_grad`` and, for a parameter autograd accumulates into (a
whole one: ZeRO-1/2, ZeRO-3's persistent ones), when the next backward reaches it: a hook
that runs before the accumulation gives autograd back the parameter's own ``.grad`` (None),
so micro-batches accumulate as before.

[Note: the optimizer's markers] The optimizer steps each parameter's rows (``opt_param``),
not the model's parameter, so its ``zero_grad`` never reaches ``p.grad``. While the rows are
shown, each ``opt_param.grad`` is a marker instead: a tensor of its shape backed by one
element. torch's ``zero_grad`` takes it off (``set_to_none``) or zeroes it in place, which
bumps its version counter; either is read as the loop's ``zero_grad`` of that parameter,
with no read of the device: at the step (``fold``: no gradient, as torch.optim skips a
parameter whose ``.grad`` is None) and at the next forward (``loop_cleared``: the reduction
starts over). The markers are off while zerofn's step runs the optimizer (``unmark``, then
``mark``), so it steps only the rows zerofn gives it.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.distributed.tensor import DTensor

from ..core.units import ParamSlot, Unit, local_of
from ..optim import kernels
from .to_owner import HeldByOwner

FINGERPRINT_CHUNK = 1 << 16     # elements torch's fingerprint hashes at once on a CPU (x64 on a GPU)


class VisibleGrads:
    """Shows each reduced unit's rows on its parameters' ``.grad`` (``show``) and folds what
    the loop did to them back into the rows (``fold``) before the step reads them.

    Args:
        units: the runtime's units (those with trainable parameters are shown).
        mesh, placements: what the gradients are DTensors over (the parameters' own).
        pool: lends the rounded copies where gradients are reduced in a wider dtype.
        table: the runtime's parameter state (param_table.py).
    """

    def __init__(self, units: list[Unit], mesh, placements, pool, table):
        self.units = [u for u in units if u.trainable]
        self.mesh, self.placements, self.pool = mesh, placements, pool
        self.table = table
        self.shown: dict[ParamSlot, DTensor] = {}   # slot -> the DTensor on its parameter
        self._rows: dict[Unit, torch.Tensor] = {}   # unit -> the flat rows shown
        self._copies: dict[Unit, torch.Tensor] = {} # unit -> its rows rounded (pool's)
        self._prints: dict[Unit, torch.Tensor] = {}    # watched unit -> its rows' fingerprint
        self._watched: set[Unit] = set()   # units whose rows backward copied elsewhere
        self._shards: dict = {}    # the reducer's shards, as ``show`` was given them
        # [Note: the optimizer's markers]: slot -> (marker, its version when set)
        self._markers: dict[ParamSlot, tuple[torch.Tensor, int]] = {}
        self._cleared: set[ParamSlot] = set()   # marked slots the loop's zero_grad reached
        self._made: dict[ParamSlot, torch.Tensor] = {}   # each slot's marker, made once
        self.refused: str | None = None   # a held gradient the loop replaced (to_owner.py)
        mine = weakref.ref(self)
        # [Note: gradients as a loop sees them]: autograd accumulates into whole parameters.
        self._hooks = [s.param.register_hook(functools.partial(_before_accumulation, mine, s))
                       for u in self.units for s in u.trainable if table[s].sharded is None]

    def param_of(self, slot: ParamSlot):
        """The parameter the model registers between steps (ZeRO-3's DTensor, else whole)."""
        sharded = self.table[slot].sharded
        return sharded if sharded is not None else slot.param

    def watch(self, unit: Unit) -> None:
        """Backward copied ``unit``'s reduced rows elsewhere: the step must learn of edits."""
        self._watched.add(unit)

    def show(self, shards: dict, union: set[ParamSlot] | None = None,
             held: dict | None = None) -> None:
        """After a reducing backward: each unit's reduced rows (``shards``: unit to flat
        shard, or None) on its parameters' ``.grad``; None on those outside ``union`` (the
        slots some rank gave a gradient, where known: grads.py's [Note: a gradient no rank
        gave]). ``held``: slot -> the owner its gradient was reduced to, which shows no
        values (to_owner.py's [Note: gradients reduced to their owner])."""
        self.withdraw()
        self._shards = shards
        for unit in self.units:
            rows = shards.get(unit)
            if rows is None:
                continue
            if rows.dtype != unit.compute_dtype:    # a wider reduce dtype
                copy = self.pool.take(unit.shard_numel, unit.compute_dtype, rows.device)
                self._copies[unit] = copy.copy_(rows)
                rows = copy
            self._rows[unit] = rows
            if unit in self._watched or unit in self._copies:
                self._prints[unit] = fingerprint(rows)
            for s in unit.trainable:
                if union is not None and s not in union:
                    continue
                local = s.shard_of(rows)
                if held and s in held:
                    local = HeldByOwner(local, s.fqn, held[s])
                grad = s.as_dtensor(local, self.mesh, self.placements)
                self.param_of(s).grad = grad
                self.shown[s] = grad
                self._markers[s] = (self._marker(s), 0)
        self.mark()

    def fold(self) -> tuple[set[Unit], set[ParamSlot]]:
        """What the loop did to the shown gradients since ``show``, made part of the rows
        the step reads. Returns the units whose rows changed, and the slots
        whose ``.grad`` the loop set to None. Idempotent: a second call finds nothing new."""
        changed, dropped = set(), self.loop_cleared()
        for unit, rows in self._rows.items():
            replaced = False
            for s in unit.trainable:
                if s not in self.shown:      # no rank gave it a gradient: left None
                    continue
                now, shown = self.param_of(s).grad, self.shown[s]
                if now is None:
                    dropped.add(s)
                elif now is not shown and isinstance(shown._local_tensor, HeldByOwner):
                    self.refused = self.refused or s.fqn     # (no rows here to take it)
                    self.param_of(s).grad = shown
                elif now is not shown:      # replaced: its values become the rows
                    s.shard_of(rows).copy_(_rows_of(s, now))
                    self.param_of(s).grad = shown
                    replaced = True
            if replaced or self._edited(unit, rows):
                if unit in self._copies:
                    self._shards[unit].copy_(rows)
                changed.add(unit)
        return changed, dropped

    def loop_cleared(self) -> set[ParamSlot]:
        """The marked slots whose marker the loop's ``zero_grad`` took off or zeroed, so
        far ([Note: the optimizer's markers])."""
        for s, (marker, version) in self._markers.items():
            if s not in self._cleared and (self.table[s].opt_param.grad is not marker
                                           or marker._version != version):
                self._cleared.add(s)
        return set(self._cleared)

    def _marker(self, slot: ParamSlot) -> torch.Tensor:
        """The slot's marker: made once (on a GPU each would cost a kernel a step), again
        only where its rows moved (ratio="auto" moves them to the device)."""
        t = self.table[slot].opt_param
        marker = self._made.get(slot)
        if marker is None or (marker.device, marker.dtype, marker.shape) != \
                (t.device, t.dtype, t.shape):
            marker = torch.ones((), dtype=t.dtype, device=t.device).expand(t.shape)
            self._made[slot] = marker
        return marker

    def marked(self) -> set[ParamSlot]:
        return set(self._markers)

    def forget(self, slots) -> None:
        """``slots``' rows started over (the loop cleared them): no marker stands for them."""
        for s in slots:
            self._markers.pop(s, None)
            self._cleared.discard(s)

    def unmark(self) -> None:
        """Take the markers off: the optimizer is about to step (the loop's clearing was
        read at ``fold``)."""
        for s, (marker, _) in self._markers.items():
            if self.table[s].opt_param.grad is marker:
                self.table[s].opt_param.grad = None

    def mark(self) -> None:
        """Put the markers (back) on, where the loop has not cleared them."""
        for s, (marker, _) in self._markers.items():
            if s not in self._cleared:
                self.table[s].opt_param.grad = marker
                self._markers[s] = (marker, marker._version)

    def _edited(self, unit: Unit, rows: torch.Tensor) -> bool:
        """Whether a fingerprinted unit's rows changed since the last look."""
        before = self._prints.get(unit)
        if before is None:
            return False
        now = fingerprint(rows)
        self._prints[unit] = now
        return bool(now != before)

    def withdraw(self, keep_edits: bool = True) -> None:
        """Take the views off the parameters (the next backward, ``zero_grad``, teardown),
        the loop's edits folded into the rows first unless they are dropped anyway."""
        if keep_edits:
            self.fold()     # (a refusal stays until the step raises it, or zero_grad)
        else:
            self.refused = None
        for s in self.shown:
            self.param_of(s).grad = None
        self.unmark()
        self._markers.clear()
        self._cleared.clear()
        for copy in self._copies.values():
            self.pool.give(copy)
        self.shown.clear()
        self._rows.clear()
        self._copies.clear()
        self._prints.clear()

    def unwatch(self) -> None:
        """``zero_grad``: the next backward copies afresh."""
        self._watched.clear()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def fingerprint(rows: torch.Tensor) -> torch.Tensor:
    """A hash of the rows (a 0-d int64 on their device): the sum mod 2^64 of a mix of each
    element's bits with its position (cpp/fingerprint.cpp), so any edit changes it (a sign
    flip, a permutation, a swap, values rounded back), bar a chance of about 2^-64. A sum
    of the bits alone missed whatever kept the sum: a permutation, a balanced sign flip."""
    # A build of zerofn._C older than cpp/fingerprint.cpp: torch's ops give the same number.
    native = getattr(kernels._C, "fingerprint", None)
    if native is not None and rows.device.type == "cpu" and rows.is_contiguous():
        h = native(rows.data_ptr(), rows.numel(), rows.element_size())
        return torch.tensor(h - (1 << 64) if h >= 1 << 63 else h, dtype=torch.int64)
    return _fingerprint_torch(rows)


def _signed(u: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return u - (1 << 64) if u >= 1 << 63 else u


GOLDEN, MIX1, MIX2 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9),
                      _signed(0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k on the 64 bits unsigned (torch shifts int64 arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _fingerprint_torch(rows: torch.Tensor) -> torch.Tensor:
    """``fingerprint`` in torch's ops, for rows the C++ cannot read (a GPU's): the same
    number, with int64 arithmetic wrapping as uint64's does. In chunks, so the int64
    temporaries stay small and are reused (one of 8 bytes an element fragmented a CPU's
    heap step after step)."""
    bits = rows.reshape(-1).view({8: torch.int64, 4: torch.int32,
                                  2: torch.int16}[rows.element_size()])
    width = 8 * rows.element_size()
    chunk = FINGERPRINT_CHUNK if bits.device.type == "cpu" else FINGERPRINT_CHUNK << 6
    total = torch.zeros((), dtype=torch.int64, device=rows.device)
    for start in range(0, bits.numel(), chunk):
        x = bits[start:start + chunk].long()
        if width < 64:
            x &= (1 << width) - 1                   # the bits unsigned, zero-extended
        pos = torch.arange(start + 1, start + 1 + x.numel(), device=x.device)
        x += pos.mul_(GOLDEN)
        x ^= _shift_right(x, 30)
        x *= MIX1
        x ^= _shift_right(x, 27)
        x *= MIX2
        x ^= _shift_right(x, 31)
        total += x.sum()
    return total


def _rows_of(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a gradient the loop put on ``.grad``: a sharded DTensor's local
    rows, or a whole tensor's (a tensor-parallel parameter's: its local piece's)."""
    if isinstance(grad, DTensor) and (slot.spec is None or
                                      tuple(grad.placements) != tuple(slot.spec.placements)):
        return grad.to_local()
    return slot.rows_of(local_of(grad))


def _before_accumulation(visible, slot: ParamSlot, grad):
    """The next backward reaches a whole parameter: autograd must find its own ``.grad``
    (None), not the shown view, to accumulate into."""
    visible = visible()
    if visible is not None and slot in visible.shown:
        visible.withdraw()
    return grad
