"""Copy-before-write for background saves: what a save in flight holds of each unit.

[Note: copy-before-write per unit] A background save (``async_save=True``) copies nothing
of the units' masters and moments at its call: every one of them is a placeholder
(streamed.py), and the background writer copies each item out of the live state (or
reads it from a file, decoded) as it writes it. Training goes on meanwhile. Before a step
changes a unit (the runtime asks ``before_change``; save_reads.py), each item of that
unit the writer has not taken yet is copied aside, within the budget: the half of
``staging_bytes`` a data file's size leaves (the writer itself holds one item's copy at
a time: checksums.py's [Note: one item at a time]). Where the budget is full, the step
waits until the writer has taken the unit's items, or taken copies made earlier and so
freed room: the one wait a background save costs training, counted (save_reads.py) and
timed as ``checkpoint_wait``. Units the writer reaches last are copied first: the wait lasts
until every unit not copied is written, so the copies go where they shorten it most.

Each item is written from the state at the call either way: the writer takes a copy made
before the change, or the live state before any change (the unit cannot change while
an item of it is neither taken nor copied, and taking and copying hold one lock).

A unit out of memory (a swap file, fewer bits) is read whole, into new memory, to be
written or copied: the writer and the copies share one reader, so one unit is read at a
time, and its bytes are kept out of the copies' budget, so that the copies aside and the
read stay within that half together, and the save within it and one item.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch


@dataclasses.dataclass
class Item:
    """A saved tensor of a unit: ``live`` (this rank's piece where it lies) where the unit
    is in memory, else read through a ``UnitReader`` (``slot``, ``role``); written in
    ``dtype``."""
    unit: object
    slot: object
    role: int
    dtype: torch.dtype
    live: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return self.slot.local_numel * self.dtype.itemsize


class UnitCopies:
    """One background save's items of unit state (see the module note), between its
    writer (``take``) and training (``before_change``).

    Args:
        budget: bytes of copies ``before_change`` may hold at once, a unit read included.
        reader: the ``UnitReader`` (streamed.py) both sides read units out of memory with.

    Attributes:
        held, peak: bytes of copies this save holds now (made here, their storage not yet
            let go by the writer) and at most so far: at most ``budget`` and the one item
            the writer is writing.
        copied: units copied aside before a change.
    """

    def __init__(self, budget: int, reader):
        self.budget = budget
        self._reader = reader
        self._reading = 0                       # bytes of the largest unit read whole
        self._cond = threading.Condition()
        self._items: dict[int, Item] = {}       # placeholder id -> item, until taken
        self._left: dict = {}                   # unit -> ids of its items not taken yet
        self._last: dict = {}                   # unit -> when the writer takes its last item
        self._copies: dict[int, torch.Tensor] = {}    # id -> copy made before a change
        self._copied_bytes = 0                  # of _copies, which the budget bounds
        self._done = False
        self._count = threading.Lock()          # for held/peak (finalizers run anywhere)
        self.held = self.peak = 0
        self.copied: list = []

    def add(self, key: int, item: Item) -> None:
        """Register the item placeholder ``key`` stands for, in the writer's order."""
        self._items[key] = item
        if item.live is None:       # (read_unit: masters and two moments, in fp32)
            self._reading = max(self._reading, 3 * 4 * item.unit.shard_numel)
        self._left.setdefault(item.unit, set()).add(key)
        self._last[item.unit] = len(self._items)

    # -- the writer's side -----------------------------------------------------------------
    def take(self, key: int) -> torch.Tensor:
        """The item ``key`` as of the save's call, in memory of its own, for the writer."""
        with self._cond:
            item = self._items.pop(key)
            copy = self._copies.pop(key, None)
            if copy is None:
                copy = self._copy(item)
            else:
                self._copied_bytes -= item.nbytes
            left = self._left[item.unit]
            left.discard(key)
            if not left:
                del self._left[item.unit]
            self._cond.notify_all()
        return copy

    def set(self) -> None:
        """The writer is done (written, or failed): nothing waits for it any more. (What
        ``ChecksumWriter`` and the save's completion call, as on a ``threading.Event``.)"""
        with self._cond:
            self._done = True
            self._copies.clear()
            self._copied_bytes = 0
            self._reader.drop()
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        return self._done

    # -- training's side ---------------------------------------------------------------------
    def before_change(self, units) -> bool:
        """Return once none of ``units`` holds an item the writer still needs from it:
        each copied aside where the budget has room, else written. Returns whether it
        waited for the writer."""
        waited = False
        with self._cond:
            pending = sorted((u for u in units if u in self._left),
                             key=self._last.__getitem__, reverse=True)   # the writer's last first
            for unit in pending:
                while not self._safe(unit):
                    room = self.budget - self._reading - self._copied_bytes
                    if self._left_bytes(unit) <= room:
                        self._copy_aside(unit)
                    else:
                        waited = True
                        self._cond.wait()
        return waited

    def _safe(self, unit) -> bool:
        left = self._left.get(unit)
        return self._done or not left or all(k in self._copies for k in left)

    def _left_bytes(self, unit) -> int:
        return sum(self._items[k].nbytes for k in self._left[unit] if k not in self._copies)

    def _copy_aside(self, unit) -> None:
        read = False
        for key in list(self._left[unit]):
            if key not in self._copies:
                item = self._items[key]
                self._copies[key] = self._copy(item)
                self._copied_bytes += item.nbytes
                read = read or item.live is None
        if read:
            self._reader.drop()   # (the unit read for this goes now; the writer reads its own)
        self.copied.append(unit)

    # -- copies ------------------------------------------------------------------------------
    def _copy(self, item: Item) -> torch.Tensor:
        """``item``'s values in new host memory of exactly its bytes (DCP's writer takes it
        as it is), counted in ``held`` while it lives."""
        source = item.live if item.live is not None else \
            self._reader.value(item.unit, item.slot, item.role, item.dtype)
        copy = torch.empty(source.shape, dtype=item.dtype).copy_(source)
        nbytes = copy.numel() * copy.element_size()
        with self._count:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        # (the storage's life, not this tensor object's: the writer detaches its own)
        weakref.finalize(copy.untyped_storage(), self._let_go, nbytes)
        return copy

    def _let_go(self, nbytes: int) -> None:
        with self._count:
            self.held -= nbytes
