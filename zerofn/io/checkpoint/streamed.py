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

[Note: background saves] ``async_save=True`` used to copy the rank's whole state to the
host before returning: under offload, where the state is the largest thing the host
holds, that doubled it. Now every unit off the device is a placeholder as above, read
(from the file, decoded, or where it lies in host memory) by the background writer as it
writes it, so the save holds one unit and one data file's copies at a time
(``staging_bytes``: two files). What lives on the device, and the small rest (buffers,
step counters, extras), is still copied at the call (staging.py). For the checkpoint to
hold the state at the call, nothing may change it before it is read: the save registers
an event with the runtime (``hold_state``), set once this rank has written its data, and
the first change to the state (the next step's, or a step during backward under
``overlap_step``) waits for it, timed as ``checkpoint_wait`` (TensorBoard's
``time/checkpoint_wait``). Forward and backward of the next step run while the save
writes.
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


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dtype != dtype else t


class StreamingPlanner(DefaultSavePlanner):
    """DCP's planner, reading each placeholder's item (``reads``: id(placeholder) -> a
    function giving its tensor) as it is written."""

    def __init__(self, reads: dict):
        super().__init__()
        self.reads = reads

    def resolve_data(self, write_item):
        if write_item.type != WriteItemType.BYTE_IO:
            read = self.reads.get(id(self.state_dict.get(write_item.index.fqn)))
            if read is not None:
                return read()
        return super().resolve_data(write_item)


def saved_state(rt, model, optimizer, background: bool = False
                ) -> tuple[dict, dict, StreamingPlanner | None]:
    """The ``(model, optim)`` state dicts a save writes (offloaded bf16 state in bf16:
    narrow.py) and the planner that reads their placeholders as DCP writes them (None:
    every tensor holds its values, DCP's own planner writes them). ``background``: every
    unit off the device is a placeholder, the ones in memory read where they lie when
    written ([Note: background saves])."""
    if _hooked(rt):        # (the note's last paragraph)
        msd, osd = get_state_dict(model, optimizer)
        reads = {}
    else:
        msd, osd = unread_state_dict(model, optimizer)
        reads = _placeholders(rt, msd, osd, background)
    narrowed(rt, msd, osd)
    return msd, osd, (StreamingPlanner(reads) if reads else None)


def _placeholders(rt, msd: dict, osd: dict, background: bool) -> dict:
    """Replace the masters and moments of each unit to read as written (unread ones; under
    ``background`` every unit off the device) in ``msd``/``osd`` by placeholders; return
    how each is read."""
    reads, reader = {}, UnitReader(rt)
    state = osd.get("state", {})
    unit_of = {s: u for u in rt.units for s in u.slots}
    for name, slot in rt.slots_by_name().items():
        unit = unit_of[slot]
        unread = rt.unread(unit)
        if not (unread or background and rt.home_of(unit) != "device"):
            continue
        exact = rt.exact_dtypes(unit)
        for role, (table, key) in enumerate([(msd, name)] + [(state.get(name, {}), k)
                                                             for k in MOMENTS]):
            value = table.get(key)
            if isinstance(value, DTensor):
                dtype = saved_dtype(value.dtype, exact[min(role, 1)])
                table[key] = slot.as_dtensor(stand_in(slot.local_shape, dtype), rt.mesh,
                                             rt.placements)
                reads[id(table[key])] = functools.partial(reader.value, unit, slot, role,
                                                          dtype) if unread else \
                    functools.partial(_as, value.to_local(), dtype)
    return reads


def _hooked(rt) -> bool:
    """Whether a module's own save hooks shape parameters of a unit left unread (what they
    derive from a stand-in, no unit read can fill)."""
    hooked = [name for name, _ in hooked_modules(rt.model, load=False)]
    unit_of = {s: u for u in rt.units for s in u.slots}
    return any(rt.unread(unit_of[slot]) and any(within(name, h) for h in hooked)
               for name, slot in rt.slots_by_name().items())
