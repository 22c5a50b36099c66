"""The probe's calibration model, and what its measured peak says of the allocator's
overhead (probe_ranks.py measures; the plan reads).

The probe trains the calibration GPT at ZeRO-2 on one rank and records how far its peak
rose above the process's base (``calibration_rise``). The overhead is that rise beyond
the model state, over what the memory model predicts a step makes and frees, less one.
It is worked out from the rise each time a plan reads a probe, so a change to the memory
model changes the overhead with it and a probe stays valid.
"""
from __future__ import annotations

import torch

from zerofn.nanogpt import GPT, GPTConfig

from . import activations, memory
from .candidates import Candidate

MODEL = GPTConfig(vocab=4096, width=256, heads=4, ffn=1024, layers=4, context=64)
ROWS = 2                          # sequences a step
CANDIDATE = Candidate(stage=2)


def overhead(rise: int, on_host: bool) -> float:
    """The allocator's bytes per byte of what a step makes and frees, from the calibration
    model's measured ``rise`` (its process's high-water mark over the base on a CPU, the
    caching allocator's peak allocated bytes on a GPU)."""
    with torch.device("meta"):
        meta = GPT(MODEL)
    x = torch.zeros(ROWS, MODEL.context, dtype=torch.long)
    shape = memory.shape_of(meta, 1)
    live = memory.peak(CANDIDATE, shape, activations.measure(meta, (x, x), torch.float32),
                       device_is_host=on_host)["host" if on_host else "device"]
    state = sum(sum(roles.values()) for roles in memory.model_state(CANDIDATE, shape).values())
    # the model state is made once and kept: the overhead is on the rest
    return max(0.0, (rise - state) / (live - state) - 1)


def of(machine) -> float:
    """The overhead a probe says: from its calibration rise where it recorded one, else
    the figure it stored."""
    rise = machine.process.get("calibration_rise")
    if rise is None:
        return float(machine.process["overhead"])
    return overhead(int(rise), on_host=not machine.extra.get("cuda"))
