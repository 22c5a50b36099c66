"""offload(..., ratio=r): a share of the units keeps its optimizer state on the device.
Every stage with host and NVMe offload, parameter offload too, against the run without
offload; which units stay; host memory falling with the ratio; checkpoints that move
between ratios and world sizes."""
from __future__ import annotations


import pytest
import torch

import zerofn as zf
from support.compare import max_errors, state_errors
from support.errors import expect_error
from support.loops import train_reference, train_sharded
from support.models import batches, make_models, make_optimizer
from support.offload import build_offloaded
from support.ranks import run_ranks
from support.shared_runs import shared
from zerofn.core.units import build_units
from zerofn.runtime.homes.assignment import staying_units
from zerofn.runtime.runtime import runtime_of

CONFIGS = [(1, "adamw", {}), (2, "adamw", {}), (3, "adamw", {}), (3, "adamw", {"params": True}),
           (2, "sgd", {}), (3, "adam", {"params": True}), (2, "adamw", {"nvme": True}),
           (3, "adamw", {"nvme": True, "params": True})]


RATIOS = [1.0, 0.5, 0.0]


def ratio_runs(rank, world, path):
    """{ratio: each config's distance} for each ratio of RATIOS, accumulating 2
    micro-batches and clipping, against plain single-process PyTorch on the same global
    batches (trained once a config: the reference has no ratio)."""
    data = batches(4, 2, world)
    out = {ratio: [] for ratio in RATIOS}
    for stage, kind, opts in CONFIGS:
        ref, _ = make_models()
        ref_opt = make_optimizer(kind, ref.parameters())
        train_reference(ref, ref_opt, data, clip=0.05)
        for ratio in RATIOS:
            split = build_offloaded(stage, kind, dict(opts, path=path, ratio=ratio))
            train_sharded(*split, data, rank, world, clip=0.05)
            out[ratio].append(max(max_errors(ref, ref_opt, *split)))
    return out


@pytest.fixture(scope="module")
def shares(tmp_path_factory):
    """shares(world): every rank's ratio_runs, one launch a world however many tests ask."""
    return shared(lambda world: run_ranks(
        world, ratio_runs, str(tmp_path_factory.mktemp(f"ratios{world}")), timeout=400))


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("ratio", RATIOS)
def test_every_share_on_the_device_matches_plain_pytorch(ratio, world, shares):
    """(The device's share steps in torch's arithmetic, the host's in the C++ kernel.)"""
    for errors in shares(world):
        for config, err in zip(CONFIGS, errors[ratio]):
            assert err < 1e-5, (config, err)


def test_the_units_first_in_parameter_order_stay_up_to_the_share():
    _, model = make_models()
    units = build_units(model, None, 1, 0)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    sizes = {u.name: sum(s.numel for s in u.slots) for u in units if u.slots}
    total = sum(sizes.values())
    first = sorted((u for u in units if u.slots),
                   key=lambda u: min(order[s.fqn] for s in u.slots))
    assert "tok.weight" in {s.fqn for s in first[0].slots}     # the embeddings come first
    for ratio in (1.0, 0.8, 0.5, 0.2, 0.0):
        device = staying_units(units, ratio, order)
        host = [u for u in units if u not in device]
        assert device == first[:len(device)]                 # a prefix in parameter order
        kept = sum(sizes[u.name] for u in device)
        assert kept <= (1 - ratio) * total                   # at most the share
        if len(device) < len(first):                         # and the next would not fit
            assert kept + sizes[first[len(device)].name] > (1 - ratio) * total
        assert set(host) | set(device) == set(units) and not set(host) & set(device)


def host_bytes(rank, world, path, nvme):
    """For each ratio of RATIOS, the optimizer state's bytes by where they are placed."""
    seen = []
    for ratio in RATIOS:
        model, opt = build_offloaded(2, "adamw", dict(path=path, ratio=ratio, nvme=nvme))
        train_sharded(model, opt, batches(1, 1, world), rank, world)
        placed = zf.model_state_bytes(model)
        seen.append({where: roles["optimizer"] for where, roles in placed.items()})
    return seen


