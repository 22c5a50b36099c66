"""Background saves that read the state as they write it: the first change to the state
waits until they have read it all (io/checkpoint/streamed.py's [Note: background saves])."""
from __future__ import annotations

import threading


class SaveReads:
    """The background saves still reading this runtime's state: each an event set once its
    rank has read (and written) every item."""

    def __init__(self):
        self._pending: list[threading.Event] = []
        self._lock = threading.Lock()

    def add(self, done: threading.Event) -> None:
        with self._lock:
            self._pending.append(done)

    def wait(self, timing) -> None:
        """Wait until every save in flight has read the state (time: ``checkpoint_wait``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            with timing.span("checkpoint_wait", "checkpoint_wait"):
                for done in pending:
                    done.wait()
