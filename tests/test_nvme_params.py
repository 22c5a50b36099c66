"""offload("nvme", params=True): ZeRO-3's parameter shards live in the swap file, are read
ahead of their gathers, and the run equals the same run without offload."""
from __future__ import annotations

import os

import pytest
import torch

import zerofn as zf
from support.compare import max_errors, state_errors
from support.errors import error_of
from support.loops import build_parity, train_reference, train_sharded
from support.memory import LAYERS, WIDTH, peak_rise_over, stack_trainer
from support.models import batches, make_models, make_optimizer
from support.offload import build_offloaded
from support import SLOW, slow_variant
from support.ranks import run_ranks
from support.shared_runs import shared

pytestmark = pytest.mark.multirank

CONFIGS = [({}, None, False), ({"units_in_flight": 1}, None, False), ({}, None, True),
           ({}, torch.bfloat16, False)]


def count_read_ahead(model) -> dict:
    """Wrap the gatherer's NVMe reader: how many shards were already read (or being read)
    when their gather asked for them."""
    reader = model._zerofn.gatherer.reader
    counts = {"hit": 0, "miss": 0}
    take = reader.take

    def counted(unit, *rest):
        counts["hit" if unit in reader.held else "miss"] += 1
        return take(unit, *rest)
    reader.take = counted
    return counts


def parity_runs(rank, world, path):
    out = []
    data = batches(5, 1, world)
    refs, plains = {}, {}   # trained once per checkpointing, and per (precision, checkpointing)
    for opts, precision, checkpoint in CONFIGS:
        if (precision, checkpoint) not in plains:
            # bf16 compares with CPU offload, which steps with the same C++ Adam: that kernel
            # agrees with torch's AdamW to an ulp per step (docs/cpu_adam.md), and one ulp of
            # a master can round its bf16 copy the other way, which backward then amplifies.
            plain, plain_opt = build_offloaded(
                3, offload=None if precision is None else {"params": True},
                precision=precision, checkpoint=checkpoint)
            train_sharded(plain, plain_opt, data, rank, world)
            plains[precision, checkpoint] = zf.get_state_dict(plain, plain_opt, full=True)
        off, off_opt = build_offloaded(3, offload=dict(opts, nvme=True, path=path, params=True),
                                       precision=precision, checkpoint=checkpoint)
        counts = count_read_ahead(off)
        train_sharded(off, off_opt, data, rank, world)
        vs_plain = max(state_errors(plains[precision, checkpoint],
                                    zf.get_state_dict(off, off_opt, full=True)))
        vs_torch = None     # bf16 is held to CPU offload only
        if precision is None:
            if checkpoint not in refs:
                ref, _ = make_models(checkpoint=checkpoint)
                refs[checkpoint] = ref, make_optimizer("adamw", ref.parameters())
                train_reference(*refs[checkpoint], data)
            vs_torch = max(max_errors(*refs[checkpoint], off, off_opt))
        out.append((vs_plain, vs_torch, counts))
    return out


