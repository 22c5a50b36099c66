"""How a runtime finds the optimizer it steps with when the transform was given none
([Note: finding the optimizer] in optimizer.py): a step pre-hook torch.optim runs before
every optimizer's step, registered while any runtime lives, that binds an optimizer
holding a runtime's parameters at its first step.

The hook costs an optimizer zerofn does not serve one look at its parameters, and
nothing more while their number stays the same; a bound optimizer, one dictionary look-up.
It is the one thing zerofn registers with torch for the whole process, and it goes when
the last runtime does.

An optimizer that holds others (``optimizers``: torchtitan's ``OptimizersContainer``, an
``Optimizer`` itself over every parameter, whose step steps each it holds) is left alone:
each optimizer it holds is bound at its own first step, inside the container's.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_runtimes: "weakref.WeakSet" = weakref.WeakSet()        # every runtime alive
_bound: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # optimizer -> True
_retired: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> why
_foreign: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> params seen
_handle = None


def watch(runtime) -> None:
    """``runtime`` waits for its optimizer (or has one, which a later one may replace)."""
    global _handle
    _runtimes.add(runtime)
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_on_step)


def forget(runtime) -> None:
    """``runtime`` is undone: the hook goes with the last one."""
    global _handle
    _runtimes.discard(runtime)
    if not _runtimes and _handle is not None:
        _handle.remove()
        _handle = None


def bound(optimizer) -> None:
    _bound[optimizer] = True
    _foreign.pop(optimizer, None)


def unbound(optimizer) -> None:
    _bound.pop(optimizer, None)


def retire(optimizer, why: str) -> None:
    """``optimizer`` no longer steps a model (another took its parameters over): stepping
    it raises ``why``."""
    unbound(optimizer)
    _retired[optimizer] = why


def _on_step(optimizer, args, kwargs) -> None:
    if optimizer in _bound or _holds_optimizers(optimizer):
        return
    why = _retired.get(optimizer)
    if why is not None:
        raise ValueError(why)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if _foreign.get(optimizer) == len(params):
        return
    holders = [rt for rt in list(_runtimes) if any(p in rt.param_index for p in params)]
    if not holders:
        _foreign[optimizer] = len(params)
        return
    if len(holders) > 1:
        raise ValueError(f"zerofn: this {type(optimizer).__name__} holds parameters of "
                         f"{len(holders)} models zerofn transformed; build one optimizer per "
                         "model.")
    holders[0].bind(optimizer, takeover=True)


def _holds_optimizers(optimizer) -> bool:
    inner = getattr(optimizer, "optimizers", None)
    return isinstance(inner, (list, tuple)) and bool(inner) and \
        all(isinstance(o, torch.optim.Optimizer) for o in inner)
