"""Whole-tensor optimizers (Muon, Adafactor): each parameter's update computed whole, on
one owning rank.

[Note: owned parameters] Muon orthogonalizes each matrix's momentum (Newton-Schulz) and
Adafactor keeps row and column statistics, so stepping a shard of rows is not stepping
the whole. Each parameter such an optimizer holds is given one owner rank of the shard
group, balanced by the update's cost (``cost``: Newton-Schulz's flops for Muon, else the
element count), as Megatron's layer-wise distributed optimizer and torchtitan's FlexShard
``Owned`` layout do. At the step every rank sends the owner its rows of the parameter's
reduced gradient (one gather per parameter; under ZeRO-3's ``reduce_to_owner`` backward
reduced it whole to the owner already); the owner runs the user's own optimizer on
the whole tensor, keeping its whole masters from one step to the next, and sends the
update back. Where every rank computes on whole parameters (ZeRO-1/2, and ZeRO-3's
persistent unit) the owner broadcasts the updated whole masters: each rank writes its
rows into its masters and the whole into its compute parameter, and the unit's all-gather
leaves the parameter out (shards.py's ``written``), so the broadcast takes the place of
both a scatter and that all-gather's share. Under ZeRO-3 each rank keeps its rows only:
the owner scatters them. Masters written outside the step (a load) are carried by the
next gather too. Masters a home keeps out of memory (a swap file) are read from it and
written back through it (``write_rows``: nvme.py's [Note: owned rows in the file]). All
gathers are issued before any owner steps, so the ranks compute their matrices at the
same time, and every broadcast or scatter after: each rank's share of the work is its
owned parameters' cost.

The optimizer's state for an owned parameter lives on its owner only, whole (keyed, as
every state entry, by the tensor the group holds: this rank's rows), and nothing of it on
the other ranks.

[Note: owned state in state dicts] A state dict shows owned state as every other: each
tensor of the parameter's shape as this rank's rows (a Shard(0) DTensor, so DCP reshards
it to any world size, stage, or FSDP2 running the same optimizer), any other tensor and
value whole on every rank. ``spread`` puts it in that form (the owner scatters the rows,
broadcasts the rest) before a state dict is made or a checkpoint loaded into; the next step
``collect``s it back to the owner (a gather of the rows), whoever owns the parameter now:
a resume at another world size re-owns the matrices by that gather. Elementwise optimizers beside it (AdamW for the rest) step shards as
before.

[Note: owned traffic] Per step over ZeRO's own for the same parameters, as
``zf.comm_stats`` counts full buffers (docs/optimizers.md): at ZeRO-1/2 the gradient's
gather (+1x) and the broadcast (+1x) less the all-gather's share it replaces (-1x): +1x
the owned parameters' bytes. At ZeRO-3, by default, the gather and the scatter: +2x. The
owner needs the sum of every rank's whole gradient, and with each rank's reduced rows kept
for ``p.grad`` that is the reduce-scatter (ZeRO's own) and a gather (+1x); the update must
then reach the rows every rank keeps, and no collective of ZeRO-3's step carries them for
a scatter to replace (each rank writes its own shard; the next forward gathers). With
``shard_params(reduce_to_owner=True)`` the gradient reaches the owner by a reduce in place
of its share of the unit's reduce-scatter (+0: to_owner.py's [Note: gradients reduced to
their owner]), which ``_on_owner`` takes whole, and the scatter is the +1x; the price is
``p.grad``, which then holds no values on any rank (reading it raises). It is an option,
not the default, for that reason: the default keeps ``p.grad`` exact. The owner's whole
masters cost it memory: its owned parameters' elements, in the masters' dtype.
"""
from __future__ import annotations

import math

import torch

from ..core.units import local_of
from .agree import gather
from .chain import OptimizerChain, members_of, step_without_hooks
from .to_owner import ToOwner

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


