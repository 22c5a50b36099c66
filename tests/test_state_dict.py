"""State dicts move between stages (and through torch.distributed.checkpoint) exactly."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

import zerofn as zf
from support.compare import assert_same_state
from support.loops import build_parity, train_sharded
from support.models import batches, make_models
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank


def trained(rank, world, stage, kind="adamw", steps=3, seed=0):
    model, opt = build_parity(stage, kind, seed=seed)
    train_sharded(model, opt, batches(steps, 1, world), rank, world)
    return model, opt


def cross_stage(rank, world):
    for src, dst in itertools.product((1, 2, 3), repeat=2):
        model, opt = trained(rank, world, src)
        msd, osd = zf.get_state_dict(model, opt)
        fresh, fresh_opt = trained(rank, world, dst, steps=0, seed=7)
        zf.set_state_dict(fresh, fresh_opt, msd, osd)
        assert_same_state(zf.get_state_dict(model, opt, full=True),
                          zf.get_state_dict(fresh, fresh_opt, full=True))
        # and both continue identically
        data = batches(2, 1, world, seed=5)
        train_sharded(model, opt, data, rank, world)
        train_sharded(fresh, fresh_opt, data, rank, world)
        assert_same_state(zf.get_state_dict(model, opt, full=True),
                          zf.get_state_dict(fresh, fresh_opt, full=True))
    return True


def test_set_state_dict_across_stages():
    run_ranks(2, cross_stage)


def layout(rank, world):
    model, opt = trained(rank, world, 3)
    msd, osd = zf.get_state_dict(model, opt)
    w = msd["blocks.0.fc.weight"]
    assert isinstance(w, DTensor) and tuple(w.placements) == (Shard(0),)
    assert w.shape == (130, 48)
    assert w.to_local().shape[0] == [33, 33, 33, 31][rank]     # torch.chunk's split of 130 rows
    assert msd["gain"].to_local().numel() == [1, 1, 1, 0][rank]  # fewer rows than ranks
    assert msd["tok.weight"] is not None and "head.weight" in msd  # tied: both names, like FSDP2
    st = osd["state"]["blocks.0.fc.weight"]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and isinstance(st["exp_avg"], DTensor)
    # Between steps, ZeRO-3 parameters are DTensors, as FSDP2's are, under unchanged FQNs.
    names = [n for n, _ in make_models()[1].named_parameters()]
    trainable = [n for n, p in make_models()[1].named_parameters() if p.requires_grad]
    assert osd["param_groups"][0]["params"] == trainable
    assert [n for n, _ in model.named_parameters()] == names
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return True


def test_zero3_layout_matches_fsdp2():
    run_ranks(4, layout)


def through_dcp(rank, world, path):
    model, opt = trained(rank, world, 3)
    dcp.save({"model": zf.get_state_dict(model, opt)[0], "optim": zf.get_state_dict(model, opt)[1]},
             checkpoint_id=path)
    fresh, fresh_opt = trained(rank, world, 2, steps=0, seed=7)
    msd, osd = zf.get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    zf.set_state_dict(fresh, fresh_opt, state["model"], state["optim"])
    assert_same_state(zf.get_state_dict(model, opt, full=True),
                      zf.get_state_dict(fresh, fresh_opt, full=True))
    return True


def test_dcp_round_trip_between_stages(tmp_path):
    run_ranks(2, through_dcp, str(tmp_path / "ckpt"))


def placed(rank, world):
    """A ZeRO-3 + offload(params=True) model's full state dict placed on one device: the
    meta device, which no tensor of zerofn's lies on by itself."""
    model, opt = build_parity(3, "adamw", zf.offload("cpu", params=True))
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    msd, osd = zf.get_state_dict(model, opt, full=True, device="meta")
    state = {k: v.device.type for st in osd["state"].values() for k, v in st.items()}
    try:
        zf.get_state_dict(model, opt, device="meta")
        refused = None
    except ValueError as e:
        refused = str(e)
    return {v.device.type for v in msd.values()}, state, refused


def test_a_full_state_dict_goes_to_the_device_asked_for():
    """Under offload full tensors lie on the host; ``device=`` puts every parameter,
    buffer and moment on one device, leaving Adam's step counter where torch.optim keeps
    it. A sharded state dict cannot move (it is zerofn's own buffers) and says so."""
    for model_devices, state, refused in run_ranks(2, placed):
        assert model_devices == {"meta"}
        assert state == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
        assert refused is not None and "full=True" in refused


class Gated(torch.nn.Module):
    """A layer whose ``late`` branch the first steps leave unused."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.late = torch.nn.Parameter(torch.full((6,), 0.5))

    def forward(self, x, use_late: bool):
        y = self.lin(x)
        return (y * self.late if use_late else y).square().mean()


def _gated_steps(model, opt, xs, use_late: bool) -> None:
    for x in xs:
        model(x, use_late).backward()
        opt.step()
        opt.zero_grad()


def unused_then_resumed(rank, world, stage):
    """Two steps leave ``late`` without a gradient; a fresh model resumes from their
    checkpoint by the DCP pattern (its own state dict loaded into), then uses ``late``."""
    torch.manual_seed(0)
    xs = torch.randn(4, world, 3, 6)
    rows = lambda x: x[rank]    # this rank's micro-batch of each step
    transform = {1: zf.shard_optimizer, 2: zf.shard_grads, 3: zf.shard_params}[stage]
    torch.manual_seed(0)
    ref = Gated()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    _gated_steps(ref, ref_opt, [x.reshape(-1, 6) for x in xs[:2]], False)
    _gated_steps(ref, ref_opt, [x.reshape(-1, 6) for x in xs[2:]], True)

    torch.manual_seed(0)
    first = Gated()
    first, opt = transform()(first, torch.optim.Adam(first.parameters(), lr=0.1))
    _gated_steps(first, opt, [rows(x) for x in xs[:2]], False)
    msd, osd = zf.get_state_dict(first, opt, full=True)
    saved_state = sorted(osd["state"])
    torch.manual_seed(0)
    fresh = Gated()
    fresh, fresh_opt = transform()(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    zf.get_state_dict(fresh, fresh_opt)          # makes state to load into, "late"'s too
    zf.set_state_dict(fresh, fresh_opt, msd, osd)
    resumed_state = sorted(zf.get_state_dict(fresh, fresh_opt, full=True)[1]["state"])
    _gated_steps(fresh, fresh_opt, [rows(x) for x in xs[2:]], True)
    got = zf.get_state_dict(fresh, fresh_opt, full=True)[0]
    gap = max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return saved_state, resumed_state, gap


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 1), (2, 3)])
def test_a_parameter_never_stepped_keeps_no_state_through_a_resume(world, stage):
    """torch.optim gives a parameter state at its first gradient. A state dict taken after
    steps that left it without one holds none for it, and a resume that loads into a fresh
    optimizer's made-up state (a zero step: Adam's count 1) drops it again, so the
    parameter's first real step is bias-corrected as plain PyTorch's."""
    for saved, resumed, gap in run_ranks(world, unused_then_resumed, stage):
        assert saved == resumed == ["lin.bias", "lin.weight"]
        assert gap < 1e-6, gap
