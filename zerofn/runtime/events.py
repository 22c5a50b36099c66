"""What a runtime announces, and how observers from outside it subscribe.

[Note: observers] The runtime does not know the TensorBoard monitor or the failure watch:
it imports neither. Whoever applies a plan names the kinds of observer it wants
(``ObserverKind``; zerofn/api.py passes the watch and the monitor, explicitly); the
runtime asks every kind at set-up whether the plan is fine for it (``preflight``, raised
on every rank before any collective) and whether to attach (``attach``), then tells the
observers what happens through ``StepObserver``'s methods. An observer that times regions offers its ``Timing``, which the runtime passes
to its parts when it builds them; one that guards calls offers ``guard``, which wraps the
entry points backward's hooks and the step go through. Nothing is patched in place.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from .timing import UNTIMED, WatchedWaits


class StepObserver:
    """Told what a runtime does; every method is a no-op unless overridden.

    Attributes:
        timing: a ``runtime.timing.Timing`` to time the runtime's regions with, or None.
        stalls: a watch of long waits (``waiting(kind, unit)``, a context around each wait
            for a collective: observe/stalls.py), or None.
    """

    timing = None
    stalls = None

    def forward_begin(self) -> None:
        """The model's forward starts (not a recompute inside backward)."""

    def forward_end(self, raised: BaseException | None) -> None:
        """The model's forward ended; ``raised`` is what it raised, if it did."""

    def backward_begin(self) -> None:
        """Backward reached the model's output (once per forward), before any of zerofn's
        own backward work."""

    def backward_gathered(self) -> None:
        """Backward's first collective is done: under ZeRO-3, the root unit gathered again
        (right after ``backward_begin`` for the other stages). A rank waiting in that
        gather is still at the end of forward to its peers: none has backward's work."""

    def step_begin(self) -> None:
        """``optimizer.step()`` starts."""

    def step_done(self) -> None:
        """``optimizer.step()`` is done (skipped or not)."""

    def grad_norm(self, total: torch.Tensor) -> None:
        """``zf.clip_grad_norm_`` measured this step's total norm."""

    def phase(self, name: str) -> None:
        """The job entered a phase of its own between steps (``"checkpoint save"``)."""

    def set_step(self, step: int) -> None:
        """The next optimizer step is number ``step`` (a resumed run counts on)."""

    def guard(self, fn: Callable, unit: str | None = None) -> Callable:
        """``fn`` as it should be called from hooks and the step (``unit``: the unit the
        call is for). The default leaves it as it is."""
        return fn

    def close(self) -> None:
        """The runtime is undone; let go of what is held."""


def unguarded(fn: Callable, unit: str | None = None) -> Callable:
    """The guard of a runtime nobody observes: ``fn`` as it is."""
    return fn


class ObserverKind(Protocol):
    """A kind of observer a runtime may be built with: a class (or any object) with these
    two methods."""

    def preflight(self, plan, device: torch.device, rank: int, world: int) -> list[str]:
        """What stops this observer under ``plan`` on this rank ([] if nothing)."""

    def attach(self, runtime) -> StepObserver | None:
        """An observer of ``runtime`` (its groups and plan are known), or None."""


def _told_to_all(event: str):
    """An ``Observers`` method that tells every observer ``event``."""
    def tell(self, *args) -> None:
        for o in self.all:
            getattr(o, event)(*args)
    tell.__name__, tell.__doc__ = event, getattr(StepObserver, event).__doc__
    return tell


class Observers(StepObserver):
    """The observers of one runtime, told as one."""

    forward_begin = _told_to_all("forward_begin")
    forward_end = _told_to_all("forward_end")
    backward_begin = _told_to_all("backward_begin")
    backward_gathered = _told_to_all("backward_gathered")
    step_begin = _told_to_all("step_begin")
    step_done = _told_to_all("step_done")
    grad_norm = _told_to_all("grad_norm")
    phase = _told_to_all("phase")
    set_step = _told_to_all("set_step")
    close = _told_to_all("close")

    def __init__(self, observers: list[StepObserver]):
        self.all = observers
        timing = next((o.timing for o in observers if o.timing is not None), UNTIMED)
        stalls = next((o.stalls for o in observers if o.stalls is not None), None)
        self.timing = timing if stalls is None else WatchedWaits(timing, stalls)

    def find(self, cls) -> StepObserver | None:
        return next((o for o in self.all if isinstance(o, cls)), None)

    def guard(self, fn, unit=None):
        for o in self.all:
            fn = o.guard(fn, unit)
        return fn
