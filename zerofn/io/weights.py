"""``zf.full_weights``: the model's full weights streamed out in buckets, for a consumer in
memory (an inference engine taking the trained weights every few steps).

[Note: weights in buckets] A per-parameter ``full_tensor()`` loop runs one collective per
parameter (hundreds for a small model), each too small to use the wire, and every rank
must reach each in the same order. Here the state dict's tensors (their names the model's
state-dict hooks give) are cut, in order, into buckets of at most ``bucket_bytes`` of full
tensors (one larger tensor is a bucket alone); per bucket each rank packs its rows of
every tensor into one buffer and one all-gather (a gather to one rank, with ``to=``)
brings every rank's; each full tensor is then cut out of it as it is yielded, so beyond
the model a rank holds one gathered bucket and the tensor being yielded. Where a bucket's
rows already lie side by side in one buffer (ZeRO-3's flat masters in memory), that
stretch is sent as it is, with no packing copy ([Note: sending the state where it lies]).
Offloaded state
out of memory (NVMe, fewer bits) is read a unit at a time (checkpoint/streamed.py). A
tensor sharded otherwise than along dim 0 over one mesh dimension (tensor parallelism)
is gathered by itself with ``full_tensor()``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime import runtime_of
from ..state.hooks import hooked_modules, plain_keys
from ..state.plain import plain_model
from ..state.state_dict import get_model_state_dict
from .checkpoint.streamed import UnitReader

BUCKET_BYTES = 256 << 20
_SLACK = 64     # elements of padding a sent stretch may hold per entry (flat buffers align)


def full_weights(model: nn.Module, *, bucket_bytes: int = BUCKET_BYTES,
                 dtype: torch.dtype | None = None, to: int | str = "all"
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of the model's state dict, gathered
    a bucket at a time. Iterate it on every rank, to the end: each bucket is a collective.

    Args:
        model: what a zerofn transform returned (any stage, any offload), or a model on a
            single rank or under DDP (its own tensors, no collective).
        bucket_bytes: the full tensors one gather brings, at most (in ``dtype``); a
            larger tensor comes alone.
        dtype: cast floating-point tensors to it (None: as the state dict shows them).
        to: ``"all"``: every rank receives; a rank number: that rank alone does, the
            others yield nothing (but must iterate all the same).

    Each tensor is new memory the caller may keep; equal to ``get_state_dict(model, opt,
    full=True)``'s, bit for bit. Names are the state dict's (its hooks' included).

    Example:
        >>> for name, t in zf.full_weights(model, bucket_bytes=1 << 28, dtype=torch.bfloat16, to=0):
        ...     engine.load_weight(name, t)      # on rank 0
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"full_weights(bucket_bytes={bucket_bytes!r}): pass the bytes one "
                         f"gather may bring, a positive int.")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"full_weights(dtype={dtype!r}): pass a floating-point torch.dtype "
                         f"or None.")
    if plain_model(model) is not None:
        return _plain(plain_model(model), dtype, to)
    rt = runtime_of(model)
    refuse_own_groups(rt, "full_weights", "gather the dense weights and each rank's own "
                      "experts yourself, or ")
    world = dist.get_world_size()
    if to != "all" and not (isinstance(to, int) and 0 <= to < world):
        raise ValueError(f"full_weights(to={to!r}): pass \"all\" or a global rank, 0 to "
                         f"{world - 1}.")
    return _gathered(rt, model, bucket_bytes, dtype, to)


def refuse_own_groups(rt, what: str, or_else: str = "") -> None:
    """Whole-model writers gather over one data-parallel group; under ``groups=`` each
    expert-parallel rank holds other experts under other names. Refused alike on every
    rank, before any collective."""
    if rt.plan.sharding.groups:
        raise ValueError(
            f"{what} writes the whole model from the ranks of one data-parallel group, and "
            f"under groups= each expert-parallel rank holds other experts: {or_else}save "
            "with zf.save_checkpoint (every expert once, under its own name), which "
            "zf.load_checkpoint loads into the whole model in one process.")


def _plain(module: nn.Module, dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    if to != "all" and dist.is_initialized() and dist.get_rank() != to:
        return
    for name, t in module.state_dict().items():
        yield name, _cast(t, dtype).clone()


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(_out_dtype(t.dtype, dtype))


@dataclass(frozen=True)
class _Entry:
    """One state-dict tensor to send: ``local()`` gives this rank's rows of it where it is
    split along dim 0 over ``group``, else (``group`` None) the whole tensor."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    group: object
    local: Callable[[], torch.Tensor]
    live: bool = False      # local() is a view of the state where it lies (no read)

    def rows(self, world: int, rank: int) -> int:
        """Rank ``rank``'s elements of it, split as torch.chunk splits the rows."""
        n = self.shape[0] if self.shape else 1
        chunk = -(-n // world)
        return max(0, min(n, (rank + 1) * chunk) - min(n, rank * chunk)) * \
            math.prod(self.shape[1:])


def _gathered(rt, model, bucket_bytes: int, dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    entries = _hooked_entries(model) if hooked_modules(rt.model, load=False) \
        else _entries(rt, model)
    for bucket in _buckets(entries, bucket_bytes, dtype):
        yield from _bucket_out(bucket, dtype, to)


def _entries(rt, model) -> list[_Entry]:
    """The state dict's entries from the slots and buffers themselves (no hook shapes it),
    in its order; offloaded state out of memory read a unit at a time."""
    rt.prepare_state_dict(read=False)
    reader = UnitReader(rt)
    slots, unit_of = rt.slots_by_name(), {s: u for u in rt.units for s in u.slots}
    buffers = dict(rt.model.named_buffers(remove_duplicate=False))
    out = []
    for name in plain_keys(rt.model):
        slot = slots.get(name)
        if slot is None:
            b = buffers[name]
            out.append(_Entry(name, b.shape, b.dtype, None, b.detach))
            continue
        unit, face = unit_of[slot], rt.master_rows(slot).dtype
        live = not rt.unread(unit)
        local = functools.partial(rt.master_rows, slot) if live else \
            functools.partial(reader.value, unit, slot, 0, face)
        mesh, placements = slot.layout(rt.mesh, rt.placements)
        if slot.spec is not None:       # (tensor parallelism: gathered alone)
            whole = functools.partial(_whole, slot, local, rt)
            out.append(_Entry(name, slot.global_shape, face, None, whole))
        else:
            group = mesh.get_group(list(placements).index(Shard(0)))
            out.append(_Entry(name, slot.global_shape, face, group, local, live))
    return out


def _whole(slot, local, rt) -> torch.Tensor:
    return slot.as_dtensor(local(), rt.mesh, rt.placements).full_tensor()


def _hooked_entries(model) -> list[_Entry]:
    """The entries of the state dict the model's hooks shape (the whole state read)."""
    out = []
    for name, t in get_model_state_dict(model).items():
        dim = _row_sharded(t)
        if dim is not None:
            out.append(_Entry(name, t.shape, t.dtype, t.device_mesh.get_group(dim),
                              t.to_local))
        elif isinstance(t, DTensor):
            out.append(_Entry(name, t.shape, t.dtype, None, t.full_tensor))
        else:
            out.append(_Entry(name, t.shape, t.dtype, None, t.detach))
    return out


def _buckets(entries: list[_Entry], bucket_bytes: int, dtype) -> list[list[_Entry]]:
    """The entries in order, in buckets of at most ``bucket_bytes`` of full tensors, the
    gathered ones of a bucket over one group in one dtype (one buffer packs them)."""
    out, size, packs = [[]], 0, None
    for e in entries:
        key = None if e.group is None else (id(e.group), _out_dtype(e.dtype, dtype))
        nbytes = math.prod(e.shape) * _out_dtype(e.dtype, dtype).itemsize
        if size and (size + nbytes > bucket_bytes or key is not None and
                     packs not in (None, key)):
            out.append([])
            size, packs = 0, None
        out[-1].append(e)
        size += nbytes
        packs = key if key is not None else packs
    return [b for b in out if b]


def _out_dtype(shown: torch.dtype, dtype) -> torch.dtype:
    return dtype if dtype is not None and shown.is_floating_point else shown


def _row_sharded(t) -> int | None:
    """The mesh dimension ``t`` is split along dim 0 over (the others replicate), else
    None."""
    if not isinstance(t, DTensor):
        return None
    dims = [i for i, p in enumerate(t.placements) if p == Shard(0)]
    if len(dims) != 1 or not all(p == Replicate() for i, p in enumerate(t.placements)
                                 if i != dims[0]):
        return None
    return dims[0]


def _bucket_out(bucket: list[_Entry], dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    """One bucket's full tensors: the split ones in one gather, the rest as they are."""
    split = [e for e in bucket if e.group is not None]
    full = _gather_rows(split, dtype, to) if split else {}
    receives = to == "all" or dist.get_rank() == to
    for e in bucket:
        if e.group is not None:
            assemble = full[e.name]
            if assemble is not None:
                yield e.name, assemble()
            continue
        whole = e.local()          # (a collective where tensor parallelism split it)
        if receives:
            yield e.name, _cast(whole, dtype).clone()


def _gather_rows(entries: list[_Entry], dtype, to) -> dict:
    """``{name: a function giving its full tensor}`` (None where this rank receives
    nothing), from one collective over the entries' group."""
    group = entries[0].group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out_dtype = _out_dtype(entries[0].dtype, dtype)
    pieces = [[e.rows(world, r) for e in entries] for r in range(world)]
    send, starts = _span(entries, pieces, out_dtype) or _packed(entries, pieces, rank,
                                                                 out_dtype)
    longest = send.numel()
    if to == "all":
        got = torch.empty(world * longest, dtype=out_dtype)
        dist.all_gather(list(got.chunk(world)), send, group=group)
    elif to not in dist.get_process_group_ranks(group):   # (HSDP: another replica's)
        return dict.fromkeys((e.name for e in entries), None)
    elif dist.get_rank() == to:
        got = torch.empty(world * longest, dtype=out_dtype)
        dist.gather(send, list(got.chunk(world)), dst=to, group=group)
    else:
        dist.gather(send, None, dst=to, group=group)
        return dict.fromkeys((e.name for e in entries), None)
    out = {}
    for i, e in enumerate(entries):
        spans = [(r * longest + starts[r][i], pieces[r][i]) for r in range(world)]
        out[e.name] = functools.partial(_assemble, got, spans, e.shape)
    return out


def _packed(entries: list[_Entry], pieces: list, rank: int, dtype: torch.dtype):
    """This rank's rows of every entry packed into one new buffer, as long as the
    longest rank's (cast to ``dtype``), and where each rank's rows of each entry start."""
    starts = [[sum(p[:i]) for i in range(len(p))] for p in pieces]
    send = torch.empty(max(sum(p) for p in pieces), dtype=dtype)
    for e, n, at in zip(entries, pieces[rank], starts[rank]):
        if n:
            send[at:at + n].copy_(e.local().reshape(-1))
    return send, starts


def _span(entries: list[_Entry], pieces: list, dtype: torch.dtype):
    """[Note: sending the state where it lies] Where every entry's rows are a view of one
    buffer in ``dtype`` (ZeRO-3's flat masters of every unit, held in memory), the
    stretch of that buffer they fill is sent as it is, with no packing copy, provided it
    holds little else (alignment padding). Each rank lays the buffer out alike (the
    offsets follow from the shapes and the world, as do the pieces), so every rank
    decides alike and sends as many elements. Returns ``(send, starts)`` as ``_packed``
    does, or None."""
    if not all(e.live for e in entries):
        return None
    locals_ = [e.local() for e in entries]
    storage = locals_[0].untyped_storage()
    if any(t.dtype != dtype or not t.is_contiguous()
           or t.untyped_storage().data_ptr() != storage.data_ptr() for t in locals_):
        return None
    widest = [max(p[i] for p in pieces) for i in range(len(entries))]
    lo = min(t.storage_offset() for t in locals_)
    hi = max(t.storage_offset() + n for t, n in zip(locals_, widest))
    if hi * dtype.itemsize > storage.nbytes() or hi - lo > sum(widest) + _SLACK * len(entries):
        return None
    send = torch.empty(0, dtype=dtype).set_(storage, lo, (hi - lo,))
    starts = [[t.storage_offset() - lo for t in locals_]] * len(pieces)
    return send, starts


def _assemble(got: torch.Tensor, spans, shape) -> torch.Tensor:
    return torch.cat([got[s:s + n] for s, n in spans]).view(shape)
