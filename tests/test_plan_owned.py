"""The planner beside whole-tensor optimizers (Muon + AdamW, Adafactor): each rank's
model-state bytes as the plan counts them (an owner's state and whole masters, Adam's
moments for the rest) are ``zf.model_state_bytes`` byte for byte at every stage and world,
the owners it names are the runtime's, and the plan prints their balance."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zerofn as zf
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
STAGES = [Candidate(stage=s, precision=p) for s in (1, 2, 3) for p in ("fp32", "bf16")]


def held_and_planned(rank, world, kind):
    """Per candidate: this rank's model-state bytes after two steps, the plan's for this
    rank, and the owners' loads the runtime chose and the plan names."""
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
            for o in opts:
                o.zero_grad()
            model(x, x).backward()
            for o in opts:
                o.step()
        out.append((c.describe(), zf.model_state_bytes(model)["cpu"],
                    memory.model_state(c, shape)["device"],
                    runtime_of(model).owned_load(), list(owned.load)))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_owned_model_state_is_what_each_rank_holds(world, kind):
    """Every role on every rank, byte for byte, at ZeRO-1/2/3 in fp32 and bf16: each
    owner's optimizer state (measured from the user's optimizer on fake tensors) and whole
    masters on top of its rows, Adam's moments and counters for the parameters Adam holds;
    and the planner's owners are the runtime's (the same loads)."""
    for rank, rows in enumerate(run_ranks(world, held_and_planned, kind)):
        for described, held, planned, load, planned_load in rows:
            for role in ("params", "grads", "optimizer"):
                assert held[role] == planned[role], \
                    (described, world, rank, role, held[role], planned[role])
            assert load == pytest.approx(planned_load), (described, world, rank)
