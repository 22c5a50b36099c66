"""One run of the ranks shared by several tests: each asserts on its own case of a run that
computed every case on the same processes (a rank's first collective, DTensor and step pay
set-up costs that its later ones do not, and a reference trained once serves every case)."""
from __future__ import annotations

import functools

from .ranks import run_ranks


def shared(launch):
    """``launch`` (a function of, say, a world size) run once per arguments, its result or
    its failure given to every later call: the tests sharing a run fail alike, not each
    launch it again."""
    done: dict = {}

    @functools.wraps(launch)
    def once(*args):
        if args not in done:
            try:
                done[args] = (launch(*args), None)
            except Exception as error:
                done[args] = (None, error)
        result, error = done[args]
        if error is not None:
            raise error
        return result
    return once


class SharedRuns:
    """``run_ranks`` whose result for the same (world, fn, args) is computed once and given
    to every caller, a failure too (``shared``)."""

    def __init__(self):
        self._run = shared(lambda world, fn, args, timeout:
                           run_ranks(world, fn, *args, timeout=timeout))

    def __call__(self, world: int, fn, *args, timeout: float = 180):
        return self._run(world, fn, args, timeout)
