"""Whole-tensor optimizers (Muon, Adafactor): each parameter's update computed whole, on
one owning rank.

[Note: owned parameters] Muon orthogonalizes each matrix's momentum (Newton-Schulz) and
Adafactor keeps row and column statistics, so stepping a shard of rows is not stepping
the whole. Each parameter such an optimizer holds is given one owner rank of the shard
group, balanced by the update's cost (``cost``: Newton-Schulz's flops for Muon, else the
element count), as Megatron's layer-wise distributed optimizer and torchtitan's FlexShard
``Owned`` layout do. At the step every rank sends the owner its rows of the parameter's
reduced gradient and of its masters (one gather per parameter, both at once); the owner
runs the user's own optimizer on the whole tensor, and scatters the updated rows back,
which each rank writes into its masters. The homes' step then sends every unit's rows to
the compute parameters as for any other parameter. All gathers are issued before any
owner steps, so the ranks compute their matrices at the same time, and every scatter
after: each rank's share of the work is its owned parameters' cost.

The optimizer's state for an owned parameter lives on its owner only, whole (keyed, as
every state entry, by the tensor the group holds: this rank's rows), and nothing of it on
the other ranks. Elementwise optimizers beside it (AdamW for the rest) step shards as
before. Traffic per step over ZeRO's own for the same parameters: the gather carries the
gradient's and the masters' rows, the scatter the updated rows, so +2x the owned
parameters' elements in the gather and +1x in the scatter, as ``zf.comm_stats`` counts
full buffers (docs/optimizers.md). p.grad still shows the reduced rows on every rank
after backward, and parameters are current when step() returns.
"""
from __future__ import annotations

import math

import torch

from .chain import OptimizerChain, members_of, step_without_hooks

# Optimizers whose update of an element reads other elements of its tensor: stepped whole,
# on one owner (the user marks others with ``zf.whole_tensors``).
WHOLE_TENSOR = ("Muon", "Adafactor")
MARK = "_zerofn_whole_tensors"


def whole_tensors(optimizer):
    """Mark ``optimizer`` as one zerofn must step on whole tensors (its update of an element
    reads others of the same tensor), as it steps Muon and Adafactor: each parameter it
    holds gets one owner rank, which steps it whole. Returns the optimizer."""
    setattr(optimizer, MARK, True)
    return optimizer


def is_whole(optimizer) -> bool:
    return type(optimizer).__name__ in WHOLE_TENSOR or getattr(optimizer, MARK, False)


def cost(shape) -> float:
    """The update's work: Newton-Schulz's flops per iteration on an a x b matrix (a <= b:
    X X^T, then A @ A, then B @ X) where there are two dims, else the element count."""
    if len(shape) != 2:
        return float(math.prod(shape))
    a, b = sorted(shape)
    return 4.0 * a * a * b + 2.0 * a ** 3


