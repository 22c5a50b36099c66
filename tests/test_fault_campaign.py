"""Faults, counted (tools/fault_campaign.py; docs/checkpoints.md, "Faults, counted"): the
campaign's short version, a few trials of each fault at instants drawn from a fixed seed,
and what it found."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zerofn as zf
from support.errors import error_of
from support.loops import build_parity
from support.models import batches
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank

TOOL = Path(__file__).resolve().parent.parent / "tools" / "fault_campaign.py"


def test_the_short_campaign_catches_or_survives_every_fault():
    """One trial of each row (the full campaign: docs/checkpoints.md has its command and
    figures; ZEROFN_SLOW=1 runs ten of each here): each prints its replay line, and the
    table counts every trial caught or survived, nothing lost."""
    trials = "10" if os.environ.get("ZEROFN_SLOW") == "1" else "1"
    out = subprocess.run([sys.executable, str(TOOL), "all", "--trials", trials, "--seed", "3"],
                         capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "|---" not in line]
    assert len(rows) == 7, out.stdout          # the header and six faults
    for row in rows[1:]:
        name, count, ok, lost, _ = (c.strip() for c in row.strip("|").split("|"))
        ran = int(count.split()[0])
        assert ok == str(ran) and lost == "0", row
    assert out.stdout.count("replay: python tools/fault_campaign.py") == 6 * int(trials)


def full_drive_saves(rank, world, root):
    return [full_drive_save(rank, world, os.path.join(root, str(a)), a) for a in (False, True)]


def full_drive_save(rank, world, root, async_save):
    """One checkpoint saved; the next one's writes fail with ENOSPC (a full drive); then
    space is back and the run saves again."""
    import zerofn.io.checkpoint.checksums as checksums
    model, opt = build_parity(2, "adamw")
    (x, y), = batches(1, 1, world)[0]
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    opt.step()
    zf.save_checkpoint(root, model, opt, step=1)
    real = checksums.ChecksumWriter.write_data

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def save():
        zf.save_checkpoint(root, model, opt, step=2, async_save=async_save)
        zf.wait_for_checkpoint()
    checksums.ChecksumWriter.write_data = full
    try:
        raised = error_of(save, error=Exception)    # (a BaseException would escape this)
    finally:
        checksums.ChecksumWriter.write_data = real
    still = zf.load_checkpoint(root, *build_parity(2, "adamw"))["step"]
    save()
    return raised, still, zf.load_checkpoint(root, *build_parity(2, "adamw"))["step"]


def test_a_full_drive_during_a_save_is_an_oserror_on_every_rank(tmp_path):
    """DCP's CheckpointException derives from BaseException, so a loop's `except Exception`
    missed a full drive during a save (the campaign's full-disk row found it): now every
    rank raises an OSError with ENOSPC's errno naming the unpublished directory, the
    previous checkpoint still loads, and the run saves again once there is room."""
    for raised, still, after in sum(run_ranks(2, full_drive_saves, str(tmp_path)), []):
        assert raised and "[Errno 28]" in raised and ".tmp-step-00000002" in raised \
            and "newest complete checkpoint stands" in raised, raised
        assert (still, after) == (1, 2)
