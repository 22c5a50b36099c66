"""A save reads offloaded state a unit at a time (io/checkpoint/streamed.py): what it
writes equals, tensor by tensor and dtype by dtype, what a save of the whole state read
up front writes (the way every save went before), under NVMe offload (ZeRO-1/3,
parameters in the file too) and low-precision host state, at worlds 1 and 2; the save
leaves the state unread; hooks that derive tensors from the state fall back to reading
it whole; and the checkpoint loads back exactly."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zerofn as zf
from support.hooked import hooked_batches, hooked_model, train as train_hooked
from support.loops import build_parity, train_sharded
from support.memory import reset_peak, stack_trainer, status_bytes
from support.models import batches
from support.ranks import run_ranks
from zerofn.io.checkpoint import streamed
from zerofn.io.checkpoint.checksums import ChecksumWriter
from zerofn.io.checkpoint.layout import step_name
from zerofn.io.checkpoint.narrow import narrowed
from zerofn.runtime.runtime import runtime_of


def offloads(case: str, swap: str) -> list:
    os.makedirs(swap, exist_ok=True)
    if case == "nvme":
        return [zf.offload("nvme", path=swap)]
    if case == "nvme-params":
        return [zf.offload("nvme", path=swap, params=True)]
    if case == "int8-bf16":
        return [zf.offload("cpu", state_dtype=torch.int8, master_dtype=torch.bfloat16),
                zf.mixed_precision(torch.bfloat16)]
    if case == "cpu":
        return [zf.offload("cpu")]
    if case == "nvme-bf16":
        return [zf.offload("nvme", path=swap, state_dtype=torch.bfloat16)]
    raise ValueError(case)


def save_both(model, opt, root: str) -> bool:
    """Save through ``save_checkpoint`` and the way saves went before (every unit read
    into memory first); return whether the first left every unit unread."""
    zf.save_checkpoint(os.path.join(root, "streamed"), model, opt, step=2)
    rt = runtime_of(model)
    unread = all(rt.unread(u) for u in rt.units if u.slots)
    msd, osd = zf.get_state_dict(model, opt)
    narrowed(rt, msd, osd)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=ChecksumWriter(os.path.join(root, "whole")))
    return unread


def saved_alike(root: str, first: str = "streamed", second: str = "whole") -> list[str]:
    """What differs between two checkpoints under ``root``, tensor by tensor (extras
    aside); ``save_checkpoint``'s are named by their root."""
    tables = []
    for name in (first, second):
        ckpt = os.path.join(root, name)
        if not os.path.exists(os.path.join(ckpt, ".metadata")):
            ckpt = os.path.join(ckpt, step_name(2))
        dcp_to_torch_save(ckpt, os.path.join(root, name + ".pt"))
        tables.append({k: v for k, v in _flat(torch.load(os.path.join(root, name + ".pt"),
                                                         weights_only=False)).items()
                       if not k.startswith("extra")})
    streamed, whole = tables
    diffs = [k for k in streamed.keys() ^ whole.keys()]
    for k, v in whole.items():
        w = streamed.get(k)
        if torch.is_tensor(v) and not (torch.is_tensor(w) and w.dtype == v.dtype
                                       and torch.equal(w, v)):
            diffs.append(k)
        elif not torch.is_tensor(v) and w != v:
            diffs.append(k)
    return diffs


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def streamed_save(rank, world, root, case, stage):
    model, opt = build_parity(stage, "adamw", *offloads(case, os.path.join(root, "swap")))
    train_sharded(model, opt, batches(2, 1, world), rank, world)
    unread = save_both(model, opt, root)
    dist.barrier()
    diffs = saved_alike(root) if rank == 0 else []
    # and it loads back: a fresh model takes exactly the state saved
    fresh, fresh_opt = build_parity(stage, "adamw",
                                    *offloads(case, os.path.join(root, "swap2")))
    zf.load_checkpoint(os.path.join(root, "streamed"), fresh, fresh_opt)
    a, b = zf.get_state_dict(model, opt, full=True), zf.get_state_dict(fresh, fresh_opt,
                                                                         full=True)
    loaded = all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(
        torch.equal(v, b[1]["state"][n][k]) for n, st in a[1]["state"].items()
        for k, v in st.items() if torch.is_tensor(v))
    return unread, diffs, loaded


