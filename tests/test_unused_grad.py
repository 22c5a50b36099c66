"""``p.grad`` of a parameter no rank gave a gradient is None, as in plain PyTorch and FSDP2,
wherever that is known when backward ends (grads.py's [Note: a gradient no rank gave]): on
one rank from the first step, on two from the step after the first whose vote found one (the
first shows zeros, and the step leaves the parameter alone). A parameter only some ranks
used shows the ranks' gradient on every rank, as the global batch's has one in PyTorch."""
from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zerofn as zf
from support.loops import zero
from support.ranks import run_ranks
from support.shared_runs import shared

pytestmark = pytest.mark.multirank

STEPS = 3


class Spare(nn.Module):
    """``spare`` is never used; ``some`` only where the caller says (a rank's own rows)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.some = nn.Linear(8, 8)

    def forward(self, x, use_some: bool):
        h = self.used(x)
        return (self.some(h) if use_some else h).square().mean()


def grads_seen(model, opt, rank, world, some_on):
    """For each step: the parameters whose p.grad after backward is None, and whether the
    others' are all zeros (a parameter's zeros where no rank used it)."""
    torch.manual_seed(1)
    seen = []
    for _ in range(STEPS):
        x = torch.randn(4 * world, 8).chunk(world)[rank]
        model(x, rank in some_on).backward()
        none = sorted(n for n, p in model.named_parameters() if p.grad is None)
        zeros = sorted(n for n, p in model.named_parameters() if p.grad is not None and
                       not bool(p.grad.full_tensor().any() if hasattr(p.grad, "full_tensor")
                                else p.grad.any()))
        seen.append((none, zeros))
        opt.step()
        opt.zero_grad()
    return seen


def run(rank, world, kind, stage, some_on):
    torch.manual_seed(0)
    model = Spare()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif kind == "zerofn":
        model, opt = zero(stage)(model, opt)
    return grads_seen(model, opt, rank, world, some_on)


SPARE = ["spare.bias", "spare.weight"]
# (kind, stage, the ranks that use ``some``: None for all): every run at a world size
CASES = [("fsdp2", None, None)] + [("zerofn", stage, None) for stage in (1, 2, 3)]
ONE_RANK = [("zerofn", stage, frozenset({0})) for stage in (1, 2, 3)]


def cases_run(rank, world, cases):
    return [run(rank, world, kind, stage, set(range(world)) if some_on is None else some_on)
            for kind, stage, some_on in cases]


@shared
def seen_at(world: int) -> dict:
    """Each case's steps on each rank (a list over ranks), from one launch per world size:
    at two ranks the one-rank cases too."""
    cases = CASES + ONE_RANK * (world == 2)
    per_rank = run_ranks(world, cases_run, cases)
    return {case: [out[i] for out in per_rank] for i, case in enumerate(cases)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_no_rank_used_has_none_as_in_pytorch_and_fsdp2(world):
    torch_seen = run(0, 1, "torch", None, {0})
    assert torch_seen == [(SPARE, [])] * STEPS
    seen = seen_at(world)
    for fsdp2_seen in seen["fsdp2", None, None]:
        assert fsdp2_seen == torch_seen
    for stage in (1, 2, 3):
        for zerofn_seen in seen["zerofn", stage, None]:
            if world == 1:
                assert zerofn_seen == torch_seen, stage
            else:    # the first step's vote finds it; from the next backward on, None
                assert zerofn_seen == [([], SPARE)] + torch_seen[1:], stage


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_one_rank_used_shows_the_gradient_on_every_rank(stage):
    for seen in seen_at(2)["zerofn", stage, frozenset({0})]:
        assert seen == [([], SPARE)] + [(SPARE, [])] * (STEPS - 1), stage
