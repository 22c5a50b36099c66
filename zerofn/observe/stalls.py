"""A rank waiting long in one of zerofn's collectives says what it waits in.

A collective that a rank never joins holds the others until the timeout (30 minutes for
a gloo group made without one). The commonest cause is a loop's own: under ZeRO-3 every
forward gathers each unit from every rank, so an evaluation, ``generate()`` or a save on
one rank alone waits in its first gather for ranks that never come. ``StallWatch`` follows
each wait for a collective (the runtime's timing hands it every one: runtime/timing.py's
``WatchedWaits``); a thread of its own logs, once per wait that lasts ``after`` seconds
(the sharding option ``stall_warning``), the collective, its unit and phase and the likely
cause. The wait itself goes on until the timeout, which the failure watch turns into a
``RankFailure`` (failures.py).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger("zerofn")


class StallWatch:
    """Follows this rank's waits for collectives; logs one that lasts ``after`` seconds.

    Args:
        after: seconds before a wait is logged (None: never).
        rank: this rank (global), for the message.
        where: called for the rank's phase as the failure watch records it.
        timeout: the seconds a collective may wait before it fails (for the message).
    """

    def __init__(self, after: float | None, rank: int, where, timeout: float):
        self.after, self.rank, self.where, self.timeout = after, rank, where, timeout
        self._current = None      # (kind, unit, start) of the wait under way
        self._warned = None       # the wait last logged
        self._stop = threading.Event()
        self._thread = None

    @contextlib.contextmanager
    def waiting(self, kind: str, unit: str | None):
        """Around one wait for a collective of ``kind`` (for ``unit``, where it has one)."""
        if self.after is None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="zerofn-stalls")
            self._thread.start()
        wait = (kind, unit, time.monotonic())
        self._current = wait
        try:
            yield
        finally:
            self._current = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(5.0, self.after / 4)
        while not self._stop.wait(period):
            wait = self._current
            if wait is not None and wait is not self._warned \
                    and time.monotonic() - wait[2] >= self.after:
                self._warned = wait
                log.warning(self.message(*wait))

    def message(self, kind: str, unit: str | None, start: float) -> str:
        what = f"the {kind} of unit '{unit}'" if unit else f"a {kind}"
        return (f"zerofn: rank {self.rank} has waited {time.monotonic() - start:.0f} s in "
                f"{what} ({self.where()}) for ranks that have not joined it. Every rank must "
                "run the same collectives: under ZeRO-3 every forward gathers each unit "
                "from every rank, so an evaluation, generate() or a save on one rank alone "
                "waits here for ranks that never come (run it on every rank). The wait ends "
                f"after the timeout ({self.timeout:g} s; the sharding option timeout=) with "
                "a RankFailure.")
