"""Background saves copy before write, per unit (io/checkpoint/unit_copies.py): a save
with ``async_save=True`` returns at once, training steps right after it, and the
checkpoint holds the state at the call bit for bit (equal, tensor by tensor, to a
synchronous save at the call), at ZeRO-1, ZeRO-3, ZeRO-3 + offload("cpu") and ZeRO-3 +
offload("nvme"), worlds 1 and 2; the copies the save holds never exceed what
``staging_bytes`` leaves for copies aside plus the writer's one item at a time; and the
steps that waited for the writer are counted, in the runtime, TensorBoard, the CSV series
and zerofn train's progress line."""
from __future__ import annotations

import contextlib
import io
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zerofn as zf
from support.compare import full_state, max_error
from support.held_saves import HeldUntilAStep
from support.loops import build_parity, train_sharded
from support.models import batches
from support.ranks import run_ranks
from support.tensorboard_runs import read, scalars
from support.shared_runs import shared
from zerofn.io.checkpoint import streamed
from zerofn.io.checkpoint.layout import step_name
from zerofn.runtime.runtime import runtime_of
from zerofn.train.progress import Progress

def offload(case: str, root: str) -> list:
    if case == "nvme":
        os.makedirs(os.path.join(root, "swap"), exist_ok=True)
        return [zf.offload("nvme", path=os.path.join(root, "swap"))]
    if case == "cpu-overlap":
        return [zf.offload("cpu", overlap_step=True)]
    return [zf.offload("cpu")] if case == "cpu" else []


def tables(root: str, names) -> list[dict]:
    """Each checkpoint's tensors, by flattened key (the extras aside)."""
    out = []
    for name in names:
        ckpt = os.path.join(root, name, step_name(2))
        dcp_to_torch_save(ckpt, os.path.join(root, name + ".pt"))
        state = torch.load(os.path.join(root, name + ".pt"), weights_only=False)
        out.append(dict(_flat({k: v for k, v in state.items() if k != "extra"})))
    return out


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], obj


