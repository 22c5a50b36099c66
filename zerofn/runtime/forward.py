"""A runtime's hooks around forward: ZeRO-3's gathers before each unit runs and frees after,
the units' inputs tracked for backward, mixed precision's input cast, and the observers'
forward and backward events."""
from __future__ import annotations

import functools
import sys

import torch
from torch.utils._pytree import tree_map

from .backward import ZerofnUnitInputs
from .hooks import eager, in_backward, on_backward_begin
from .subclass import is_built_subclass


class ForwardHooks:
    """The hooks around the model's forward, registered at construction, removed by
    ``remove``: ZeRO-3's gather before each unit runs and free after (``gatherer``), the
    units' inputs tracked for backward (the ``reducer``'s tracker, backward.py's [Note: a
    unit's backward is done]), mixed precision's input cast, the observers' forward and
    backward events, and at each forward the loop's ``zero_grad`` followed (the
    ``stepper``'s, optimizer.py's [Note: zero_grad without a patch])."""

    def __init__(self, ctx, model, gatherer, reducer, stepper):
        self.ctx, self.model, self.gatherer = ctx, model, gatherer
        self.tracker, self.stepper = reducer.tracker, stepper
        self.observers = ctx.observers
        self._handles = self._unit_hooks() + self._model_hooks()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _unit_hooks(self):
        """ZeRO-3 only: ZeRO-1/2 keep full parameters and gather them inside step()."""
        handles = []
        root = self.ctx.units[-1]
        for unit in self.ctx.units if self.gatherer is not None else ():
            if unit.replicated:
                continue   # persistent params are whole: nothing to gather
            is_root = unit is root
            pre = self.observers.guard(self._pre_forward, unit.name)
            post = self.observers.guard(self._post_forward, unit.name)
            # [Note: hooks under torch.compile]
            handles.append(unit.module.register_forward_pre_hook(
                eager(lambda m, a, k, u=unit, r=is_root: pre(u, r, a, k)), prepend=True,
                with_kwargs=True))
            handles.append(unit.module.register_forward_hook(
                eager(lambda m, a, o, u=unit, r=is_root: post(u, r, o)), always_call=True))
        return handles

    def _model_hooks(self):
        """The observers' forward and backward events ([Note: observers]), for every stage.
        First among the model's hooks: an observer hears of a forward before its first
        gather, and of backward before ZeRO-3 gathers the root unit again; the last
        post-hook announces when that gather is done (its hook on the outputs runs after
        the root unit's)."""
        hooks = []
        precision = self.ctx.plan.precision
        if precision.param_dtype is not None and precision.cast_forward_inputs:
            # Before ZeRO-3's root hook tracks the inputs: it must track the cast ones.
            hooks.append(self.model.register_forward_pre_hook(
                eager(functools.partial(_cast_inputs, precision.param_dtype)), prepend=True,
                with_kwargs=True))
        return hooks + [
            self.model.register_forward_pre_hook(eager(self._forward_begins), prepend=True),
            self.model.register_forward_hook(eager(self._forward_ends), prepend=True,
                                             always_call=True),
            self.model.register_forward_hook(eager(self._backward_follows))]

    def _forward_begins(self, module, args) -> None:
        if not in_backward():   # (a checkpointed recompute is part of backward)
            _check_registered(self.ctx.units, self.ctx.table)
            self.stepper.follow_zero_grad()
            self.observers.forward_begin()

    def _forward_ends(self, module, args, output=None) -> None:
        if in_backward():
            return
        raised = sys.exc_info()[1]    # the forward raised: the hook runs anyway
        self.observers.forward_end(raised)
        if raised is None and torch.is_grad_enabled():
            _once_in_backward(output, self.observers.backward_begin)

    def _backward_follows(self, module, args, output) -> None:
        if not in_backward() and torch.is_grad_enabled():
            _once_in_backward(output, self.observers.backward_gathered)

    def _pre_forward(self, unit, is_root: bool, args: tuple, kwargs: dict):
        """Gather the unit; returns its inputs as the tracker follows them (backward.py's
        [Note: a unit's backward is done]), or None to leave them be."""
        self.gatherer.pre_forward(unit, is_root)
        # (also a recompute in backward: reentrant checkpointing ran the forward without
        # gradients and backpropagates the recompute; a non-reentrant one drops its graph)
        tracked = self.tracker.track_forward(unit, args, kwargs) \
            if torch.is_grad_enabled() else None
        self.gatherer.register_built(unit)     # (after the tracking: params.py says why)
        return tracked

    def _post_forward(self, unit, is_root: bool, output) -> None:
        raised = sys.exc_info()[1]     # the forward raised: the hook runs anyway
        if raised is not None:
            _explain_in_place(raised, unit)
        self.gatherer.post_forward(unit, is_root, output)


def _check_registered(units, table) -> None:
    """Every parameter zerofn laid out is still the one its modules hold: one replaced after
    the transform (tensor parallelism's ``parallelize_module`` applied after zerofn, or an
    assignment) would compute, and never be trained, silently."""
    for unit in units:
        for s in unit.slots:
            for module, name in s.owners:
                held = module._parameters.get(name)
                if held is not s.param and held is not table[s].sharded \
                        and not _computes_with_built(s, held):
                    raise ValueError(
                        f"zerofn: the model's parameter {s.fqn!r} is no longer the one zerofn "
                        "sharded: it was replaced after the transform (tensor parallelism's "
                        "parallelize_module applied after zerofn, or an assignment), and "
                        "zerofn would never train the new one. Split the model first "
                        "(parallelize_module), then apply zerofn; replace no parameter after.")


def _computes_with_built(slot, held) -> bool:
    """Whether ``held`` is the post-hook's subclass the slot's modules compute with while
    gathered (runtime/subclass.py): never an ``nn.Parameter``, unlike a replacement."""
    return slot.hooks is not None and is_built_subclass(held) \
        and not isinstance(held, torch.nn.Parameter)


def _cast_inputs(dtype: torch.dtype, module, args: tuple, kwargs: dict):
    """mixed_precision's ``cast_forward_inputs``: the floating tensors among the model's
    forward arguments, nested in containers too, in the compute dtype (FSDP2's rule)."""
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return tree_map(cast, args), tree_map(cast, kwargs)


def _explain_in_place(exc: BaseException, unit) -> None:
    """Name the rule behind autograd's error when a ZeRO-3 unit modifies its inputs in
    place (grads.py's [Note: a unit's backward is done]), once, at the innermost unit."""
    lead = "zerofn: under ZeRO-3, as under FSDP2, a unit may not modify its inputs in place"
    if not (isinstance(exc, RuntimeError) and ZerofnUnitInputs.__name__ in str(exc)) \
            or not hasattr(exc, "add_note") \
            or any(n.startswith(lead) for n in getattr(exc, "__notes__", ())):
        return
    exc.add_note(f"{lead}, and unit {unit.name!r} (or a module inside it) did: write "
                 f"`x = x * s`, not `x *= s` (docs/design.md §3).")


def _once_in_backward(output, announce) -> None:
    """``announce()`` when backward first reaches any of ``output``'s tensors."""
    heard = []

    def reached(grad):
        if not heard:
            heard.append(True)
            announce()
    on_backward_begin(output, eager(reached))
