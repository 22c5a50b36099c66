"""Parameters gathered by their tensor subclass's FSDP2 hooks (float8 training's weights).

[Note: gathered by a subclass's hooks] A parameter whose tensor subclass defines FSDP2's
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` is sharded as FSDP2 shards it. Its values
(the subclass's one inner tensor: the full-precision weight) are laid out like any
parameter's: masters, gradients, optimizer state and checkpoints are rows of them, and the
registered ZeRO-3 parameter is a ``Shard(0)`` DTensor whose local tensor is the subclass
over this rank's rows (what FSDP2's ``torch.chunk`` of the subclass makes). Only the gather
differs. Before it, the pre-hook turns this rank's rows into the tensors to gather (float8
bytes and a scale, say); they go, in the dtypes the hook gave, into one byte buffer per
unit, all-gathered apart from the unit's own buffer (hooked slots come last in a unit's
layout, so its own all-gather stops short of them). The post-hook then builds the whole
weight the forward computes with, from every rank's outputs concatenated along dim 0, as
FSDP2 hands them over. Hooks run at every gather: forward, and backward where ZeRO-3
gathers again. Inside zerofn the parameter is a plain one (the user's subclass parameter is
kept as an alias), pointed at the post-hook's tensor while gathered.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..core.units import ParamSlot, Unit, local_of, set_local

_ALIGN = 16     # bytes: each gathered tensor's start, so any dtype's view of it is aligned


def hooked_slots(unit: Unit) -> list[ParamSlot]:
    return unit.hooked


def subclass_of(slot: ParamSlot, rows: torch.Tensor) -> torch.Tensor:
    """The slot's tensor subclass over ``rows`` (plain values), made from its inner tensor
    as ``__tensor_unflatten__`` makes it."""
    kind, name, ctx = slot.hooks
    return kind.__tensor_unflatten__({name: rows}, ctx, rows.shape, rows.stride())


def unwrap_hooked(units) -> None:
    """Each hooked parameter becomes a plain one over its subclass's values, registered in
    its place; the user's is kept as an alias (an optimizer built before may hold it)."""
    for u in units:
        for s in hooked_slots(u):
            user = s.param
            plain = nn.Parameter(getattr(local_of(user), s.hooks[1]).detach(),
                                 requires_grad=user.requires_grad)
            s.aliases.append(user)
            s.param = plain
            for module, name in s.owners:
                module._parameters[name] = plain


def rewrap_hooked(slot: ParamSlot) -> None:
    """Undo ``unwrap_hooked`` for one slot whose plain parameter holds the whole values
    (the runtime's restore): the user's subclass parameter is the slot's again, its inner
    tensor holding those values, so a transform applied on top gathers it through its
    hooks too."""
    user = slot.aliases.pop()
    with torch.no_grad():
        inner = getattr(local_of(user), slot.hooks[1])
        inner.copy_(slot.param.data)
    slot.param = user


def subclass_problems(plan, units, mesh, hybrid: bool) -> list[str]:
    """What keeps zerofn from gathering the model's hooked parameters, on this rank; empty
    where nothing does. Where this rank's share is short, the pre-hook runs once on it:
    outputs of another size than the full shares' would hang the gather (FSDP2 asks the
    hook to pad them)."""
    hooked = [(u, s) for u in units for s in hooked_slots(u)]
    if not hooked:
        return []
    unit, slot = hooked[0]
    what = f"parameter {slot.fqn!r} is a {slot.hooks[0].__name__} gathered by its FSDP2 hooks"
    refusal = _refusal(plan, unit, slot, hybrid)
    if refusal:
        return [f"{what}, and {refusal}"]
    problems = []
    for unit, slot in hooked:
        if slot.local == slot.chunk:    # (a full share: nothing to pad)
            continue
        values = getattr(local_of(slot.param), slot.hooks[1]).detach()
        rows = values[slot.rank * slot.chunk:][:slot.local]
        outputs, _ = pre_all_gather(subclass_of(slot, rows), slot, mesh, unit.module,
                                    policy_of(plan))
        odd = [tuple(t.shape) for t in outputs if t.dim() == 0 or t.shape[0] != slot.chunk]
        if odd:
            problems.append(
                f"fsdp_pre_all_gather of {slot.fqn!r} returned tensors of shapes {odd} for "
                f"this rank's {slot.local} rows; every rank's must have the padded share, "
                f"{slot.chunk} rows (of {slot.rows} over {mesh.size()} ranks), or the ranks' "
                "gathers would not match: pad in the hook, as FSDP2 requires.")
    return problems


