"""offload(..., overlap_step=True): the host steps each unit while backward goes on.

[Note: the host step during backward] Under ZeRO-2/3 a unit's reduced gradient shard is
final as soon as its reduction is waited, long before backward ends (the units behind it
are still in backward). Where the step needs no verdict on the whole gradient (no fp16
loss scaling, whose overflow check skips the step; no clipping, whose coefficient needs
the global norm), the host's Adam can step that unit then: a worker thread waits for the
unit's landing copy and runs the C++ kernel (which releases the GIL) while the main
thread goes on with backward. Only the arithmetic moves: the updated rows go back to the
device at ``opt.step()``, on the main thread, in the usual order, because their copies
and all-gathers are collectives every rank must issue in the same order.

The result is the step ``opt.step()`` would have taken, bit for bit, on these
conditions, each checked: one reducing backward per step (accumulate under
``model.no_sync()``; a second reduction of a stepped unit raises), no clipping
(``clip_grad_norm_`` raises), no fp16 scaling (refused at set-up). A unit this rank gave
no gradient to some of whose parameters waits for the step, where the ranks' union
decides ([Note: parameters without a gradient] in step_grads.py).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .homes import cpu_adam_steps


def overlap_problems(plan, optimizer) -> list[str]:
    """What stops ``overlap_step``: checked on every rank before any collective
    (``optimizer``: the one given to the transform, or None)."""
    if not plan.offload.overlap_step:
        return []
    why = []
    if plan.offload.device != "cpu":
        why.append("it steps the host offload's units (offload('cpu')); the NVMe swap "
                   "file is stepped in its own order")
    if plan.stage < 2:
        why.append("ZeRO-1 reduces the gradients at the step, not during backward: use "
                   "shard_grads (ZeRO-2) or shard_params (ZeRO-3)")
    if plan.precision.param_dtype == torch.float16:
        why.append("fp16 loss scaling must see every gradient's overflow verdict before any "
                   "unit steps: use bf16")
    if optimizer is None:
        why.append("it steps units during backward, before any optimizer.step() could make "
                   "the optimizer known: give it to the transform, model, opt = "
                   "zf.compose(...)(model, opt)")
    elif not cpu_adam_steps(optimizer):
        why.append(f"zerofn's CPU Adam steps each unit alone; {type(optimizer).__name__} "
                   "steps all parameters at once")
    return [f"offload(overlap_step=True): {w}." for w in why]


class EarlySteps:
    """The units the host stepped (or is stepping) during this step's backward."""

    def __init__(self, homes, optimizer, ctx):
        self.homes, self.optimizer, self.ctx, self.copies = homes, optimizer, ctx, ctx.copies
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofn-adam")
        self.started: dict = {}     # unit -> Future of its step
        self.stepped = 0            # units stepped during backward, over the run
        # This step's (unit name, submitted, started, ended), in perf_counter_ns.
        self.timeline: list = []
        self._new_step = True

    def landed(self, unit, got: set) -> None:
        """``unit``'s gradient shard is final and on its way to the host: step it now
        (``got``: the parameters that got a gradient on this rank)."""
        if unit in self.started:
            raise RuntimeError(
                f"offload(overlap_step=True) stepped unit '{unit.name}' when its gradients "
                "were reduced, and they were reduced again before opt.step(): accumulate "
                "micro-batches under `with model.no_sync():` (all but the last), or drop "
                "overlap_step.")
        if not self.homes.steps_early(unit):
            return
        if any(s not in got for s in unit.trainable):
            return      # (the ranks' union decides at the step)
        grads = {s: s.shard_of(self.homes.grads[unit]) for s in unit.trainable}
        self.ctx.saves.before_change([unit], self.ctx.timing)   # a background save first
        if self._new_step:
            self.timeline, self._new_step = [], False
        self.started[unit] = self.worker.submit(self._step, unit, grads,
                                                time.perf_counter_ns())
        self.stepped += 1

    def _step(self, unit, grads: dict, submitted: int) -> None:
        self.copies.host_wait(unit)            # the landing copy has arrived
        self.copies.before_host_write(unit)    # and no copy still reads the rows it rewrites
        start = time.perf_counter_ns()
        self.homes.step_unit(self.optimizer, unit, grads)
        self.timeline.append((unit.name, submitted, start, time.perf_counter_ns()))

    def take(self, unit) -> bool:
        """Whether ``unit`` was stepped early (waiting for it to finish): the step then
        only sends its rows back."""
        future: Future | None = self.started.pop(unit, None)
        if future is None:
            return False
        future.result()
        return True

    def clear(self) -> None:
        """After the step (or ``zero_grad``): nothing stepped early is pending. (The
        timeline keeps this step's spans until the next backward steps a unit.)"""
        for future in self.started.values():
            future.result()
        self.started.clear()
        self._new_step = True

    def refuse_clipping(self) -> None:
        raise ValueError(
            "zf.clip_grad_norm_ needs the whole gradient before any unit steps, and "
            "offload(overlap_step=True) steps each unit during backward: drop one of them.")