def whole_params(members) -> list:
    """``(member, parameter)`` for every parameter a whole-tensor member of ``members``
    holds, in the order ``owners`` is given their shapes: the runtime's binding and the
    planner (zerofn/planner/owned.py) read the one order, so they name the same owners."""
    return [(m, p) for m in members if is_whole(m) for g in m.param_groups
            for p in g["params"]]


class OwnedStep:
    """The owned parameters of ``optimizer``'s whole-tensor members, and their step (see the
    module note).

    Args:
        ctx: the runtime's context (the shard group's ``comm``, the device).
        optimizer: the bound optimizer (a chain, or one).
        slot_of: each tensor the optimizer's groups hold -> its slot, before binding.
        shards: the compute rows (shards.py): which units are ZeRO-3's sharded ones, and
            the step's whole writes, which their all-gathers leave out.
        reducer: the gradients' (grads.py), told to reduce the owned rows' gradients to
            their owners under ``shard_params(reduce_to_owner=True)`` (to_owner.py).
    """

    def __init__(self, ctx, optimizer, slot_of: dict, shards, reducer):
        self.ctx, self.comm, self.shards, self.reducer = ctx, ctx.comm, shards, reducer
        self.table = ctx.table
        # slots ZeRO-3 keeps as rows (their updates are scattered), fixed at set-up
        self.as_rows = {s for u in shards.sharded_units for s in u.slots}
        members = members_of(optimizer)
        self.members = [m for m in members if is_whole(m)]
        rest = [m for m in members if not is_whole(m)]
        # What the homes step: the elementwise members (none: an empty chain steps nothing).
        self.elementwise = rest[0] if len(rest) == 1 and len(members) == 1 \
            else OptimizerChain(rest)
        self.slots = [(m, slot_of[p]) for m, p in whole_params(self.members)
                      if slot_of[p].requires_grad]
        owner, self.load = owners([s.global_shape for _, s in self.slots], self.comm.world)
        self.owner = {s: o for (_, s), o in zip(self.slots, owner)}
        self.spread = False   # [Note: owned state in state dicts]: state in rows, everywhere
        self.member_of = {s: m for m, s in self.slots}
        # The owners' whole masters, current where ``fresh`` (a set of slots, the same on
        # every rank: what the last steps scattered) holds the slot; else gathered.
        self.masters: dict = {}
        self.fresh: set = set()
        rows_owner = {s: o for s, o in self.owner.items() if s in self.as_rows}
        reducer.reduce_to_owners(ToOwner(rows_owner, ctx.units) if rows_owner and
                                 ctx.plan.sharding.reduce_to_owner else None)

    def mine(self) -> list:
        return [s for _, s in self.slots if self.owner[s] == self.comm.rank]

    @torch.no_grad()
    def step(self, grads: dict, grad_scale: float) -> None:
        """Every owned parameter with a gradient this step (the vote made that the same on
        every rank) gathered to its owner, stepped whole there, and sent back: broadcast
        whole where every rank computes on the whole parameter (ZeRO-1/2), else scattered
        as rows."""
        self.collect()
        todo = [(m, s) for m, s in self.slots if grads.get(s) is not None]
        if not todo:
            return
        masters = self._master_rows([s for _, s in todo])
        gathered = {s: self._on_owner(s, grads[s], grad_scale, masters.get(s))
                    if self.reducer.to_its_owner(s) else
                    self._gather(s, grads[s], grad_scale, masters.get(s)) for _, s in todo}
        whole = {s: w for s, w in gathered.items() if w is not None}
        for m in self.members:
            self._step_member(m, [s for mm, s in todo if mm is m and s in whole], whole)
        for _, s in todo:
            if s in self.as_rows:
                piece = self._scatter(s, whole.get(s))
                self._write(s, piece[:s.local_numel].view(s.local_shape))
            else:
                self._broadcast(s, whole.get(s))
        # Every rank's rows are the owners' whole masters now: the owners keep them.
        self.masters.update((s, w[0].to(self.table[s].opt_param.device))
                            for s, w in whole.items())
        self.fresh |= {s for _, s in todo}

    def stale(self) -> None:
        """Masters' rows were written outside the step (a load): the next step gathers
        them again. Called on every rank alike (a state dict access, a refresh)."""
        self.fresh = set()
        self.masters.clear()

    def _piece(self, s, rows: torch.Tensor, dtype, scale: float = 1.0) -> torch.Tensor:
        """``rows`` padded to the slot's ``chunk`` rows, flat, on the device."""
        piece = torch.zeros(s.chunk * s.inner, dtype=dtype, device=self.ctx.device)
        if s.local:
            piece[:s.local_numel].copy_(rows.reshape(-1))
            if scale != 1.0:
                piece.mul_(scale)
        return piece

    def _master_rows(self, slots: list) -> dict:
        """This rank's master rows of each of ``slots`` whose owner keeps no whole masters
        current: the optimizer's tensor, or where its home holds them out of memory (a swap
        file) read from there, a unit at a time."""
        homes, out, read = self.shards.homes, {}, {}
        for s in slots:
            if s in self.fresh:
                continue
            unit = self.shards.unit_of(s)
            if not homes.unread(unit):
                out[s] = self.table[s].opt_param
                continue
            if unit not in read:
                read[unit] = homes.read_unit(unit)[0]
            out[s] = s.shard_of(read[unit])
        return out

    def _write(self, s, rows: torch.Tensor) -> None:
        """The updated rows into this rank's masters, wherever its home keeps them."""
        self.shards.homes.write_rows(self.shards.unit_of(s), s, rows)

    def _gather(self, s, grad_rows, grad_scale: float, master_rows):
        """Send this rank's gradient rows to the owner, and its ``master_rows`` too where
        the owner keeps no whole masters current (one gather). Returns (whole masters,
        whole gradient) on the owner, else None."""
        dtype, owner, world = self.table[s].opt_param.dtype, self.owner[s], self.comm.world
        kept = s in self.fresh
        send = self._piece(s, grad_rows, dtype, grad_scale)
        if not kept:
            send = torch.cat([send, self._piece(s, master_rows, dtype)])
        if world == 1:
            recv = send.view(1, -1)
        else:
            recv = torch.empty(world, send.numel(), dtype=dtype, device=send.device) \
                if owner == self.comm.rank else None
            self.comm.gather(send, recv, owner)
        if recv is None:
            return None
        grad = _whole(s, recv[:, :s.chunk * s.inner])
        # (a copy: the owner keeps it, and at one rank it would be a view of ``send``)
        master = self.masters[s].to(grad.device) if kept \
            else _whole(s, recv[:, s.chunk * s.inner:]).clone()
        return master, grad

    def _on_owner(self, s, grad, grad_scale: float, master_rows):
        """A gradient reduced whole to its owner already (to_owner.py): the masters' rows
        are gathered to it only where it keeps no whole masters current. Returns (whole
        masters, whole gradient) on the owner, else None."""
        mine = self.owner[s] == self.comm.rank
        master = self.masters[s].to(self.ctx.device) if mine and s in self.fresh else None
        if s not in self.fresh:
            dtype = self.table[s].opt_param.dtype
            send = self._piece(s, master_rows, dtype)
            if self.comm.world == 1:
                recv = send.view(1, -1)
            else:
                recv = torch.empty(self.comm.world, send.numel(), dtype=dtype,
                                   device=send.device) if mine else None
                self.comm.gather(send, recv, self.owner[s])
            if mine:    # (a copy: the owner keeps it)
                master = _whole(s, recv).clone()
        if not mine:
            return None
        return master, grad.mul(grad_scale) if grad_scale != 1.0 else grad

    def _scatter(self, s, whole) -> torch.Tensor:
        """The owner's updated whole masters, this rank's rows to each rank: this rank's
        rows, padded to ``chunk``, flat."""
        owner, world = self.owner[s], self.comm.world
        if world == 1:
            return whole[0].view(-1)
        piece = torch.empty(s.chunk * s.inner, dtype=self.table[s].opt_param.dtype,
                            device=self.ctx.device)
        pieces = None
        if whole is not None:
            padded = torch.zeros(world * s.chunk * s.inner, dtype=piece.dtype, device=piece.device)
            padded[:s.numel].copy_(whole[0].reshape(-1))
            pieces = padded.view(world, -1)
        self.comm.scatter(piece, pieces, owner)
        return piece

    def _broadcast(self, s, whole) -> None:
        """The owner's updated whole masters to every rank, written into its masters' rows
        and its whole compute parameter: this replaces the scatter and the parameter's
        share of its unit's all-gather, which leaves it out (``shards.written``)."""
        if whole is not None:
            t = whole[0].contiguous()
        else:
            t = torch.empty(s.shape, dtype=self.table[s].opt_param.dtype, device=self.ctx.device)
        if self.comm.world > 1:
            self.comm.broadcast(t, self.owner[s])
        self._write(s, s.rows_of(t))
        local_of(s.param).detach().copy_(t)
        self.shards.written.add(s)

    def _step_member(self, member, slots: list, whole: dict) -> None:
        """``member`` steps the whole tensors of ``slots`` (this rank's): its groups hold
        them, with their state, for the one call, then the rows again."""
        if not slots:
            return
        saved = [list(g["params"]) for g in member.param_groups]
        mine = {self.table[s].opt_param: s for s in slots}
        tensor_of = {}
        for g in member.param_groups:
            held = [mine[p] for p in g["params"] if p in mine]
            g["params"][:] = [_whole_param(s, whole[s], tensor_of) for s in held]
        # The math runs where the whole tensors are (the device); the state lives with
        # the masters' rows (the host, under offload): up for the step, down after.
        for s in slots:
            if self.table[s].opt_param in member.state:
                member.state[tensor_of[s]] = _moved(member.state.pop(self.table[s].opt_param),
                                                    tensor_of[s].device)
        try:
            step_without_hooks(member)
        finally:
            for g, params in zip(member.param_groups, saved):
                g["params"][:] = params
            for s in slots:
                if tensor_of[s] in member.state:
                    member.state[self.table[s].opt_param] = _moved(
                        member.state.pop(tensor_of[s]), self.table[s].opt_param.device)

    # -- state dicts ([Note: owned state in state dicts]) ------------------------------
    def adopt_state(self) -> None:
        """At binding: state the optimizer already held (the same on every rank: a
        transform applied on top of another restored it whole) was cut to this rank's rows
        like any other, which is the spread form; the first step collects it."""
        self.spread = any(self.table[s].opt_param in self.member_of[s].state
                          for _, s in self.slots)

    @torch.no_grad()
    def make_state(self) -> None:
        """Before any step, the state a first step would make, for a load to load into: the
        owner steps its parameters' members once with lr 0 on zero stand-ins (torch's DCP
        helpers make state the same way)."""
        for m in self.members:
            bare = [s for s in self.mine() if self.member_of[s] is m
                    and self.table[s].opt_param not in m.state]
            if not bare:
                continue
            lrs = [g["lr"] for g in m.param_groups]
            for g in m.param_groups:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            try:
                zeros = {s: torch.zeros(s.shape, dtype=self.table[s].opt_param.dtype,
                                        device=self.table[s].opt_param.device) for s in bare}
                self._step_member(m, bare, {s: (z, torch.zeros_like(z)) for s, z in zeros.items()})
            finally:
                for g, lr in zip(m.param_groups, lrs):
                    g["lr"] = lr

    @torch.no_grad()
    def spread_out(self) -> None:
        """Owned state from its owner to every rank, as a state dict shows it. Collective."""
        self.stale()
        if self.spread or not self.slots:
            return
        mine = {s.fqn: _describe(self.member_of[s].state.get(self.table[s].opt_param))
                for s in self.mine()}
        described: dict = {}
        for part in gather(mine, self.comm.group):
            described.update(part)
        for _, s in self.slots:
            entries = described[s.fqn]
            if entries is None:
                continue
            own = self.member_of[s].state.pop(self.table[s].opt_param, {})
            self.member_of[s].state[self.table[s].opt_param] = {
                k: self._spread_value(s, own.get(k), meta) for k, meta in entries.items()}
        self.spread = True

    def _spread_value(self, s, value, meta):
        if meta[0] == "value":
            return meta[1]
        _, shape, dtype, device = meta
        if shape == tuple(s.shape):
            whole = None if value is None else (value, None)
            return self._scatter(s, whole)[:s.local_numel].view(s.local_shape).to(
                dtype).to(device).clone()
        out = value if value is not None else torch.empty(shape, dtype=dtype)
        moved = out.to(self.ctx.device)
        self.comm.broadcast(moved, self.owner[s])
        return moved.to(device)

    @torch.no_grad()
    def collect(self) -> None:
        """Owned state back to its owner, whole; none left on the other ranks. Collective."""
        if not self.spread:
            return
        for _, s in self.slots:
            state = self.member_of[s].state.pop(self.table[s].opt_param, None)
            if state is None:
                continue
            whole = {k: self._collect_value(s, v) for k, v in state.items()}
            if self.owner[s] == self.comm.rank:
                self.member_of[s].state[self.table[s].opt_param] = whole
        self.spread = False

    def _collect_value(self, s, value):
        if not (torch.is_tensor(value) and value.dim() and value.shape == s.local_shape):
            return value
        if self.comm.world == 1:
            return value
        send = self._piece(s, value, value.dtype)
        recv = torch.empty(self.comm.world, send.numel(), dtype=value.dtype,
                           device=send.device) if self.owner[s] == self.comm.rank else None
        self.comm.gather(send, recv, self.owner[s])
        if recv is None:
            return None
        return recv.reshape(-1)[:s.numel].view(s.shape).to(value.device).clone()


