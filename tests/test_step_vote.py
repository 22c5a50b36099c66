"""The step's vote (runtime/step.py): a gradient is kept where any rank got one, dropped
where none did, and an overflow on any rank skips the step everywhere. A rank that got
every gradient and has no overflow to learn takes part in the all-reduce but does not
read its result (on CUDA that read would stall the host each step); tests/test_cuda.py
checks that it stays free of host synchronization."""
from __future__ import annotations

import types
import warnings

import pytest
import torch

from zerofn.runtime.step import StepGrads


class OtherRank:
    """A world-2 group whose other rank's flags are ``theirs``; keeps what was sent."""
    world = 2

    def __init__(self, theirs: torch.Tensor):
        self.theirs, self.sent = theirs, None

    def all_reduce(self, t, op):
        self.sent = t.clone()
        torch.maximum(t, self.theirs, out=t)


def vote(mine: set, theirs: list[float], device="cpu", found=None):
    """Slots "a" and "b" trainable, this rank's gradients ``mine``; returns (overflow, the
    slots keeping a gradient, what this rank sent, the host synchronizations the vote
    made: counted by CUDA's sync-debug mode, 0 on the CPU)."""
    comm = OtherRank(torch.tensor(theirs, device=device))
    step = StepGrads(comm, None, [], types.SimpleNamespace(got=mine), None,
                     torch.device(device), None)
    step._trainable = ["a", "b"]
    step.grads = {s: torch.ones(2, device=device) for s in "ab"}   # the reduced rows
    cuda = torch.device(device).type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            overflow = step._vote(found)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return overflow, {s for s, g in step.grads.items() if g is not None}, \
        comm.sent.tolist(), syncs


@pytest.mark.parametrize("mine, theirs, kept", [
    ({"a", "b"}, [1.0, 0.0], {"a", "b"}),      # all here: known without reading
    ({"a"}, [0.0, 1.0], {"a", "b"}),           # b from the other rank only
    ({"a"}, [1.0, 0.0], {"a"}),                # b from no rank: dropped
    (set(), [0.0, 0.0], set()),
])
def test_gradients_any_rank_got_are_kept(mine, theirs, kept):
    overflow, got, sent, _ = vote(mine, theirs)
    assert not overflow and got == kept
    assert sent == [float(s in mine) for s in "ab"]     # every rank takes part


def test_an_overflow_on_another_rank_skips_the_step_on_a_rank_with_every_gradient():
    overflow, got, sent, _ = vote({"a", "b"}, [1.0, 1.0, 1.0], found=torch.zeros(()))
    assert overflow and got == {"a", "b"} and sent == [0.0, 1.0, 1.0]
    overflow, *_ = vote({"a", "b"}, [0.0, 1.0, 1.0], found=torch.zeros(()))
    assert not overflow
