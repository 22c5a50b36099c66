"""The planner beside whole-tensor optimizers (Muon + AdamW, Adafactor): each rank's
model-state bytes as the plan counts them (an owner's state and whole masters, Adam's
moments for the rest) are ``zf.model_state_bytes`` byte for byte at every stage and world,
the step's allocations what the step allocates, the owners it names are the runtime's, and
the plan prints their balance."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zerofn as zf
from support.allocations import Allocations
from support.owned import adafactor, muon_and_adamw
from support.ranks import run_ranks
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.planner import Candidate, plan
from zerofn.planner import memory
from zerofn.planner.owned import owned_of
from zerofn.runtime.runtime import runtime_of

# rows that do not divide by 4 ranks: the owners' whole tensors and the rows both show
CFG = GPTConfig(vocab=101, width=48, heads=2, ffn=100, layers=3, context=16)
OPTIMIZERS = {"muon": muon_and_adamw, "adafactor": adafactor}
LATE_FREES = 1.15
STAGES = [Candidate(stage=s, precision=p) for s in (1, 2, 3) for p in ("fp32", "bf16")]


def held_and_planned(rank, world, kind):
    """Per candidate: this rank's model-state bytes after two steps, the plan's for this
    rank, the bytes the third step allocates at its peak and the plan's, and the owners'
    loads the runtime chose and the plan names."""
    out = []
    for c in STAGES:
        torch.manual_seed(0)
        model = GPT(CFG)
        with torch.device("meta"):
            meta = GPT(CFG)
        owned = owned_of(meta, OPTIMIZERS[kind](meta), world)
        shape = memory.shape_of(meta, world, rank, owned)
        model, opts = c.apply(model, OPTIMIZERS[kind](model))
        x = torch.randint(0, CFG.vocab, (2, CFG.context))
        for _ in range(2):
            _backward(model, opts, x)
            _step(opts)
        held = zf.model_state_bytes(model)["cpu"]
        _backward(model, opts, x)
        with Allocations() as step:
            _step(opts)
        out.append((c.describe(), held, memory.model_state(c, shape)["device"], step.peak,
                    memory.step_temporaries(c, shape), runtime_of(model).owned_load(),
                    list(owned.load)))
    return out


def _backward(model, opts, x) -> None:
    for o in opts:
        o.zero_grad()
    model(x, x).backward()


def _step(opts) -> None:
    for o in opts:
        o.step()


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_owned_model_state_is_what_each_rank_holds(world, kind):
    """Every role on every rank, byte for byte, at ZeRO-1/2/3 in fp32 and bf16: each
    owner's optimizer state (measured from the user's optimizer on fake tensors) and whole
    masters on top of its rows, Adam's moments and counters for the parameters Adam holds;
    the step's allocations at their peak at the plan's figure or a little above; and
    the planner's owners are the runtime's (the same loads)."""
    for rank, rows in enumerate(run_ranks(world, held_and_planned, kind)):
        for described, held, planned, peak, planned_peak, load, planned_load in rows:
            for role in ("params", "grads", "optimizer"):
                assert held[role] == planned[role], \
                    (described, world, rank, role, held[role], planned[role])
            assert load == pytest.approx(planned_load), (described, world, rank)
            # The gather's whole gradients, the optimizer's work buffers, the update on its
            # way back: the step makes these and a scalar of the non-finite verdict (4
            # bytes). Gloo's worker thread sometimes lets go of a gather's send buffer (a
            # rank's rows of one parameter) after the next is made: up to 11 % more, seen.
            assert planned_peak <= peak <= planned_peak * LATE_FREES, \
                (described, world, rank, peak, planned_peak)
