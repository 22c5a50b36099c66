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

[Note: a subclass as the compute weight] A post-hook may build a tensor subclass instead
(float8 training's ``Float8TrainingTensor``: float8 bytes and a scale, which the matmuls
use as they are). FSDP2 makes it an ``nn.Parameter`` of its own and reduces that one's
``.grad``. Here the plain parameter stays the one whose gradient the reducer waits for:
while the unit is gathered, its modules hold the subclass passed through ``_GradToParam``,
an autograd identity that hands the subclass's gradient (a plain tensor of the weight's
shape and dtype; anything else is refused in backward) to the plain parameter, so it is
counted, accumulated and reduced like any other, and masters, optimizer state and
checkpoints never see the subclass. The identity is made after the unit's inputs are
tracked, so backward runs it before the unit counts as done (backward.py). Autograd's saved
views of the subclass (a Linear's ``weight.t()``) are swapped for ``SavedSubclass``
markers, rebuilt from backward's gather, so no unit's gathered weight lives until
backward (params.py's [Note: saved tensors]).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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
    where nothing does. Where a rank's share of a parameter is short, the pre-hook runs once
    on every rank's: a short share's outputs of another size than the full shares' would
    hang the gather (FSDP2 asks the hook to pad them)."""
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
        if slot.rows == slot.chunk * mesh.size():    # (every share full: nothing to pad)
            continue
        # Every rank calls the hook, in the same order: it may hold a collective of its own
        # (float8's amax all-reduce). Only a short share's outputs can be wrong.
        values = getattr(local_of(slot.param), slot.hooks[1]).detach()
        rows = values[slot.rank * slot.chunk:][:slot.local]
        try:
            outputs, _ = pre_all_gather(subclass_of(slot, rows), slot, mesh, unit.module,
                                        policy_of(plan))
        except Exception as e:    # (told to every rank by set-up's agreement)
            problems.append(f"fsdp_pre_all_gather of {slot.fqn!r} failed on this rank's "
                            f"{slot.local} rows: {type(e).__name__}: {e}")
            continue
        if slot.local == slot.chunk:
            continue
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
            # (a copy of its own: post-hooks may keep the outputs as the weight's storage)
            outputs = tuple(
                ranks[:, at:at + torch.Size(shape).numel() * dtype.itemsize]
                .clone(memory_format=torch.contiguous_format)
                .view(dtype).view((-1,) + shape[1:])
                for at, dtype, shape in places)
            built = shard.fsdp_post_all_gather(outputs, meta, self.unit.compute_dtype)
            whole = built[0] if isinstance(built, tuple) else built
            _check_built(whole, s)
            if type(whole) is torch.Tensor:
                stride = torch.empty(s.shape, device="meta").stride()
                set_local(s.param, torch.as_strided(whole, s.shape, stride, 0))
            register(whole, s)
        self.recv = None


def _check_built(whole, slot: ParamSlot) -> None:
    """Refuse a post-hook output zerofn cannot compute with: a plain tensor smaller than the
    parameter, or a tensor subclass that is not the parameter's shape or that torch cannot
    take apart (``__tensor_flatten__``: its saved views are rebuilt from its parts)."""
    if type(whole) is torch.Tensor:
        if whole.numel() >= slot.numel:
            return
    elif is_traceable_wrapper_subclass(whole) and whole.shape == slot.shape:
        return
    raise TypeError(
        f"fsdp_post_all_gather of {slot.fqn!r} returned a {type(whole).__name__} of shape "
        f"{tuple(whole.shape)}; zerofn computes with a plain tensor of at least the "
        f"parameter's {slot.numel} elements, or a tensor subclass of its shape "
        f"{tuple(slot.shape)} that defines __tensor_flatten__ and __tensor_unflatten__. "
        "Return one of those from the hook, or shard this model with FSDP2's fully_shard.")


def is_built_subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a post-hook's weight that is a tensor subclass (float8 training's
    ``Float8TrainingTensor``) rather than a plain tensor."""
    return type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t)


def part_storages(t: torch.Tensor) -> list[int]:
    """The storages of a tensor subclass's inner tensors, by data pointer."""
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n).untyped_storage().data_ptr() for n in names]


class _GradToParam(torch.autograd.Function):
    """[Note: a subclass as the compute weight] The post-hook's subclass, as the tensor the
    module computes with, its gradient given to ``param`` (the slot's plain parameter).
    FSDP2 makes the subclass an ``nn.Parameter`` of its own and reduces that one's
    ``.grad``; here the gradient lands where every other parameter's does, on the plain
    parameter that the reducer's hooks watch, so it is counted, accumulated (``no_sync``)
    and reduced like any other."""

    @staticmethod
    def forward(ctx, param, built, fqn):
        ctx.fqn = fqn
        return built.view_as(built)

    @staticmethod
    def backward(ctx, grad):
        if type(grad) is not torch.Tensor:
            raise TypeError(
                f"the gradient of {ctx.fqn!r}'s gathered weight came back as a "
                f"{type(grad).__name__}; zerofn reduces a plain tensor of the weight's shape "
                "and dtype (as float8 training's Float8Linear gives). Make the subclass's "
                "backward return a plain gradient, or shard this model with FSDP2.")
        return grad, None, None


def compute_weight(slot: ParamSlot, built: torch.Tensor) -> torch.Tensor:
    """What the module computes with, while gathered, where the post-hook built a tensor
    subclass: the subclass itself, through ``_GradToParam`` where a gradient is to come."""
    if torch.is_grad_enabled() and slot.param.requires_grad:
        return _GradToParam.apply(slot.param, built, slot.fqn)
    return built


class SavedSubclass:
    """[Note: saved tensors] (params.py) for a view of a post-hook's subclass that autograd
    saves (float8's ``weight.t()``): which slot's weight it views, and how, so backward
    rebuilds it from the weight gathered again instead of keeping every unit's gathered
    weight until backward. ``parts``: per inner tensor, its ``(size, stride, offset)`` in
    the same inner tensor of the weight, or itself where it is not one of the weight's."""

    __slots__ = ("unit", "slot", "kind", "ctx", "size", "stride", "parts")

    def __init__(self, unit: Unit, slot: ParamSlot, t: torch.Tensor, built: torch.Tensor):
        self.unit, self.slot, self.kind = unit, slot, type(t)
        self.size, self.stride = t.size(), t.stride()
        names, self.ctx = t.__tensor_flatten__()
        self.parts = {}
        for n in names:
            inner, own = getattr(t, n), getattr(built, n, None)
            shared = own is not None and \
                inner.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
            self.parts[n] = ((inner.size(), inner.stride(), inner.storage_offset())
                             if shared else inner.detach())

    def rebuild(self, built: torch.Tensor) -> torch.Tensor:
        parts = {n: getattr(built, n).as_strided(*p) if isinstance(p, tuple) else p
                 for n, p in self.parts.items()}
        return self.kind.__tensor_unflatten__(parts, self.ctx, self.size, self.stride)
