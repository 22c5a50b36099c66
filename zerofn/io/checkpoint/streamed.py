"""Saves that read what they write, a unit at a time.

[Note: streamed saves] Under ``offload("nvme")`` the state lives in a swap file, and under
``offload("cpu", state_dtype=..., master_dtype=...)`` in fewer bits; a state dict shows
both as fp32 tensors only once ``materialize`` has read (decoded) every unit into memory,
which for a save meant the rank's whole state in memory at once, on top of what DCP's
writer copies. A save instead puts, in place of each such tensor, a placeholder of its
shape and saved dtype (a stand-in of one element: DCP plans from shapes and dtypes only),
and ``StreamingPlanner.resolve_data``, which DCP's writer calls item by item as it writes,
reads the item's unit (``Runtime.read_unit``), keeping one unit in memory at a time. The
items are the same, in the same order, with the same bytes: FSDP2 and every reader read
them as before. A unit is read once for the masters (``model``) and once for its moments
(``optim``), as DCP writes the two halves one after the other.

What a model's own state-dict hooks make of the state (a fused projection saved in
pieces) is made from the stand-ins, which no unit read can fill: where a module with such
hooks holds parameters of an unread unit, the save reads every unit up front, as a state
dict does.

[Note: background saves] A background save (``async_save=True``) that copied the rank's
whole state before returning would double the largest thing the host holds under
offload, and one that held every step until it had written all would stall training for
the whole write. So every unit's masters and moments are placeholders as above,
wherever the unit lives (device, host, file, fewer bits), and the background writer
copies each out of the live state (or reads it) as it writes it, holding one item's copy
and one unit read from a file at a time. Training goes on: the first step that
would change a unit the writer has not finished with copies that unit's remaining items
aside first, within the rest of ``staging_bytes``, or, where that is full, waits for the
writer (unit_copies.py's [Note: copy-before-write per unit]); so the checkpoint holds
the state at the call, exactly. What is not a unit's masters or moments (buffers, step
counters, other optimizers' state, extras) is small and still copied at the call
(staging.py).
"""
from __future__ import annotations

import functools
import threading

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from ...runtime.homes.base import stand_in
from ...state.hooks import hooked_modules, within
from ...state.state_dict import get_state_dict, unread_state_dict
from .narrow import MOMENTS, narrowed, saved_dtype
from .unit_copies import Item, UnitCopies

ROLES = ("master", *MOMENTS)    # read_unit's order


class UnitReader:
    """The unit DCP is writing, in memory: read at its first item, let go at the next
    unit's (under a lock: DCP's writer threads take files in turn)."""

    def __init__(self, rt):
        self.rt, self.unit, self.flats = rt, None, None
        self.lock = threading.Lock()

    def value(self, unit, slot, role: int, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            if unit is not self.unit:
                self.unit, self.flats = None, None       # the last unit goes first
                self.flats, self.unit = self.rt.read_unit(unit), unit
            return _as(slot.shard_of(self.flats[role]), dtype)

    def drop(self) -> None:
        """Let the unit in memory go."""
        with self.lock:
            self.unit, self.flats = None, None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dtype != dtype else t


class StreamingPlanner(DefaultSavePlanner):
    """DCP's planner, reading each placeholder's item (``reads``: id(placeholder) -> a
    function giving its tensor) as it is written; ``copies``: a background save's
    copy-before-write (unit_copies.py), None for a synchronous save."""

    def __init__(self, reads: dict, copies: UnitCopies | None = None):
        super().__init__()
        self.reads, self.copies = reads, copies

    def resolve_data(self, write_item):
        if write_item.type != WriteItemType.BYTE_IO:
            read = self.reads.get(id(self.state_dict.get(write_item.index.fqn)))
            if read is not None:
                return read()
        return super().resolve_data(write_item)


def saved_state(rt, model, optimizer, budget: int | None = None
                ) -> tuple[dict, dict, StreamingPlanner | None]:
    """The ``(model, optim)`` state dicts a save writes (offloaded bf16 state in bf16:
    narrow.py) and the planner that reads their placeholders as DCP writes them (None:
    every tensor holds its values, DCP's own planner writes them). ``budget`` (a
    background save's): every unit's masters and moments are placeholders, copied out as
    written or before a step changes them, within ``budget`` bytes of copies made before
    a change ([Note: background saves], unit_copies.py)."""
    if _hooked(rt):        # (the note's last paragraph)
        msd, osd = get_state_dict(model, optimizer)
        reads, copies = {}, None
    else:
        msd, osd = unread_state_dict(model, optimizer)
        copies = None if budget is None else UnitCopies(budget, UnitReader(rt))
        reads = _placeholders(rt, msd, osd, copies)
    narrowed(rt, msd, osd)
    return msd, osd, (StreamingPlanner(reads, copies) if reads else None)


def _placeholders(rt, msd: dict, osd: dict, copies: UnitCopies | None) -> dict:
    """Replace the masters and moments of each unit to read as written (unread ones; with
    ``copies``, a background save's, every unit) in ``msd``/``osd`` by placeholders;
    return how each is read."""
    reads, reader = {}, UnitReader(rt)
    state = osd.get("state", {})
    unit_of = {s: u for u in rt.units for s in u.slots}
    for name, slot in rt.slots_by_name().items():
        unit = unit_of[slot]
        unread = rt.unread(unit)
        if not (unread or copies is not None):
            continue
        exact = rt.exact_dtypes(unit)
        for role, (table, key) in enumerate([(msd, name)] + [(state.get(name, {}), k)
                                                             for k in MOMENTS]):
            value = table.get(key)
            if not isinstance(value, DTensor):
                continue
            dtype = saved_dtype(value.dtype, exact[min(role, 1)])
            table[key] = slot.as_dtensor(stand_in(slot.local_shape, dtype), rt.mesh,
                                         rt.placements)
            if copies is None:
                reads[id(table[key])] = functools.partial(reader.value, unit, slot, role,
                                                          dtype)
            else:
                copies.add(id(table[key]), Item(unit, slot, role, dtype,
                                                None if unread else value.to_local()))
                reads[id(table[key])] = functools.partial(copies.take, id(table[key]))
    return reads


def _hooked(rt) -> bool:
    """Whether a module's own save hooks shape parameters of a unit left unread (what they
    derive from a stand-in, no unit read can fill)."""
    hooked = [name for name, _ in hooked_modules(rt.model, load=False)]
    unit_of = {s: u for u in rt.units for s in u.slots}
    return any(rt.unread(unit_of[slot]) and any(within(name, h) for h in hooked)
               for name, slot in rt.slots_by_name().items())
