"""A background save whose writer waits for the first step (io/checkpoint/unit_copies.py):
so the steps right after ``save_checkpoint(..., async_save=True)`` find every unit still
to write, however fast the writer, and the tests of copy-before-write do not depend on
timing."""
from __future__ import annotations

import threading

from zerofn.io.checkpoint import streamed


class HeldUntilAStep(streamed.UnitCopies):
    """UnitCopies whose writer starts once the first step wants to change a unit, each
    made kept in ``made``. Put it in place of ``streamed.UnitCopies`` for a save followed
    by a step (a save waited for with no step between waits out ``take``'s timeout)."""
    made: list = []

    def __init__(self, *args):
        super().__init__(*args)
        self.arrived = threading.Event()
        HeldUntilAStep.made.append(self)

    def before_change(self, units):
        self.arrived.set()
        return super().before_change(units)

    def take(self, key):
        self.arrived.wait(timeout=120)   # (a step that never came: the asserts say so)
        return super().take(key)
