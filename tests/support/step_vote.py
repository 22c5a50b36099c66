"""The step's vote (runtime/step_grads.py) on one rank, the other rank of a world of two stood in
for by a group that adds its ballot."""
from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist

from zerofn.core.plan import Plan
from zerofn.runtime.param_table import ParamTable
from zerofn.runtime.step_grads import StepGrads
from zerofn.runtime.timing import UNTIMED


class OtherRank:
    """A world-2 group whose other rank's ballot is ``theirs``; keeps what was sent."""
    world = 2

    def __init__(self, theirs: torch.Tensor):
        self.theirs, self.sent, self.calls = theirs, None, 0

    def all_reduce(self, t, op):
        self.sent, self.calls = t.clone(), self.calls + 1
        if op == dist.ReduceOp.MAX:
            torch.maximum(t, self.theirs, out=t)
        else:
            t.add_(self.theirs)


def step_grads(comm, got: set, device="cpu") -> StepGrads:
    """The step's gradients over ``comm``, with the context and parts the vote reads."""
    ctx = types.SimpleNamespace(comm=comm, pool=None, units=(), device=torch.device(device),
                                timing=UNTIMED, replicas=None, copies=None, plan=Plan(),
                                groups=types.SimpleNamespace(model=None), table=ParamTable())
    return StepGrads(ctx, types.SimpleNamespace(got=got, to_owner=None),
                     types.SimpleNamespace(early=None),
                     None, types.SimpleNamespace(defers_scaling=False))


def vote(mine: set, theirs: list[float], device="cpu", found=None, rider=None):
    """Slots "a" and "b" trainable, this rank's gradients ``mine``; returns (overflow, the
    slots keeping a gradient, what this rank sent, where the vote made the host wait for
    the device: counted by CUDA's sync-debug mode, none on the CPU), and the rider's
    reduction when there is one."""
    comm = OtherRank(torch.tensor(theirs, device=device))
    step = step_grads(comm, mine, device)
    step._trainable, step._found = ["a", "b"], found
    step.grads = {s: torch.ones(2, device=device) for s in "ab"}   # the reduced rows
    cuda = torch.device(device).type == "cuda"
    if cuda:   # (torch 2.11 synchronizes as the mode is set: outside what is recorded)
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            reduced = step.vote(rider)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    waits = [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]
    out = (step.overflow, {s for s, g in step.grads.items() if g is not None},
           comm.sent.tolist(), waits)
    return out if rider is None else out + (reduced.item(),)
