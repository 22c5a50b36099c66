"""Under ``torchrun --max-restarts 1`` a job whose rank dies resumes from its latest
complete checkpoint on its own, and its losses are those of the run left alone.

The losses are compared as ``zerofn train`` prints them (4 decimals): the resumed run
recomputes the same steps from the same state and batches, so they are equal.
"""
from __future__ import annotations

import re

import pytest

from support.jobs import STEPS, losses, run, survivors, uninterrupted
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank


def _restarted(tmp_path, fault: str, env: dict | None = None) -> tuple[str, dict]:
    save_dir = str(tmp_path / "restarted")
    code, out, seconds = run(["--save-dir", save_dir], fault=fault, restarts=1, env=env)
    assert code == 0, out
    assert not survivors(save_dir), "a rank outlived the job"
    print(f"\n[{fault}] job with one restart: {seconds:.1f} s")
    return out, losses(out)


def _compare(tmp_path, out: str, got: dict) -> int:
    want = uninterrupted(str(tmp_path.parent))
    print(f"uninterrupted: {want}\nrestarted:     {got}")
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed, out
    assert got == want and len(want) == STEPS
    return int(resumed.group(1))


@pytest.mark.slow(reason="covered in every run by test_elastic.py::"
                  "test_a_restart_with_a_fresh_store_per_attempt (the same kill in forward, "
                  "restarted, the same losses) and test_elastic.py::"
                  "test_a_save_cut_off_leaves_the_last_complete_checkpoint (a kill restarted "
                  "through the launcher's shared store)")
def test_a_killed_rank_restarts_and_the_losses_go_on(tmp_path):
    out, got = _restarted(tmp_path, "kill:forward:5:1")
    assert _compare(tmp_path, out, got) in (2, 4)


def test_a_save_cut_off_leaves_the_last_complete_checkpoint(tmp_path):
    """Rank 1 dies while step 4's checkpoint is being written: no checkpoint of step 4
    looks complete, so the restarted job resumes from step 2's."""
    out, got = _restarted(tmp_path, "kill:save:4:1")
    assert _compare(tmp_path, out, got) == 2


def test_a_restart_with_a_fresh_store_per_attempt(tmp_path):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what docs/multinode.md asks of multi-node
    elastic jobs): the ranks host a fresh store each attempt, which zerofn train joins
    without an attempt prefix."""
    out, got = _restarted(tmp_path, "kill:forward:5:1", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert _compare(tmp_path, out, got) in (2, 4)


def _restart_counts_differ(rank, world):
    import os

    import torch

    from zerofn.train import restarted
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)   # node 0 restarted uncounted
    return restarted(torch.device("cpu"))


def test_every_rank_resumes_where_any_node_counted_a_restart():
    assert run_ranks(2, _restart_counts_differ) == [True, True]
