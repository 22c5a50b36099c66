"""Background saves still reading the state: before a step changes units, each save in
flight copies them aside or waits until it has written them (io/checkpoint/unit_copies.py's
[Note: copy-before-write per unit])."""
from __future__ import annotations

import threading
import time


class SaveReads:
    """The background saves reading this runtime's state, and the waits they cost.

    Each save is a guard (io/checkpoint/unit_copies.py's ``UnitCopies``) with
    ``before_change(units) -> bool``, which returns once ``units`` may change (whether
    it waited for the writer), and ``finished``.

    Attributes:
        waits: the steps (and units stepped during backward) that waited for a save,
            since set-up.
        waited_s: seconds they waited, since set-up.
    """

    def __init__(self):
        self._pending: list = []
        self._lock = threading.Lock()
        self.waits = 0
        self.waited_s = 0.0

    def add(self, guard) -> None:
        with self._lock:
            self._pending.append(guard)

    def before_change(self, units, timing) -> None:
        """Return once every save in flight lets ``units`` change (time:
        ``checkpoint_wait``, copies made for the save included)."""
        with self._lock:
            self._pending = [g for g in self._pending if not g.finished]
            pending = list(self._pending)
        if not pending:
            return
        start = time.perf_counter()
        with timing.span("checkpoint_wait", "checkpoint_wait"):
            waited = [g.before_change(units) for g in pending]
        if any(waited):
            self.waits += 1
            self.waited_s += time.perf_counter() - start

