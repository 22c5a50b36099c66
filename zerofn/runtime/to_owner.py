"""ZeRO-3's owned gradients reduced whole to their owner (``shard_params(reduce_to_owner=
True)``), in place of their share of the reduce-scatter.

[Note: gradients reduced to their owner] A whole-tensor optimizer's parameter (owned.py)
is stepped whole by one owner rank, which needs the sum of every rank's whole gradient.
By default each unit's reduce-scatter gives every rank its reduced rows (what ``p.grad``
shows) and the step gathers them to the owner: +1x the parameter's bytes, and the scatter
of the updated rows +1x more. With this option the unit's reduce-scatter leaves the owned
parameters' columns out (``width``: the columns each rank's row of the send buffer keeps)
and each owned gradient is reduced to its owner instead: the reduce carries what those
columns carried (each rank's padded whole gradient, ``chunk`` rows per rank), so the
gradient costs nothing over ZeRO's own, and the scatter back is the +1x. The owner adds
each backward's sum into its whole gradient (accumulation), and the step reads that.

The other ranks then hold none of the gradient's rows, and the owner's rows alone are not
what ``p.grad`` means. So ``p.grad`` of such a parameter is a ``Shard(0)`` DTensor with
the parameter's shape whose local tensor holds no values (``HeldByOwner``): any read or
in-place edit raises where it is made, naming the owner, rather than show rows no rank
has. ``p.grad = None`` is honoured (this rank gave it no gradient: the ranks' union
decides); a tensor put in its place is refused at the step, on every rank, by one more
flag in the step's vote (visible.py's ``fold``). ``zf.clip_grad_norm_`` and the
non-finite verdict read the owner's whole gradient, each parameter once (step_grads.py).
Under HSDP the owner then averages its sum over the replicas' owners of the same
parameter (the same rank of each shard group).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..core.units import ParamSlot, Unit, aligned


class ToOwner:
    """The owned slots' owners and the send buffers' layout without them (the note), and
    each owned gradient from its packing to the step.

    Args:
        owner: each owned slot of a unit ZeRO-3 keeps as rows -> its owner's rank.
        units: the runtime's units.
    """

    def __init__(self, owner: dict[ParamSlot, int], units: list[Unit]):
        self.owner = owner
        self.width: dict[Unit, int] = {}         # unit -> its send buffer's columns per rank
        self.offset: dict[ParamSlot, int] = {}   # another slot there -> its first column
        self.kept: dict[Unit, list[tuple[int, int, int]]] = {}   # (start, end, compact start)
        for u in units:
            if any(s in owner for s in u.slots):
                self._lay_out(u)
        self.sends: dict[ParamSlot, torch.Tensor] = {}    # packed, not reduced yet
        self.whole: dict[ParamSlot, torch.Tensor] = {}    # the owner's reduced gradient
        self.reduced: set[ParamSlot] = set()    # reduced to the owner since zero_grad

    def _lay_out(self, unit: Unit) -> None:
        """The unit's shard columns without its owned slots' (each slot's aligned block):
        the other slots keep their order and alignment, closer together."""
        kept, start, removed = [], 0, 0
        for s in sorted(unit.slots, key=lambda s: s.offset):
            if s in self.owner:
                if s.offset > start:
                    kept.append((start, s.offset, start - removed))
                start = s.offset + aligned(s.chunk * s.inner)
                removed += start - s.offset
            else:
                self.offset[s] = s.offset - removed
        if unit.shard_numel > start:
            kept.append((start, unit.shard_numel, start - removed))
        self.kept[unit] = kept
        self.width[unit] = unit.shard_numel - removed

    def cols(self, slot: ParamSlot) -> slice:
        """A kept slot's columns in its unit's send buffer."""
        start = self.offset[slot]
        return slice(start, start + slot.chunk * slot.inner)

    def pack(self, slot: ParamSlot, grad: torch.Tensor, dtype, world: int) -> None:
        """This rank's whole gradient of an owned slot, padded to ``world * chunk`` rows."""
        send = torch.empty(world * slot.chunk * slot.inner, dtype=dtype, device=grad.device)
        send[:slot.numel].copy_(grad.reshape(-1))
        send[slot.numel:].zero_()
        self.sends[slot] = send

    def send_of(self, slot: ParamSlot, dtype, world: int, device) -> torch.Tensor:
        """The slot's packed gradient, or zeros where this rank has none."""
        send = self.sends.pop(slot, None)
        if send is None:
            send = torch.zeros(world * slot.chunk * slot.inner, dtype=dtype, device=device)
        return send

    def reduced_into(self, slot: ParamSlot, total: torch.Tensor, divisor: int,
                     fresh: bool) -> None:
        """On the owner: a backward's reduced sum, averaged, into the slot's gradient."""
        if divisor > 1:
            total.div_(divisor)
        before = self.whole.get(slot)
        if fresh or before is None:
            self.whole[slot] = total
        else:
            before.add_(total)

    def spread(self, unit: Unit, out: torch.Tensor, target: torch.Tensor, fresh: bool) -> None:
        """A compact reduced shard (``out``) into the unit's shard's kept columns; the owned
        slots' columns hold zeros (nothing reads them)."""
        if fresh:
            for s in unit.slots:
                if s in self.owner:
                    target[s.offset:s.offset + aligned(s.chunk * s.inner)].zero_()
        for start, end, at in self.kept[unit]:
            piece = out[at:at + end - start]
            if fresh:
                target[start:end].copy_(piece)
            else:
                target[start:end].add_(piece)

    def grad(self, slot: ParamSlot, mine: bool, dtype, device) -> torch.Tensor:
        """What the step reads of the slot: the whole gradient on its owner (zeros where
        the loop's ``zero_grad`` reached it since), nothing elsewhere."""
        if not mine:
            return torch.empty(0, dtype=dtype, device=device)
        whole = self.whole.get(slot)
        if whole is None:
            return torch.zeros(slot.shape, dtype=dtype, device=device)
        return whole[:slot.numel].view(slot.shape)

    def forget(self, slots) -> None:
        """The loop's ``zero_grad`` reached ``slots``: their sums start over."""
        for s in slots:
            self.whole.pop(s, None)

    def clear(self) -> None:
        self.sends.clear()
        self.whole.clear()
        self.reduced.clear()


class HeldByOwner(torch.Tensor):
    """The local tensor of an owned parameter's ``p.grad`` under ``reduce_to_owner``: its
    shape, dtype and device, no values; every op on it raises (the module note)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, fqn: str, owner: int):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                   device=like.device)

    def __init__(self, like: torch.Tensor, fqn: str, owner: int):
        self.fqn, self.owner = fqn, owner

    def __repr__(self):
        return f"HeldByOwner({self.fqn!r}, rank {self.owner})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        held = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, HeldByOwner))
        raise RuntimeError(
            f"zerofn: p.grad of {held.fqn!r} holds no values: under "
            f"shard_params(reduce_to_owner=True) its gradient is reduced whole to rank "
            f"{held.owner}, which steps it, and no rank keeps rows of it (tried "
            f"{func.__name__}). Clip with zf.clip_grad_norm_(model, ...), which reads it "
            "there; to read or edit p.grad itself, drop reduce_to_owner.")