@pytest.mark.multirank
@pytest.mark.parametrize("nvme", [False, True])
def test_host_memory_falls_with_the_ratio(nvme, tmp_path):
    """The host's arenas (or the swap file) hold only the host's share; the device holds
    the rest, and the total stays."""
    seen = run_ranks(2, host_bytes, str(tmp_path), nvme)[0]      # at ratios 1, 0.5, 0
    off = "nvme" if nvme else "host"
    assert seen[0][off] > seen[1][off] > seen[2].get(off, 0)
    assert seen[0].get("cpu", 0) < seen[1]["cpu"] < seen[2]["cpu"]      # the CPU device


def loads_between_ratios(rank, world, path, ratios):
    """checkpoint_between_ratios loading at each of ``ratios`` in turn, in one launch."""
    return [checkpoint_between_ratios(rank, world, path, ratio, "load") for ratio in ratios]


def checkpoint_between_ratios(rank, world, path, ratio, how):
    data = batches(4, 1, 2)
    model, opt = build_offloaded(3, "adamw", {"ratio": ratio, "params": True})
    if how == "save":
        train_sharded(model, opt, data[:2], rank, world)
        zf.save_checkpoint(path, model, opt, step=2)
    else:
        zf.load_checkpoint(path, model, opt)
    train_sharded(model, opt, data[2:], rank, world)
    return zf.get_state_dict(model, opt, full=True)


@pytest.mark.multirank
def test_a_checkpoint_saved_at_one_ratio_loads_at_another_and_another_world(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, checkpoint_between_ratios, path, 0.3, "save")[0]
    for world, ratios in ((2, [1.0]), (1, [0.0, 0.7])):
        for ratio, loaded in zip(ratios, run_ranks(world, loads_between_ratios, path,
                                                   ratios)[0]):
            assert max(state_errors(saved, loaded)) < 1e-5, (world, ratio)


def test_the_ratio_is_checked_where_it_is_given():
    for bad in (-0.1, 1.5, "half", True):
        expect_error(["ratio", "from 0 (none) to 1"], zf.offload, "cpu", ratio=bad)


def auto_runs(rank, world, budget, state_dtype=torch.float32):
    """ratio="auto" with ``budget`` bytes: what moved after the first step, the host's
    optimizer bytes after it, and the distance from plain PyTorch over 4 steps."""
    data = batches(4, 1, world)
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    train_reference(ref, ref_opt, data)
    model, opt = build_offloaded(2, "adamw", {"ratio": "auto", "device_budget": budget,
                                              "state_dtype": state_dtype})
    train_sharded(model, opt, data, rank, world)
    rt = runtime_of(model)
    return (len(rt.units_on_device()), sum(bool(u.slots) for u in rt.units),
            zf.model_state_bytes(model).get("host", {}).get("optimizer", 0),
            max(max_errors(ref, ref_opt, model, opt)))


@pytest.mark.multirank
def test_auto_moves_what_the_budget_holds_after_the_first_step():
    """(On a CPU device the host is the device: the budget is in bytes, against the
    process's peak less what offload holds.)"""
    moved, units, host, err = run_ranks(2, auto_runs, 10**13)[0]
    assert moved == units and err < 1e-5
    assert host == 0              # the arenas went back, the step counters moved too
    moved, units, host, err = run_ranks(2, auto_runs, 1)[0]
    assert moved == 0 and host > 10_000 and err < 1e-5


@pytest.mark.multirank
def test_auto_moves_8_bit_state_decoded():
    """State in fewer bits moves too: decoded to fp32 for the device, where the user's
    optimizer keeps it (one step of 8-bit moments, then fp32: close to plain PyTorch)."""
    moved, units, host, err = run_ranks(2, auto_runs, 10**13, torch.int8)[0]
    assert moved == units and host == 0 and err < 1e-3, (moved, units, host, err)


def auto_refused(rank, world, options):
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    expect_error(["ratio='auto'"], lambda: zf.compose(
        zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
        zf.offload(**options))(model, opt))


@pytest.mark.parametrize("options", [
    dict(device="nvme", path="/tmp", ratio="auto", device_budget=10**9),
    dict(device="cpu", ratio="auto", device_budget=10**9, params=True),
    dict(device="cpu", ratio="auto", device_budget=0.5),     # a share: CUDA's free memory
    dict(device="cpu", ratio="auto"),
])
def test_what_auto_cannot_do_yet_is_refused(options):
    run_ranks(1, auto_refused, options)


def test_a_device_budget_needs_auto():
    expect_error(["device_budget", "ratio='auto'"], zf.offload, "cpu", ratio=0.5,
                 device_budget=10**9)
