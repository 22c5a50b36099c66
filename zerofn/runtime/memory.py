"""Model-state bytes a runtime holds, by role and place, measured from the tensors that
exist (unique storages), not computed from a formula: a fair check of the formulas in
docs/design.md. And the process's own figures as the kernel keeps them (``proc_bytes``)."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


def _extents(tensors, arenas=(), pool=None) -> list[tuple[str, int, int]]:
    """``(where, start, end)`` byte ranges the tensors hold; ``where`` is the device type,
    or "host" for zerofn's offload arenas (host memory even where the device is the CPU).
    A view of a flat buffer zerofn hands out (an arena, the device's masters, a buffer of
    the ``pool``: a lent gradient shard) spans its own bytes, not the whole buffer's; any
    other tensor its whole storage."""
    out = []
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        arena = next((a for a in arenas if a.holds(t)), None)
        if arena is not None:
            out.append((getattr(arena, "where", "host"), t.data_ptr(), t.data_ptr() + _span(t)))
        elif pool is not None and pool.owns(t):
            out.append((t.device.type, t.data_ptr(), t.data_ptr() + _span(t)))
        else:
            st = t.untyped_storage()
            out.append((t.device.type, st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


def _span(t: torch.Tensor) -> int:
    """Bytes a view spans: a stand-in expanded to a parameter's shape spans one element."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _union_bytes(ranges) -> int:
    total, end = 0, -1
    for a, b in sorted(ranges):
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


def _by_role(extents: dict[str, list]) -> dict[str, dict[str, int]]:
    """Bytes per place and role, each byte counted once, under the first role that holds
    it: the views of one buffer overlap (a unit's flat rows, its parameters' views of
    them), and a buffer can serve two roles (fp32 shards are their own masters)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict(params=0, grads=0, optimizer=0,
                                                              buffers=0))
    claimed: dict[str, list] = defaultdict(list)
    for role, ranges in extents.items():
        for where in dict.fromkeys(w for w, _, _ in ranges):   # (in order: what prints)
            mine = [(a, b) for w, a, b in ranges if w == where]
            before = _union_bytes(claimed[where])
            claimed[where] += mine
            out[where][role] += _union_bytes(claimed[where]) - before
    return out


def model_state_bytes(ctx, optimizer, homes, shards, reducer,
                      kept=()) -> dict[str, dict[str, int]]:
    """``zf.model_state_bytes`` of one runtime's parts (zerofn/state/accounting.py says what
    each role and place holds); ``kept``: more optimizer-role tensors (an owner's whole
    masters, owned.py)."""
    slots = [s for u in ctx.units for s in u.slots]
    arenas = list(homes.arenas()) + shards.flats
    # offload("cpu") under mixed precision: the host's compute-dtype copy of the rows, which
    # the step writes and sends to the device (under params=True, the shards themselves).
    table = ctx.table
    params = [table[s].sharded if table[s].sharded is not None else s.param for s in slots] \
        + homes.compute_copies()
    # (an optimizer's own .grad is a marker outside the step: visible.py)
    grads = [s.param.grad for s in slots] + list(reducer.grad_shard.values()) \
        + list(homes.grads.values())
    state = optimizer.state.values() if optimizer is not None else ()
    opt = [table[s].opt_param for s in slots] + [t for st in state for t in st.values()] \
        + homes.state_buffers() + list(kept)
    # The pool's buffers last: bytes of them a role above holds (a lent gradient shard)
    # are that role's, counted once.
    out = _by_role({role: _extents(ts, arenas, ctx.pool) for role, ts in
                    (("params", params), ("grads", grads), ("optimizer", opt),
                     ("buffers", ctx.pool.buffers()))})
    for where, roles in homes.unseen_bytes().items():
        for role, n in roles.items():
            out[where][role] += n
    return dict(out)


def proc_bytes(field: str, path: str = "/proc/self/status") -> int:
    """A kernel figure kept in kB, in bytes: ``VmHWM`` (this process's peak resident
    memory), ``VmRSS``, or with ``path="/proc/meminfo"`` ``MemAvailable``; 0 where the
    kernel keeps none (not Linux)."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) * 1024 for line in f
                         if line.startswith(field + ":")), 0)
    except OSError:
        return 0
