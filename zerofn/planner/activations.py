"""What one micro-batch's forward and backward allocate beyond the model's parameters,
measured by running them on fake tensors (no memory, no arithmetic): torch's own
``MemTracker`` under ``FakeTensorMode`` follows every tensor's storage as it is made and
freed, so the peaks here are the peaks of the real run's live tensors, in the compute
dtype, with or without activation checkpointing.

Two backward passes are measured because the stages treat gradients differently: DDP and
ZeRO-1 keep every parameter's gradient until backward ends, ZeRO-2 and ZeRO-3 let each
go once it is packed for its reduction (zerofn/runtime/grads.py).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode)
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class Activations:
    """Bytes one micro-batch allocates on top of the parameters (gradients included where
    they are kept).

    Attributes:
        forward: the peak during forward.
        saved: what forward leaves for backward (the activations saved).
        backward_kept: the peak of forward and backward with every gradient kept (DDP,
            ZeRO-1), the gradients counted.
        backward_dropped: the peak of forward and backward with each gradient let go as it is
            made (ZeRO-2/3), so only the in-flight one counts.
        grads: the gradients' bytes, which ``backward_kept`` holds at its end.
    """

    forward: int
    saved: int
    backward_kept: int
    backward_dropped: int
    grads: int


_MEASURED: dict = {}


def measure(model: nn.Module, inputs: tuple, compute: torch.dtype,
            checkpoint: bool = False) -> Activations:
    """One micro-batch's activations: ``model(*inputs)`` (a scalar loss, or anything whose
    first tensor is summed into one) on fake tensors in the compute dtype. ``inputs``
    may be real or meta tensors; only their shapes and dtypes are read. The model's own
    parameters are not touched (it may live on the meta device). Kept per model class,
    parameter shapes and inputs, so a second plan of the same model measures nothing."""
    key = (type(model), tuple((n, tuple(p.shape), p.requires_grad)
                              for n, p in model.named_parameters()),
           tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else repr(t) for t in inputs),
           compute, checkpoint)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(model, inputs, compute, checkpoint)
    return _MEASURED[key]


def _measure(model, inputs, compute, checkpoint) -> Activations:
    try:
        with _checkpointing(model, checkpoint):
            keep = _run(model, inputs, compute, drop_grads=False)
            drop = _run(model, inputs, compute, drop_grads=True)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ValueError(
            f"the planner measures activations by running {type(model).__name__} on fake "
            f"tensors, which carry shapes but no values, and its forward has an operation "
            f"whose output depends on the values ({e}: a mixture-of-experts' routing, a "
            f"boolean mask). Plan a stand-in whose layers compute the same shapes densely "
            f"(every expert on its expected share of the tokens), or choose the stage and "
            f"offload by hand (docs/choosing.md).") from None
    return Activations(forward=keep[0], saved=keep[1], backward_kept=keep[2],
                       backward_dropped=drop[2], grads=keep[3])


def _run(model, inputs, compute, drop_grads: bool) -> tuple[int, int, int, int]:
    """(forward peak, saved at forward's end, backward peak, gradients) in bytes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = {id(p): torch.empty(p.shape, device="cpu", dtype=compute if
                                    p.is_floating_point() else p.dtype)
                 .requires_grad_(p.requires_grad) for p in model.parameters()}
        # every name, a tied weight's second too, so none keeps its real tensor
        params = {n: fakes[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        buffers = {n: torch.empty(b.shape, dtype=b.dtype, device="cpu")
                    for n, b in model.named_buffers(remove_duplicate=False)}
        args = tuple(_fake_input(t, compute) for t in inputs)
        if drop_grads:
            for p in fakes.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_let_go)
        tracker = MemTracker()
        _skip_grad_hooks(tracker, [p for p in fakes.values() if not p.requires_grad])
        tracker.track_external(*fakes.values())
        base = _live(tracker, "current")
        # (the fake tensors stay the module's through backward, where checkpointed blocks
        # run their forward again)
        with tracker, _reparametrize_module(model, {**params, **buffers}):
            loss = _loss(model(*args))
            forward = _live(tracker, "peak") - base
            saved = _live(tracker, "current") - base
            loss.backward()
            backward = _live(tracker, "peak") - base
            grads = sum(p.grad.nbytes for p in fakes.values() if p.grad is not None)
    return forward, saved, backward, grads


def _skip_grad_hooks(tracker: MemTracker, frozen: list[torch.Tensor]) -> None:
    """Mark ``frozen`` parameters' gradient hooks as installed: ``MemTracker`` registers a
    hook on every parameter of each module it enters, and a tensor that does not require a
    gradient refuses one (a LoRA's or a frozen embedding's base weights). They get no
    gradient, so there is nothing for the hook to count."""
    for p in frozen:
        none = OrderedDict()      # (a handle needs a dict it can refer to weakly)
        tracker._param_to_grad_hook_handles[p] = (RemovableHandle(none), RemovableHandle(none))


def _live(tracker: MemTracker, kind: str) -> int:
    snapshot = tracker.get_tracker_snapshot(kind)
    return sum(v["Total"] for v in snapshot.values())


def _let_go(p: torch.Tensor) -> None:
    p.grad = None


def _fake_input(t, compute):
    if not torch.is_tensor(t):
        return t
    dtype = compute if t.is_floating_point() else t.dtype
    return torch.zeros(t.shape, dtype=dtype, device="cpu")


def _loss(out) -> torch.Tensor:
    if torch.is_tensor(out):
        return out if out.dim() == 0 else out.float().sum()
    first = next(t for t in (out.values() if isinstance(out, dict) else out)
                 if torch.is_tensor(t))
    return _loss(first)


@contextlib.contextmanager
def _checkpointing(model: nn.Module, on: bool):
    """zerofn.nanogpt's blocks recompute when told (``checkpoint``); other models are
    measured as they are and a checkpointing candidate scales by the unit count (the
    planner's note in memory.py)."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "checkpoint", None), bool)]
    before = [m.checkpoint for m in blocks]
    for m in blocks:
        m.checkpoint = on
    try:
        yield
    finally:
        for m, b in zip(blocks, before):
            m.checkpoint = b