@pytest.mark.parametrize("case,stage,world", [("nvme", 3, 2), ("nvme-params", 3, 1),
                                              ("nvme", 1, 2), ("int8-bf16", 3, 2),
                                              ("nvme-bf16", 2, 1)])
def test_streamed_save_writes_what_a_whole_read_writes(tmp_path, case, stage, world):
    results = run_ranks(world, streamed_save, str(tmp_path), case, stage)
    assert [r[0] for r in results] == [True] * world        # nothing read up front
    assert results[0][1] == []                              # every tensor identical
    assert [r[2] for r in results] == [True] * world        # and it loads back exactly


def hooked_save(rank, world, root):
    model, opt = hooked_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zf.compose(zf.shard_params(),
                            *offloads("nvme", os.path.join(root, "swap")))(model, opt)
    train_hooked(model, opt, hooked_batches(2, world), rank, world)
    save_both(model, opt, root)
    dist.barrier()
    return saved_alike(root) if rank == 0 else []


def test_hooks_that_split_the_state_save_it_read_whole(tmp_path):
    """A fused projection saved in pieces is made of views of the state: the save reads
    every unit first, and writes what the whole read writes."""
    assert run_ranks(2, hooked_save, str(tmp_path))[0] == []


def background_save(rank, world, root, case, stage):
    """Save in the background and step twice at once: the checkpoint holds the state at
    the call (its writer slowed, so without the wait the steps would change it first)."""
    model, opt = build_parity(stage, "adamw", *offloads(case, os.path.join(root, "swap")))
    data = batches(4, 1, world)
    train_sharded(model, opt, data[:2], rank, world)
    zf.save_checkpoint(os.path.join(root, "sync"), model, opt, step=2)
    slow = streamed.UnitReader.value

    def slowly(self, *args):
        time.sleep(0.05)
        return slow(self, *args)

    streamed.UnitReader.value = slowly
    zf.save_checkpoint(os.path.join(root, "background"), model, opt, step=2, async_save=True,
                       staging_bytes=1 << 20)
    train_sharded(model, opt, data[2:], rank, world)
    zf.wait_for_checkpoint()
    streamed.UnitReader.value = slow
    rt = runtime_of(model)
    unread = all(rt.unread(u) for u in rt.units if u.slots)
    dist.barrier()
    return unread, saved_alike(root, "background", "sync") if rank == 0 else []


@pytest.mark.parametrize("case,stage,world", [("nvme", 3, 2), ("int8-bf16", 2, 1),
                                              ("cpu", 3, 1)])
def test_background_save_holds_the_state_at_its_call(tmp_path, case, stage, world):
    results = run_ranks(world, background_save, str(tmp_path), case, stage)
    assert [r[0] for r in results] == [case != "cpu"] * world    # read as written
    assert results[0][1] == []


MODES = ("sync", "async")


def save_rises(rank, world, root):
    """{mode: the peak resident memory its save adds over what the process held before the
    first save}, each mode saving once in turn, and the state's bytes, for 1.13 GB of fp32
    master and Adam state in a swap file. (What the first save leaves resident counts
    against the second, so one process serves both without hiding anything.)"""
    swap = os.path.join(root, "swap")
    os.makedirs(swap)
    model, step = stack_trainer(zf.shard_grads(), zf.offload("nvme", path=swap))
    state = zf.model_state_bytes(model)["nvme"]["optimizer"]
    opt = runtime_of(model).optimizer
    before, rises = status_bytes("VmRSS"), {}
    for mode in MODES:
        reset_peak()
        zf.save_checkpoint(os.path.join(root, mode), model, opt, step=1,
                           async_save=mode == "async", staging_bytes=64 << 20)
        zf.wait_for_checkpoint()
        rises[mode] = status_bytes("VmHWM") - before
        shutil.rmtree(os.path.join(root, mode))     # the disk it took, not needed again
    return rises, state


@pytest.fixture(scope="module")
def rises(tmp_path_factory):
    return run_ranks(1, save_rises, str(tmp_path_factory.mktemp("rises")), timeout=300)[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_save_holds_a_unit_and_a_file_not_the_state(rises, mode):
    """The save reads one 113 MB unit at a time and holds 32 MiB files' copies: its peak
    stays far below the state's 1.13 GB (before, it read all of it, and a background save
    copied it once more)."""
    rise, state = rises[0][mode], rises[1]
    assert state >= 1e9, state
    assert rise < 0.3 * state, (rise, state)