def _describe(state) -> dict | None:
    """What the other ranks need to receive one parameter's state: per key, a tensor's
    shape, dtype and device, or the value itself."""
    if state is None:
        return None
    return {k: ("tensor", tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) and v.dim()
            else ("value", v) for k, v in state.items()}


def _moved(state: dict, device) -> dict:
    """A parameter's state with its tensors (not its step count) on ``device``."""
    return {k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def _whole(s, pieces: torch.Tensor) -> torch.Tensor:
    """The whole parameter-shaped tensor from each rank's padded rows (one row each)."""
    return pieces.reshape(-1)[:s.numel].view(s.shape)


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
                elif s is not None and s.dp is not None:
                    problems.append(
                        f"{type(m).__name__} steps each parameter whole, and {s.fqn!r} shards "
                        "over a group of its own (groups=: an expert), whose ranks hold other "
                        "experts than the data-parallel group's owners would gather: give the "
                        "experts to an elementwise optimizer such as AdamW.")
    return problems


def overlap_whole(plan, optimizer) -> list[str]:
    """Owned parameters are stepped at step(), after every rank's rows are reduced."""
    if plan.offload.overlap_step and any(is_whole(m) for m in members_of(optimizer)):
        return ["offload(overlap_step=True) steps units during backward, and a whole-tensor "
                "optimizer (Muon, Adafactor) steps each parameter whole at step(), once every "
                "rank's rows are reduced: leave overlap_step off."]
    return []


def reduce_to_owner_problems(plan, optimizer) -> list[str]:
    """What ``shard_params(reduce_to_owner=True)`` cannot do beside a whole-tensor
    optimizer (to_owner.py): refused at set-up, on every rank."""
    if not plan.sharding.reduce_to_owner or plan.stage < 3 or optimizer is None or \
            not any(is_whole(m) for m in members_of(optimizer)):
        return []
    if plan.offload.device == "nvme":
        return ["shard_params(reduce_to_owner=True) with offload('nvme'): the swap file "
                "steps each unit's gradient rows, and an owned parameter's gradient is on "
                "its owner only; use offload('cpu'), or drop reduce_to_owner."]
    return []
