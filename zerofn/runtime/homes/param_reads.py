"""ZeRO-3 parameter shards read from the swap file ahead of their gathers
([Note: parameter shards on NVMe] in nvme.py)."""
from __future__ import annotations

import itertools

import torch


class ParamReads:
    """ZeRO-3 parameter shards read from the swap file just before their gathers, into the
    staging ring (idle outside the step), up to ``units_in_flight`` of them ahead of use.

    ``read_ahead`` names the units to come, in order; each buffer that frees up goes to the
    next of them, so reading runs ahead of the gathers for as long as the guess holds.

    A lent buffer may still be read by an asynchronous copy to the device after it is
    given back: ``take``'s ``copied`` waits for that copy, and runs before the buffer is
    read into again."""

    def __init__(self, store):
        self.store = store
        self.free = [(b, None) for b in store.staging]   # (buffer, wait for its last copy)
        self.held: dict = {}                  # unit -> (buffer, future), oldest first
        self._lent = None                     # (buffer, copied) ``take`` returned last
        self._plan = iter(())

    def read_ahead(self, units) -> None:
        """Read the shards of ``units`` (an iterable, consumed lazily), replacing the plan."""
        self._settle()
        self._plan = iter(units)
        self._fill()

    def take(self, unit, copied=None) -> torch.Tensor:
        """The unit's shard on the host, valid until the next call here; ``copied()`` then
        waits for the caller's copy of it, if any, before the buffer is reused."""
        if self.store.resident or unit not in self.store.params:
            # (may be newer than the file, after a load; or not in the file)
            return self.store.table[unit].shard
        self._settle()
        if unit not in self.held:
            if not self.free:
                self._drop(next(iter(self.held)))   # a read ahead that guessed wrong
            self._start(unit)
        buf, read = self.held.pop(unit)
        self._lent = (buf, copied)
        shard = read.result()
        self._fill()
        return shard

    def forget(self) -> None:
        """Let every read go: the step is about to use the buffers and rewrite the file.
        Their units go back to the front of the plan, for ``resume``."""
        self._settle()
        dropped = list(self.held)
        for u in dropped:
            self._drop(u)
        self.free = [(buf, _waited(copied)) for buf, copied in self.free]
        self._plan = itertools.chain(dropped, self._plan)

    def resume(self) -> None:
        """After the step: read the first units of the plan (the next forward's) again."""
        self._fill()

    def _fill(self) -> None:
        while self.free and not self.store.resident:   # materialized: read from memory
            u = next(self._plan, None)
            if u is None:
                return
            if u not in self.held and u in self.store.params:
                self._start(u)

    def _start(self, unit) -> None:
        buf, copied = self.free.pop()
        _waited(copied)
        self.held[unit] = (buf, self.store.io.submit(self.store.read_param, unit, buf))

    def _settle(self) -> None:
        """The caller is done with the buffer ``take`` lent it (its copy may not be)."""
        if self._lent is not None:
            self.free.append(self._lent)
            self._lent = None

    def _drop(self, unit) -> None:
        buf, read = self.held.pop(unit)
        read.result()
        self.free.append((buf, None))


def _waited(copied) -> None:
    """Wait for a copy out of a staging buffer, if one was made (``None`` after)."""
    if copied is not None:
        copied()