def differing(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (dtype, shape or any bit), or that one lacks."""
    out = sorted(a.keys() ^ b.keys())
    for k, v in a.items():
        w = b.get(k)
        same = (torch.is_tensor(w) and v.dtype == w.dtype and torch.equal(v, w)) \
            if torch.is_tensor(v) else v == w
        if k in b and not same:
            out.append(k)
    return out


def save_then_step(rank, world, root, stage, case, staging, monitor=False):
    """Train 2 steps, save synchronously, save in the background and step 4 times at
    once; the checkpoints compared, and what the background save held and cost.
    ``staging``: bytes, or "bounded": room for copies of 1.1 times the rank's largest
    unit (its masters and moments; under NVMe beside the unit read from the file), so
    some units are copied and the first step waits for the others."""
    transforms = offload(case, root)
    if monitor:
        transforms.append(zf.tensorboard(os.path.join(root, "tb"), every=1, csv=True))
    model, opt = build_parity(stage, "adamw", *transforms)
    rt = runtime_of(model)
    if staging == "bounded":
        unit = 12 * max(u.shard_numel for u in rt.units)
        staging = 2 * (int(1.1 * unit) + unit * (case == "nvme"))
    data = batches(6, 1, world)
    train_sharded(model, opt, data[:2], rank, world)
    zf.save_checkpoint(os.path.join(root, "sync"), model, opt, step=2)
    unread = all(rt.unread(u) for u in rt.units if u.slots)
    streamed.UnitCopies, plain = HeldUntilAStep, streamed.UnitCopies
    try:
        zf.save_checkpoint(os.path.join(root, "background"), model, opt, step=2,
                           async_save=True, staging_bytes=staging)
        train_sharded(model, opt, data[2:], rank, world)    # the state changes at once
        zf.wait_for_checkpoint()
    finally:
        streamed.UnitCopies = plain
    copies = HeldUntilAStep.made[-1]
    fresh, fresh_opt = build_parity(stage, "adamw", *offload(case, root + "-fresh"))
    zf.load_checkpoint(os.path.join(root, "sync"), fresh, fresh_opt)
    changed = max_error(full_state(model, opt), full_state(fresh, fresh_opt))
    dist.barrier()
    diffs = differing(*tables(root, ["background", "sync"])) if rank == 0 else []
    largest = 4 * max(s.local_numel for u in rt.units for s in u.slots)    # (fp32)
    return dict(unread=unread, changed=changed, diffs=diffs, staging=staging,
                aside=staging - staging // 2, largest=largest, peak=copies.peak, copied=len(copies.copied),
                units=sum(bool(u.slots) for u in rt.units), waits=rt.checkpoint_waits()[0],
                early=rt.stepper.early.stepped if rt.stepper.early is not None else 0)


HOLDS = [(1, "none"), (3, "none"), (3, "cpu"), (3, "nvme")]
# save_then_step's (stage, case, staging, monitor) at each world: every test's, so that one
# launch a world serves them all
CASES = {1: [(stage, case, "bounded", False) for stage, case in HOLDS] + [
             (3, "cpu-overlap", "bounded", False), (3, "nvme", 64 << 20, False),
             (3, "cpu", "bounded", True)],
         2: [(stage, case, "bounded", False) for stage, case in HOLDS] + [(3, "cpu", 2, False)]}


def saves_then_steps(rank, world, root, cases):
    return [save_then_step(rank, world, os.path.join(root, str(i)), *case)
            for i, case in enumerate(cases)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(world, *case)``: that case's results (a list over the ranks) and its
    directory, from one launch a world, made when a test first asks for it."""
    @shared
    def at(world):
        root = str(tmp_path_factory.mktemp(f"world{world}"))
        per_rank = run_ranks(world, saves_then_steps, root, CASES[world], timeout=400)
        return {case: ([r[i] for r in per_rank], os.path.join(root, str(i)))
                for i, case in enumerate(CASES[world])}
    return lambda world, *case: at(world)[case]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage,case", HOLDS)
def test_background_save_holds_the_state_at_its_call(saved, stage, case, world):
    results, _ = saved(world, stage, case, "bounded", False)
    assert results[0]["diffs"] == []              # bit for bit the synchronous save's
    for r in results:
        assert r["changed"] > 0                   # the steps changed what it was writing
        assert r["unread"] == (case == "nvme")    # (NVMe's units read from the file)
        assert r["copied"] >= 1                   # some units copied before a change
        assert r["waits"] == 1                    # and the first step waited for the rest
        # within what staging_bytes leaves for copies aside, and the writer's one item
        # (checksums.py's [Note: one item at a time]; before, a whole data file)
        assert r["peak"] <= r["aside"] + r["largest"], r


def test_units_stepped_during_backward_copy_before_write_too(saved):
    """offload(overlap_step=True) steps each unit as its gradients land, in backward: each
    asks for its own unit, and the checkpoint still holds the state at the call."""
    r = saved(1, 3, "cpu-overlap", "bounded", False)[0][0]
    assert r["diffs"] == [] and r["changed"] > 0
    assert r["early"] > 0                           # (units did step in backward)
    assert r["copied"] >= 1 and r["waits"] >= 1 and r["peak"] <= r["aside"] + r["largest"]


def test_a_large_budget_copies_every_unit_and_never_waits(saved):
    r = saved(1, 3, "nvme", 64 << 20, False)[0][0]
    assert r["diffs"] == [] and r["changed"] > 0
    assert (r["copied"], r["waits"]) == (r["units"], 0)


def test_no_budget_waits_for_every_unit(saved):
    """staging_bytes=2 leaves no room for copies: the first step waits until the writer
    has written all it changes."""
    r = saved(2, 3, "cpu", 2, False)[0][0]
    assert r["diffs"] == [] and r["changed"] > 0
    assert (r["copied"], r["waits"]) == (0, 1)


def test_the_wait_shows_in_tensorboard_and_csv(saved):
    (r,), root = saved(1, 3, "cpu", "bounded", True)
    assert r["waits"] == 1
    acc = read(os.path.join(root, "tb"))
    waits = scalars(acc, "checkpoint/waits")
    assert (waits[2], waits[3], waits[6]) == (0, 1, 1)   # the first step after the call
    wait_ms = scalars(acc, "time/checkpoint_wait")
    assert wait_ms[2] == 0 and wait_ms[3] > 0
    with open(os.path.join(root, "tb", "checkpoint_waits.csv")) as f:
        assert [float(v) for v in f.read().splitlines()[-1].split(",")] == [6, 1]


def progress_lines(rank, world):
    """zerofn train's progress lines around a step that waited 830 ms for a save."""
    job = SimpleNamespace(batch=2, cfg=SimpleNamespace(context=8), offload_ratio=1.0,
                          log_every=1, precision="fp32")
    progress = Progress(SimpleNamespace(steps=3), job, 0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step, waits in enumerate([(0, 0.0), (1, 0.83), (1, 0.83)]):
            progress.show(step, 1.0, 1e-3, 0.5, 1 << 30, waits=waits)
    return out.getvalue().splitlines()


def test_the_wait_shows_in_zerofn_trains_progress_line():
    lines = run_ranks(1, progress_lines)[0]
    assert ["checkpoint wait" in line for line in lines] == [False, True, False]
    assert lines[1].endswith("checkpoint wait 830 ms (1 step)")