def owners(shapes: list, world: int) -> tuple[list[int], list[float]]:
    """Each shape's owner rank, largest cost first to the least-loaded rank (ties to the
    lower rank): the same on every rank, as it reads shapes only. Returns the owners and
    each rank's load."""
    load = [0.0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += cost(shapes[i])
    return owner, load


class OwnedStep:
    """The owned parameters of ``optimizer``'s whole-tensor members, and their step (see the
    module note).

    Args:
        ctx: the runtime's context (the shard group's ``comm``, the device).
        optimizer: the bound optimizer (a chain, or one).
        slot_of: each tensor the optimizer's groups hold -> its slot, before binding.
    """

    def __init__(self, ctx, optimizer, slot_of: dict):
        self.ctx, self.comm = ctx, ctx.comm
        members = members_of(optimizer)
        self.members = [m for m in members if is_whole(m)]
        rest = [m for m in members if not is_whole(m)]
        # What the homes step: the elementwise members (none: an empty chain steps nothing).
        self.elementwise = rest[0] if len(rest) == 1 and len(members) == 1 \
            else OptimizerChain(rest)
        self.slots = [(m, slot_of[p]) for m in self.members for g in m.param_groups
                      for p in g["params"] if slot_of[p].requires_grad]
        owner, self.load = owners([s.global_shape for _, s in self.slots], self.comm.world)
        self.owner = {s: o for (_, s), o in zip(self.slots, owner)}
        self.steps = 0      # whole-tensor updates this rank computed (counted, for tests)

    @property
    def params(self) -> set:
        """The tensors the whole-tensor members' groups hold (after binding: the rows)."""
        return {s.opt_param for _, s in self.slots}

    def mine(self) -> list:
        return [s for _, s in self.slots if self.owner[s] == self.comm.rank]

    @torch.no_grad()
    def step(self, grads: dict, grad_scale: float) -> None:
        """Every owned parameter with a gradient this step (the vote made that the same on
        every rank) gathered to its owner, stepped whole there, scattered back."""
        todo = [(m, s) for m, s in self.slots if grads.get(s) is not None]
        if not todo:
            return
        gathered = {s: self._gather(s, grads[s], grad_scale) for _, s in todo}
        whole = {s: w for s, w in gathered.items() if w is not None}
        for m in self.members:
            self._step_member(m, [s for mm, s in todo if mm is m and s in whole], whole)
        for _, s in todo:
            piece = self._scatter(s, whole.get(s))
            s.opt_param.copy_(piece[:s.local_numel].view(s.local_shape))

    def _piece(self, s, rows: torch.Tensor, dtype, scale: float = 1.0) -> torch.Tensor:
        """``rows`` padded to the slot's ``chunk`` rows, flat, on the device."""
        piece = torch.zeros(s.chunk * s.inner, dtype=dtype, device=self.ctx.device)
        if s.local:
            piece[:s.local_numel].copy_(rows.reshape(-1))
            if scale != 1.0:
                piece.mul_(scale)
        return piece

    def _gather(self, s, grad_rows, grad_scale: float):
        """Send this rank's gradient and master rows to the owner (one gather). Returns
        (whole masters, whole gradient) on the owner, else None."""
        dtype, owner, world = s.opt_param.dtype, self.owner[s], self.comm.world
        send = torch.cat([self._piece(s, grad_rows, dtype, grad_scale),
                          self._piece(s, s.opt_param, dtype)])
        if world == 1:
            return _split(s, send.view(1, -1))
        recv = torch.empty(world, send.numel(), dtype=dtype, device=send.device) \
            if owner == self.comm.rank else None
        self.comm.gather(send, recv, owner)
        return _split(s, recv) if recv is not None else None

    def _scatter(self, s, whole) -> torch.Tensor:
        """The owner's updated whole masters, this rank's rows to each rank: this rank's
        rows, padded to ``chunk``, flat."""
        owner, world = self.owner[s], self.comm.world
        if world == 1:
            return whole[0].view(-1)
        piece = torch.empty(s.chunk * s.inner, dtype=s.opt_param.dtype, device=self.ctx.device)
        pieces = None
        if whole is not None:
            padded = torch.zeros(world * s.chunk * s.inner, dtype=piece.dtype, device=piece.device)
            padded[:s.numel].copy_(whole[0].reshape(-1))
            pieces = padded.view(world, -1)
        self.comm.scatter(piece, pieces, owner)
        return piece

    def _step_member(self, member, slots: list, whole: dict) -> None:
        """``member`` steps the whole tensors of ``slots`` (this rank's): its groups hold
        them, with their state, for the one call, then the rows again."""
        if not slots:
            return
        saved = [list(g["params"]) for g in member.param_groups]
        mine = {s.opt_param: s for s in slots}
        tensor_of = {}
        for g in member.param_groups:
            held = [mine[p] for p in g["params"] if p in mine]
            g["params"][:] = [_whole_param(s, whole[s], tensor_of) for s in held]
        for s in slots:
            if s.opt_param in member.state:
                member.state[tensor_of[s]] = member.state.pop(s.opt_param)
        try:
            step_without_hooks(member)
            self.steps += len(slots)
        finally:
            for g, params in zip(member.param_groups, saved):
                g["params"][:] = params
            for s in slots:
                if tensor_of[s] in member.state:
                    member.state[s.opt_param] = member.state.pop(tensor_of[s])


def _split(s, recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole masters, whole gradient) from each rank's [gradient rows | master rows]."""
    half = s.chunk * s.inner
    grad = recv[:, :half].reshape(-1)[:s.numel].view(s.shape)
    master = recv[:, half:].reshape(-1)[:s.numel].view(s.shape)
    return master, grad


def _whole_param(s, whole, tensor_of: dict) -> torch.Tensor:
    master, grad = whole
    master.grad = grad
    tensor_of[s] = master
    return master


def owned_problems(optimizer, slot_of: dict) -> list[str]:
    """What a whole-tensor member cannot step here (checked on every rank)."""
    problems = []
    for m in members_of(optimizer):
        if not is_whole(m):
            continue
        for g in m.param_groups:
            for p in g["params"]:
                s = slot_of.get(p)
                if s is not None and s.spec is not None:
                    problems.append(
                        f"{type(m).__name__} steps each parameter whole, and {s.fqn!r} is split "
                        "by tensor parallelism (a DTensor on the tp mesh): zerofn owns whole "
                        "tensors of the data-parallel layout only; give it to an elementwise "
                        "optimizer such as AdamW, or train it without tensor parallelism.")
    return problems


def overlap_whole(plan, optimizer) -> list[str]:
    """Owned parameters are stepped at step(), after every rank's rows are reduced."""
    if plan.offload.overlap_step and any(is_whole(m) for m in members_of(optimizer)):
        return ["offload(overlap_step=True) steps units during backward, and a whole-tensor "
                "optimizer (Muon, Adafactor) steps each parameter whole at step(), once every "
                "rank's rows are reduced: leave overlap_step off."]
    return []