def _refusal(plan, unit: Unit, slot: ParamSlot, hybrid: bool) -> str:
    """Why the plan cannot gather hooked parameters yet ('' if it can)."""
    if plan.stage != 3:
        return ("zerofn calls those hooks at ZeRO-3 only (shard_params): at ZeRO-1 and 2 the "
                "whole parameter stays on every rank and is never gathered through them. "
                "Add zf.shard_params(), or use plain weights.")
    if plan.precision.param_dtype is not None and plan.offload.device is not None:
        return ("mixed precision (param_dtype) with offload is not combined with the hooks "
                "yet (the pre-hook reads the full-precision masters, which offload moves); "
                "drop one of the two.")
    if hybrid or unit.group is not None:
        return ("hybrid sharding and groups= meshes are not combined with the hooks yet; "
                "shard over one 1-D data-parallel group.")
    if slot.param.is_meta:
        return ("a meta-built model's subclass weights are not materialized yet; build the "
                "model on a real device.")
    return ""


def policy_of(plan) -> MixedPrecisionPolicy:
    """The plan's mixed precision as FSDP2 spells it, for the pre-hook."""
    return MixedPrecisionPolicy(param_dtype=plan.precision.param_dtype,
                                reduce_dtype=plan.precision.reduce_dtype)


def pre_all_gather(shard: torch.Tensor, slot: ParamSlot, mesh, module: nn.Module,
                   policy: MixedPrecisionPolicy):
    """``(outputs, metadata)`` of the subclass's pre-hook on ``shard``, called with what
    FSDP2 passes it (torch 2.13: the shard mesh, the whole parameter's size and contiguous
    stride, its module and the mixed-precision policy; older hooks take the mesh only)."""
    hook = shard.fsdp_pre_all_gather
    if len(inspect.signature(hook).parameters) == 1:
        return hook(mesh)
    stride = torch.empty(slot.shape, device="meta").stride()
    return hook(mesh, slot.shape, stride, module, policy)


def start_gather(unit: Unit, shards: list, comm, mesh, policy, issue) -> "HookedGather":
    """Run the pre-hooks on ``shards`` (each hooked slot of ``unit`` with its subclass over
    this rank's rows) and start the all-gather of their outputs, in one byte buffer, through
    ``issue`` (the gatherer's labelled start)."""
    pieces, offset = [], 0    # per slot: (slot, shard, metadata, [(offset, dtype, shape)])
    outputs_of = []
    for s, shard in shards:
        outputs, meta = pre_all_gather(shard, s, mesh, unit.module, policy)
        places = []
        for t in outputs:
            places.append((offset, t.dtype, tuple(t.shape)))
            outputs_of.append((offset, t))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pieces.append((s, shard, meta, places))
    recv = torch.empty(comm.world * offset, dtype=torch.uint8, device=unit.device)
    send = recv.view(comm.world, offset)[comm.rank]
    for at, t in outputs_of:
        send[at:at + t.numel() * t.element_size()].copy_(
            t.detach().contiguous().view(-1).view(torch.uint8))
    work = issue(lambda: comm.all_gather(recv, send, async_op=True,
                                         kind="subclass_all_gather"))
    return HookedGather(unit, comm.world, pieces, recv, work)


class HookedGather:
    """One unit's gather of its hooked parameters, started (``start_gather``): ``finish``
    waits for it and points each parameter at the post-hook's tensor, built in the compute
    dtype, telling ``register(tensor, slot)`` where each lies (params.py's saved
    tensors)."""

    def __init__(self, unit: Unit, world: int, pieces: list, recv: torch.Tensor, work):
        self.unit, self.world, self.pieces, self.recv, self.work = unit, world, pieces, recv, work
        self.nbytes = recv.numel() // world

    def finish(self, register) -> None:
        self.work.wait()
        ranks = self.recv.view(self.world, self.nbytes)
        for s, shard, meta, places in self.pieces:
            outputs = tuple(
                ranks[:, at:at + torch.Size(shape).numel() * dtype.itemsize].contiguous()
                .view(dtype).view((-1,) + shape[1:])
                for at, dtype, shape in places)
            built = shard.fsdp_post_all_gather(outputs, meta, self.unit.compute_dtype)
            whole = built[0] if isinstance(built, tuple) else built
            if type(whole) is not torch.Tensor or whole.numel() < s.numel:
                raise TypeError(
                    f"fsdp_post_all_gather of {s.fqn!r} returned a {type(whole).__name__} of "
                    f"{whole.numel()} elements; zerofn computes with a plain tensor of at "
                    f"least the parameter's {s.numel} elements (a tensor subclass as the "
                    "gathered weight is not supported yet).")
            stride = torch.empty(s.shape, device="meta").stride()
            set_local(s.param, torch.as_strided(whole, s.shape, stride, 0))
            register(whole, s)
        self.recv = None
