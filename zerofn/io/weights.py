"""``zf.full_weights``: the model's full weights streamed out in buckets, for a consumer in
memory (an inference engine taking the trained weights every few steps).

[Note: weights in buckets] A per-parameter ``full_tensor()`` loop runs one collective per
parameter (hundreds for a small model), each too small to use the wire, and every rank
must reach each in the same order. Here the state dict's tensors (their names the model's
state-dict hooks give) are cut, in order, into buckets of at most ``bucket_bytes`` of full
tensors (one larger tensor is a bucket alone); per bucket each rank packs its rows of
every tensor into one buffer and one all-gather (a gather to one rank, with ``to=``)
brings every rank's; each full tensor is then cut out of it as it is yielded, so beyond
the model a rank holds one gathered bucket and the tensor being yielded. Offloaded state
out of memory (NVMe, fewer bits) is read a unit at a time (checkpoint/streamed.py). A
tensor sharded otherwise than along dim 0 over one mesh dimension (tensor parallelism)
is gathered by itself with ``full_tensor()``.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime import runtime_of
from ..state.hooks import hooked_modules
from ..state.plain import plain_model
from ..state.state_dict import get_model_state_dict, unread_model_state_dict
from .checkpoint.streamed import placeholders

BUCKET_BYTES = 256 << 20


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
    world = dist.get_world_size()
    if to != "all" and not (isinstance(to, int) and 0 <= to < world):
        raise ValueError(f"full_weights(to={to!r}): pass \"all\" or a global rank, 0 to "
                         f"{world - 1}.")
    return _gathered(rt, model, bucket_bytes, dtype, to)


def _plain(module: nn.Module, dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    if to != "all" and dist.is_initialized() and dist.get_rank() != to:
        return
    for name, t in module.state_dict().items():
        yield name, _cast(t, dtype).clone()


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _gathered(rt, model, bucket_bytes: int, dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    if hooked_modules(rt.model, load=False):      # what hooks derive needs the whole state
        msd, reads = get_model_state_dict(model), {}
    else:
        msd = unread_model_state_dict(model)
        reads = placeholders(rt, msd, {}, background=False, narrow=False)
    for bucket in _buckets(msd, bucket_bytes, dtype):
        yield from _bucket_out(bucket, reads, dtype, to)


def _buckets(msd: dict, bucket_bytes: int, dtype) -> list[list[tuple[str, torch.Tensor]]]:
    """The entries in order, in buckets of at most ``bucket_bytes`` of full tensors, the
    gathered ones of a bucket in one dtype (one buffer packs them)."""
    out, size, packs = [[]], 0, None
    for name, t in msd.items():
        out_dtype = _out_dtype(t, dtype)
        gathered = _row_sharded(t) is not None
        nbytes = t.numel() * out_dtype.itemsize
        if size and (size + nbytes > bucket_bytes or gathered and packs not in (None, out_dtype)):
            out.append([])
            size, packs = 0, None
        out[-1].append((name, t))
        size += nbytes
        packs = out_dtype if gathered else packs
    return [b for b in out if b]


def _out_dtype(t: torch.Tensor, dtype) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _row_sharded(t) -> int | None:
    """The mesh dimension ``t`` is split along dim 0 over (the others replicate), else
    None."""
    if not isinstance(t, DTensor):
        return None
    dims = [i for i, p in enumerate(t.placements) if p == Shard(0)]
    if len(dims) != 1 or any(not isinstance(p, (Shard, Replicate)) or
                             (isinstance(p, Shard) and i != dims[0])
                             for i, p in enumerate(t.placements)):
        return None
    return dims[0]


def _bucket_out(bucket, reads: dict, dtype, to) -> Iterator[tuple[str, torch.Tensor]]:
    """One bucket's full tensors: the row-sharded ones in one gather, the rest alone."""
    sharded = [(n, t) for n, t in bucket if _row_sharded(t) is not None]
    if len({(id(t.device_mesh), _row_sharded(t)) for _, t in sharded}) > 1:
        sharded = []       # (split over several meshes: each tensor alone, below)
    full = _gather_rows(sharded, reads, dtype, to) if sharded else {}
    for name, t in bucket:
        if name in full:
            value = full.pop(name)
            if value is not None:
                yield name, value()
            continue
        value = _local(t, reads)
        if isinstance(t, DTensor):
            whole = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False,
                                       shape=t.shape, stride=t.stride()).full_tensor()
        else:
            whole = value.clone()
        if _receives(to, t):
            yield name, _cast(whole, dtype)


def _receives(to, t) -> bool:
    return to == "all" or dist.get_rank() == to


def _local(t, reads: dict) -> torch.Tensor:
    read = reads.get(id(t))
    if read is not None:
        return read()
    return t.to_local() if isinstance(t, DTensor) else t


def _gather_rows(entries, reads: dict, dtype, to) -> dict:
    """``{name: a function giving its full tensor}`` (None where this rank receives
    nothing), from one collective over the mesh dimension they are split along."""
    first = entries[0][1]
    group = first.device_mesh.get_group(_row_sharded(first))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out_dtype = _out_dtype(first, dtype)
    pieces = [[_rows(t.shape[0], world, r) * math.prod(t.shape[1:]) for _, t in entries]
              for r in range(world)]
    longest = max(sum(p) for p in pieces)
    send = torch.zeros(longest, dtype=out_dtype)
    at = 0
    for (_, t), n in zip(entries, pieces[rank]):
        if n:
            send[at:at + n].copy_(_local(t, reads).reshape(-1))
        at += n
    if to == "all":
        got = torch.empty(world * longest, dtype=out_dtype)
        dist.all_gather(list(got.chunk(world)), send, group=group)
    elif to not in dist.get_process_group_ranks(group):   # (HSDP: another replica's)
        return {name: None for name, _ in entries}
    elif dist.get_rank() == to:
        got = torch.empty(world * longest, dtype=out_dtype)
        dist.gather(send, list(got.chunk(world)), dst=to, group=group)
    else:
        dist.gather(send, None, dst=to, group=group)
        return {name: None for name, _ in entries}
    starts = [0] * world
    out = {}
    for i, (name, t) in enumerate(entries):
        spans = []
        for r in range(world):
            spans.append((r * longest + starts[r], pieces[r][i]))
            starts[r] += pieces[r][i]
        out[name] = _assembler(got, spans, t, dtype)
    return out


def _assembler(got: torch.Tensor, spans, t, dtype):
    def assemble() -> torch.Tensor:
        whole = torch.cat([got[s:s + n] for s, n in spans])
        return whole.view(t.shape)
    return assemble


def _rows(rows: int, world: int, rank: int) -> int:
    """Rank ``rank``'s rows of ``rows`` split as torch.chunk splits them."""
    chunk = -(-rows // world) if rows else 0
    return max(0, min(rows, (rank + 1) * chunk) - min(rows, rank * chunk))