def nvme_runs(rank, world, path, names):
    runs = {"parity": parity_runs, "state dicts": nvme_params_state_dicts,
            "bf16 model": bf16_model_runs}
    return {name: runs[name](rank, world, path) for name in names}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(world)``: each run's results at ``world`` (a list over the ranks) from one
    launch a world, made when a test first asks for it, and the swap directory they shared,
    listed once its ranks have exited."""
    @shared
    def launched(world):
        names = ["parity"] * (world > 1 or SLOW) + ["bf16 model"] + ["state dicts"] * (world > 1)
        path = tmp_path_factory.mktemp(f"nvme{world}")
        per_rank = run_ranks(world, nvme_runs, str(path), names, timeout=500)
        return {name: [r[name] for r in per_rank] for name in names}, os.listdir(path)
    return launched


# World 1 streams parameter shards from the file in every run too: the staging-ring test
# and the bf16 model's [1] below.
@pytest.mark.parametrize("world", [slow_variant(1, covered_by=(
    "[2], test_nvme_params_keep_host_memory_at_the_staging_ring and "
    "test_a_bf16_model_keeps_its_state_in_bf16_in_the_file_and_steps_as_pytorch[1]")), 2])
def test_nvme_params_match_the_run_without_offload_and_pytorch(world, trained):
    """fp32 (units_in_flight 2 and 1, activation checkpointing) against the run without
    offload, and bf16 against CPU offload; 5 AdamW steps."""
    results, left = trained(world)
    for rank_out in results["parity"]:
        for config, (vs_plain, vs_torch, counts) in zip(CONFIGS, rank_out):
            assert vs_plain < 1e-6, (config, vs_plain)
            assert vs_torch is None or vs_torch < 1e-5, (config, vs_torch)
            # Only the first forward (no order known yet) reads its shards on demand; one
            # buffer is lent to each gather, so with units_in_flight=1 some reads wait.
            if config[0].get("units_in_flight") == 1:
                assert counts["hit"] >= 2 * 4, (config, counts)
            else:
                assert counts["miss"] <= 3 and counts["hit"] >= 5 * 6 - 3, (config, counts)
    assert left == [], "swap files outlived their processes"


def train_many_units(rank, world, path):
    model, step = stack_trainer(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                zf.offload("nvme", path=path, params=True, units_in_flight=2))
    peak_rise = peak_rise_over(step, 2)
    swap = os.path.getsize(model._zerofn.homes.file.name)
    mem = zf.model_state_bytes(model)
    print(f"nvme params: model_state_bytes {mem}, swap file {swap} B, peak RSS rise over "
          f"2 steps {peak_rise} B")
    return mem, peak_rise, swap


def test_nvme_params_keep_host_memory_at_the_staging_ring(tmp_path):
    """10 units of 9.4M params: the shards (377 MB) are in the file; host memory for them is
    two units' worth of staging, by accounting and by the process's peak memory."""
    mem, peak_rise, swap = run_ranks(1, train_many_units, str(tmp_path), timeout=300)[0]
    unit = (WIDTH * WIDTH + WIDTH) * 4              # one layer's fp32 compute shard
    assert mem["nvme"]["params"] >= LAYERS * unit, mem
    assert swap >= mem["nvme"]["params"] + mem["nvme"]["optimizer"], (swap, mem)
    # the staging ring's share for parameters, plus the 4-byte stand-in the DTensors view
    assert 2 * unit <= mem["host"]["params"] <= 2 * unit + 2 * 4096 + 4, mem
    assert mem["cpu"]["params"] == 0 and mem["cpu"]["optimizer"] == 0, mem
    # Two steps streamed 1.5 GB of params and state; the process grew by far less.
    assert peak_rise < 0.25 * (mem["nvme"]["params"] + mem["nvme"]["optimizer"]), peak_rise


def nvme_params_state_dicts(rank, world, path):
    """nvme params -> plain ZeRO-3 and plain ZeRO-3 -> nvme params; both keep training alike."""
    src, src_opt = build_offloaded(3, offload={"nvme": True, "path": path, "params": True})
    train_sharded(src, src_opt, batches(3, 1, world), rank, world)
    msd, osd = zf.get_state_dict(src, src_opt)
    plain, plain_opt = build_offloaded(3)
    zf.set_state_dict(plain, plain_opt, msd, osd)
    loaded = max(state_errors(zf.get_state_dict(src, src_opt, full=True),
                              zf.get_state_dict(plain, plain_opt, full=True)))
    back, back_opt = build_offloaded(3, offload={"nvme": True, "path": path, "params": True})
    zf.set_state_dict(back, back_opt, *zf.get_state_dict(plain, plain_opt))
    data = batches(2, 1, world, seed=9)
    for model, opt in ((src, src_opt), (plain, plain_opt), (back, back_opt)):
        train_sharded(model, opt, data, rank, world)
    want = zf.get_state_dict(plain, plain_opt, full=True)
    return loaded, [max(state_errors(want, zf.get_state_dict(m, o, full=True)))
                    for m, o in ((src, src_opt), (back, back_opt))]


def test_nvme_params_state_dict_round_trip(trained):
    for loaded, errors in trained(2)[0]["state dicts"]:
        assert loaded == 0.0, loaded
        assert max(errors) < 1e-6, errors


def nvme_params_below_zero3(rank, world, path, stage):
    return error_of(build_parity, stage, "adamw", zf.offload("nvme", path=path, params=True))


@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_params_need_zero3_on_every_rank(stage, tmp_path):
    for msg in run_ranks(2, nvme_params_below_zero3, str(tmp_path), stage, timeout=60):
        assert msg is not None and "only ZeRO-3" in msg, msg
    assert os.listdir(tmp_path) == []


def bf16_model_runs(rank, world, path):
    """A bf16 model (no mixed precision) under NVMe offload, with and without its parameter
    shards in the file, against plain PyTorch's AdamW on the same bf16 model."""
    out = []
    data = batches(3, 1, world)
    ref = ref_opt = None    # trained once, for both runs
    for params in (False, True):
        fresh, model = (m.bfloat16() for m in make_models())
        if ref is None:
            ref, ref_opt = fresh, make_optimizer("adamw", fresh.parameters())
            train_reference(ref, ref_opt, data)
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                zf.offload("nvme", path=path, params=params))(model, opt)
        train_sharded(model, opt, data, rank, world)
        out.append(max(max_errors(ref, ref_opt, model, opt)))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_bf16_model_keeps_its_state_in_bf16_in_the_file_and_steps_as_pytorch(world, trained):
    """Full precision for a bf16 model is bf16, as torch.optim keeps it: the file holds its
    masters and moments in bf16 and the optimizer sees them so (fp32 bytes once showed
    through bf16 tensors: weights of 3e38)."""
    for errors in trained(world)[0]["bf16 model"]:
        # the same arithmetic at world 1; at 2 the bf16 reduction rounds its sums (< 2**-7,
        # a bf16 ulp at 1)
        assert max(errors) == 0 if world == 1 else max(errors) < 2e-2, errors
