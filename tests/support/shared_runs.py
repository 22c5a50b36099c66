"""One run of the ranks shared by several tests: each asserts on its own case of a run that
computed every case on the same processes (a rank's first collective, DTensor and step pay
set-up costs that its later ones do not, and a reference trained once serves every case)."""
from __future__ import annotations

from .ranks import run_ranks


class SharedRuns:
    """``run_ranks`` whose result for the same (world, fn, args) is computed once and given
    to every caller; a failure too, so the tests sharing a run fail alike, not each rerun."""

    def __init__(self):
        self._done: dict = {}

    def __call__(self, world: int, fn, *args, timeout: float = 180):
        key = (world, fn, args)
        if key not in self._done:
            try:
                self._done[key] = (run_ranks(world, fn, *args, timeout=timeout), None)
            except AssertionError as error:
                self._done[key] = (None, error)
        result, error = self._done[key]
        if error is not None:
            raise error
        return result
