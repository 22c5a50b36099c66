"""The step's vote (runtime/step_grads.py): a gradient is kept where any rank got one, dropped
where none did, and an overflow on any rank skips the step everywhere. A rank that got
every gradient and has no overflow to learn takes part in the all-reduce but does not
read its result (on CUDA that read would stall the host each step); tests/test_cuda.py
checks that it stays free of host synchronization."""
from __future__ import annotations

import pytest
import torch

from support.step_vote import OtherRank, step_grads, vote


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


def test_clipping_norm_rides_on_the_vote():
    """One all-reduce carries the norm part, the overflow verdict and the gradients' union
    (summed: any nonzero is "some rank"); a second vote in the step sends nothing."""
    overflow, got, sent, _, norm = vote({"a"}, [2.5, 0.0, 0.0, 1.0], found=torch.zeros(()),
                                       rider=torch.tensor(4.0))
    assert sent == [4.0, 0.0, 1.0, 0.0] and norm == 6.5 and not overflow and got == {"a", "b"}
    comm = OtherRank(torch.zeros(3))
    step = step_grads(comm, {"a", "b"})
    step._trainable, step._found = ["a", "b"], None
    assert step.vote(torch.tensor(1.0)) is not None and step.vote(torch.tensor(1.0)) is None
    assert comm.calls == 1
