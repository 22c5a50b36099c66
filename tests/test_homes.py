"""Every unit its home: one model's units on the device, on the host and in the swap file at
once (``offload(placement=...)``, ``ratio="auto"`` with ``host_budget``), against plain
PyTorch; checkpoints of such a run loading under another placement and in FSDP2; 8-bit
state on the offloaded units stepping exactly as it does with every unit offloaded."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from support.compare import TOL, assert_same_state, max_error, max_errors
from support.errors import error_of
from support.fsdp2 import fsdp2_full, fsdp2_parity
from support.loops import train_reference, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.runtime import runtime_of
from zerofn.runtime.homes.assignment import _matches

pytestmark = pytest.mark.multirank

# The parity model's units: blocks.0, blocks.1 and the root (embeddings, final norm, gain).
THREE = {"blocks.0": "device", "blocks.1": "nvme"}      # the root: the host


def mixed(stage, path, placement=THREE, **options):
    """The parity model and AdamW under ZeRO-``stage`` with ``placement``."""
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    offload = zf.offload("cpu", path=path, placement=placement, **options)
    return zf.compose(zero(stage), offload)(model, opt)


def homes_of(model) -> dict:
    rt = runtime_of(model)
    return {u.name: rt.home_of(u) for u in rt.units if u.slots}


def three_homes_runs(rank, world, path):
    """ZeRO-2 and ZeRO-3, units in three homes, accumulating 2 micro-batches and clipping,
    against plain single-process PyTorch on the same global batches."""
    data = batches(4, 2, world)
    out = {}
    for stage in (2, 3):
        ref, _ = make_models()
        ref_opt = make_optimizer("adamw", ref.parameters())
        train_reference(ref, ref_opt, data, clip=0.05)
        model, opt = mixed(stage, path)
        train_sharded(model, opt, data, rank, world, clip=0.05)
        out[stage] = (homes_of(model), max(max_errors(ref, ref_opt, model, opt)))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_units_in_three_homes_match_plain_pytorch(world, tmp_path):
    for by_stage in run_ranks(world, three_homes_runs, str(tmp_path), timeout=600):
        for stage, (homes, err) in by_stage.items():
            assert homes == {"blocks.0": "device", "blocks.1": "nvme", "<root>": "host"}
            assert err < TOL, (world, stage, err)


def checkpoint_of_three_homes(rank, world, path, how):
    """Save the three-home run, or load it with every unit on the host; then train on.
    Returns the state before and after, and where the checkpoint went."""
    later = batches(2, 1, 2, seed=2)      # the same global batches at any world size
    written = None
    if how == "save":
        model, opt = mixed(3, path)
        train_sharded(model, opt, batches(3, 1, world), rank, world)
        written = zf.save_checkpoint(f"{path}/ckpt", model, opt, step=3)
    else:
        model, opt = zf.compose(zero(3), zf.offload("cpu"))(*_plain())
        assert zf.load_checkpoint(f"{path}/ckpt", model, opt) == {"step": 3}
    saved = zf.get_state_dict(model, opt, full=True)
    train_sharded(model, opt, later, rank, world)
    return saved, zf.get_state_dict(model, opt, full=True), written


def _plain():
    _, model = make_models()
    return model, make_optimizer("adamw", model.parameters())


def fsdp2_reads_three_homes(rank, world, ckpt):
    fmodel, fopt = fsdp2_parity(init_device_mesh("cpu", (world,)), seed=7)
    msd, osd = get_state_dict(fmodel, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fmodel, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = fsdp2_full(fmodel, fopt)
    train_sharded(fmodel, fopt, batches(2, 1, 2, seed=2), rank, world)
    return saved, fsdp2_full(fmodel, fopt)


def saved_and_read_by_fsdp2(rank, world, path):
    """The three-home run saved, then its checkpoint read by FSDP2, in one launch."""
    saved, after, ckpt = checkpoint_of_three_homes(rank, world, path, "save")
    dist.barrier()      # (published)
    return saved, after, fsdp2_reads_three_homes(rank, world, ckpt)


def test_a_three_home_checkpoint_loads_with_every_unit_on_the_host_and_in_fsdp2(tmp_path):
    path = str(tmp_path)
    (saved, after, (theirs, fsdp2_after)), _ = run_ranks(2, saved_and_read_by_fsdp2, path)
    [(loaded, on_host, _)] = run_ranks(1, checkpoint_of_three_homes, path, "load")
    assert_same_state(saved, loaded)
    assert max_error(after, on_host) < TOL
    assert_same_state(saved, theirs)
    assert max_error(after, fsdp2_after) < TOL


def one_step(rank, world, path, placement):
    """One step from the same start, int8 moments on the offloaded units: the full
    parameters and Adam state."""
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    offload = zf.offload("cpu", path=path, placement=placement, state_dtype=torch.int8) \
        if placement is not None else zf.offload("cpu", state_dtype=torch.int8)
    model, opt = zf.compose(zero(2), offload)(model, opt)
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    return homes_of(model), zf.get_state_dict(model, opt, full=True)


def plain_step(rank, world):
    model, opt = zero(2)(*_plain())
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    return zf.get_state_dict(model, opt, full=True)


def three_steps(rank, world, path):
    """The step with units in three homes, with every unit on the host, and plain."""
    return (one_step(rank, world, path, THREE), one_step(rank, world, path, None)[1],
            plain_step(rank, world))


def test_int8_state_on_the_offloaded_units_steps_as_with_every_unit_offloaded(tmp_path):
    """One step from the same start: a host or NVMe unit's rows and moments equal those of
    the run with every unit's int8 state on the host, bit for bit (the same kernel over
    the same blocks and rounding streams); a device unit's equal plain fp32 AdamW's."""
    [((homes, (msd, osd)), (all_msd, all_osd), (plain_msd, plain_osd))] = \
        run_ranks(1, three_steps, str(tmp_path))
    for name in msd:
        unit = "<root>" if not name.startswith("blocks.") else ".".join(name.split(".")[:2])
        ref_m, ref_o = (plain_msd, plain_osd) if homes[unit] == "device" else (all_msd, all_osd)
        assert torch.equal(msd[name], ref_m[name]), name
        for key, value in osd["state"].get(name, {}).items():
            assert torch.equal(value, ref_o["state"][name][key]), (name, key)


def auto_with_a_host_budget(rank, world, path, budget):
    """ratio="auto" with NVMe past ``host_budget``: where the units lived at set-up and
    after the first step, what the log line and the reason said, the bytes in each home,
    and the distance from plain PyTorch."""
    import logging
    said = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())
    logging.getLogger("zerofn").addHandler(handler)
    logging.getLogger("zerofn").setLevel(logging.INFO)
    data = batches(4, 1, world)
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    train_reference(ref, ref_opt, data)
    model, opt = zf.compose(zero(2), zf.offload(
        "nvme", path=path, ratio="auto", host_budget=budget, device_budget=10**13,
        units_in_flight=1))(*_plain())
    at_set_up = homes_of(model)
    bytes_at_set_up = zf.model_state_bytes(model)
    train_sharded(model, opt, data, rank, world)
    return (at_set_up, homes_of(model), said, runtime_of(model).placement_reason(),
            bytes_at_set_up, max(max_errors(ref, ref_opt, model, opt)))


def host_budget_for_the_root() -> int:
    """A host budget that holds the parity model's root unit (first in parameter order: the
    embeddings) and no block, at one rank: the landing buffers of every unit, the swap
    file's staging ring (one block: with two, this model's two blocks would fit in what the
    ring takes), and the root's state (offload's HostCosts)."""
    from zerofn.core.plan import OffloadPolicy
    from zerofn.core.units import build_units, set_dtypes
    from zerofn.runtime.homes import HostCosts
    model, opt = _plain()
    units = [u for u in build_units(model, None, 1, 0) if u.slots]
    set_dtypes(units, None, mixed=False)
    costs = HostCosts(OffloadPolicy(device="nvme", units_in_flight=1), opt)
    return sum(costs.landing(u) for u in units) + costs.staging(units) + \
        costs.on_host(units[-1]) + 1024      # (+ the step counters, a few bytes each)


def test_auto_fills_the_device_then_the_host_budget_then_nvme(tmp_path):
    budget = host_budget_for_the_root()
    [(at_set_up, after, said, reason, held, err)] = run_ranks(
        1, auto_with_a_host_budget, str(tmp_path), budget)
    # Set-up: the host takes the root (first in parameter order: the embeddings) within the
    # budget, the blocks go to the swap file.
    assert at_set_up == {"<root>": "host", "blocks.0": "nvme", "blocks.1": "nvme"}, at_set_up
    assert sum(held["host"].values()) <= budget and held["nvme"]["optimizer"] > 0, held
    assert "cpu" not in held or held["cpu"]["optimizer"] == 0
    assert "1 on the host, 2 in nvme" in said[0], said
    # After the first step the device takes the host's units (its budget is ample).
    assert after == {"<root>": "device", "blocks.0": "nvme", "blocks.1": "nvme"}, after
    assert "1 of 1 units moved" in reason, reason
    assert err < TOL


def refused_budget(rank, world, path):
    return error_of(lambda: zf.compose(zero(2), zf.offload(
        "nvme", path=path, ratio="auto", host_budget=1000, device_budget=10**9))(*_plain()))


# (placement, what its refusal says)
REFUSED = [({"blocks.0": "gpu"}, "must be one of"), ({"blocks.9": "device"}, "names no unit"),
           ({"blocks.1": "nvme"}, "give path="), ("blocks.0", "takes a dict")]


def refusals(rank, world, path):
    """The budget's refusal, then each of REFUSED's placements': every one is refused on
    both ranks before any collective, or the ranks would hang at the next."""
    return [refused_budget(rank, world, path)] + [refused_placement(rank, world, placement)
                                                  for placement, _ in REFUSED]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[list[str]]:
    """refusals' messages from one launch of two ranks: each a list over the ranks."""
    per_rank = run_ranks(2, refusals, str(tmp_path_factory.mktemp("refused")), timeout=120)
    return [list(messages) for messages in zip(*per_rank)]


def test_a_host_budget_below_the_swap_files_needs_names_the_least_that_works(refused):
    for error in refused[0]:
        assert "host_budget=1000" in error and "give host_budget at least" in error, error


@pytest.mark.parametrize("placement,fragment", REFUSED)
def test_a_placement_that_cannot_be_made_is_refused_before_any_collective(
        refused, placement, fragment):
    errors = refused[1 + REFUSED.index((placement, fragment))]
    assert all(fragment in e for e in errors), errors


def refused_placement(rank, world, placement):
    return error_of(lambda: zf.compose(zero(3), zf.offload("cpu", placement=placement))(
        *_plain()))


def test_unit_patterns():
    assert _matches("blocks.[30-39]", "blocks.31") and _matches("blocks.*", "blocks.2")
    assert not _matches("blocks.[30-39]", "blocks.3") and not _matches("blocks.[30-39]", "blocks.40")
    assert _matches("<root>", "<root>") and not _matches("blocks.0", "blocks.01")
    assert _matches("layers.[0-3].mlp", "layers.2.mlp")
