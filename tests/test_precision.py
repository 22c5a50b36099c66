"""Mixed precision: bf16 compute with fp32 masters, and fp16 loss scaling as DeepSpeed does it."""
from __future__ import annotations

import math

import pytest
import torch

import zerofn as zf
from support.accounting import padding_bound
from support.compare import TOL_BF16_VS_FP32, worst
from support.fsdp2 import fsdp2_parity
from support.loops import build_parity, step_once, train_reference, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.runtime.precision import LossScaler

STEPS = 50


def fsdp2_params(rank, world, data):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, opt = fsdp2_parity(init_device_mesh("cpu", (world,)), policy=policy, frozen=False)
    train_sharded(model, opt, data, rank, world)
    # buffers stay plain tensors under FSDP2; parameters are DTensors
    return {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model.state_dict().items()}


def bf16_runs(rank, world):
    data = batches(STEPS, 1, world)
    ref, _ = make_models(frozen=False)
    ref_opt = make_optimizer("adamw", ref.parameters())
    train_reference(ref, ref_opt, data)
    fsdp2 = fsdp2_params(rank, world, data)
    out = {}
    for stage in (1, 2, 3):
        model, opt = build_parity(stage, "adamw", zf.mixed_precision(
            torch.bfloat16, reduce_dtype=torch.float32), frozen=False)
        train_sharded(model, opt, data, rank, world)
        msd, _ = zf.get_state_dict(model, opt, full=True)
        out[stage] = (max(worst(msd[k] - v) for k, v in ref.state_dict().items()),
                      max(worst(msd[k] - v) for k, v in fsdp2.items()))
    return out


@pytest.mark.multirank
def test_bf16_follows_fp32_and_matches_fsdp2():
    for by_stage in run_ranks(2, bf16_runs, timeout=400):
        for stage, (vs_fp32, vs_fsdp2) in by_stage.items():
            assert vs_fp32 < TOL_BF16_VS_FP32, (stage, vs_fp32)
            assert vs_fsdp2 == 0.0, (stage, vs_fsdp2)


def overflow_on_one_rank(rank, world):
    """An inf in rank 1's loss skips the step on every rank and leaves all state untouched."""
    out = {}
    for stage in (1, 2, 3):
        model, opt = build_parity(stage, "adamw", zf.mixed_precision(
            torch.float16, initial_scale_power=8, hysteresis=1))
        data = batches(3, 1, world)
        train_sharded(model, opt, data[:1], rank, world, scale=True)
        before = zf.get_state_dict(model, opt, full=True)
        train_sharded(model, opt, data[1:2], rank, world, 1.0, scale=True, inf_on=(0, 1))
        after = zf.get_state_dict(model, opt, full=True)
        same = all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(after[1]["state"][f][k]))
            for f, st in before[1]["state"].items() for k, v in st.items())
        scale_after_skip = opt.state_dict()["zerofn_loss_scaler"]["scale"]
        train_sharded(model, opt, data[2:], rank, world, scale=True)   # and training goes on
        moved = any(not torch.equal(before[0][k], zf.get_state_dict(model, opt, full=True)[0][k])
                    for k in before[0])
        out[stage] = (same, scale_after_skip, moved)
    return out


@pytest.mark.multirank
def test_overflow_skips_the_step_on_every_rank():
    for by_stage in run_ranks(2, overflow_on_one_rank):
        for stage, (same, scale, moved) in by_stage.items():
            assert same, f"stage {stage}: a skipped step changed params or optimizer state"
            assert scale == 2.0 ** 7, (stage, scale)   # 2**8 halved once (hysteresis 1)
            assert moved, stage


# Loss scale after each step, for the overflow sequence below, as DeepSpeed 0.19.8's
# DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, delayed_shift=h,
# consecutive_hysteresis=c) gives it.
OVERFLOWS = [1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
DEEPSPEED_SCALES = {
    (2, False): [16, 16, 16, 16, 32, 32, 16, 16, 8, 8, 8, 8, 16, 16, 16, 32, 32, 32, 16, 8, 8, 8, 8, 16, 16],
    (2, True): [16, 16, 16, 16, 32, 32, 16, 16, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 32, 16, 16, 16, 16, 32, 32],
    (1, False): [8, 8, 8, 8, 16, 8, 4, 4, 2, 2, 2, 2, 4, 4, 4, 8, 8, 4, 2, 1, 1, 1, 1, 2, 2],
    (3, False): [16, 16, 16, 16, 32, 32, 32, 32, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64, 32, 32, 32, 32, 64, 64],
}


@pytest.mark.parametrize("hysteresis,consecutive", sorted(DEEPSPEED_SCALES))
def test_dynamic_scale_follows_deepspeed(hysteresis, consecutive):
    scaler = LossScaler(True, 16, window=3, min_scale=1, hysteresis=hysteresis,
                        consecutive_hysteresis=consecutive)
    scales = []
    for overflow in OVERFLOWS:
        scaler.update(bool(overflow))
        scales.append(scaler.scale)
    assert scales == DEEPSPEED_SCALES[(hysteresis, consecutive)]


def test_overflow_at_minimum_scale_is_an_error():
    scaler = LossScaler(True, 2, window=3, min_scale=1, hysteresis=1)
    scaler.update(True)
    with pytest.raises(RuntimeError, match="minimum loss scale"):
        scaler.update(True)


def bf16_bytes(rank, world):
    out = {}
    for stage in (1, 2, 3):
        _, model = make_models(frozen=False)
        psi, pad = sum(p.numel() for p in model.parameters()), padding_bound(model, world)
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zf.compose(zero(stage), zf.mixed_precision(torch.bfloat16))(model, opt)
        step_once(model, opt, rank, world)   # gradients and optimizer state now exist
        want = zf.estimate_model_state_bytes(psi, world, stage)
        # After a step ZeRO-1 holds its reduced rows, as ZeRO-2 does: its whole gradients
        # (the estimate's 2Ψ, a peak) live only until its backward ends.
        want["grads"] = zf.estimate_model_state_bytes(psi, world, max(stage, 2))["grads"]
        out[stage] = (zf.model_state_bytes(model)["cpu"], want, pad, len(opt.state))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_model_state_bytes_match_formulas(world):
    """2Ψ params, 2Ψ grads, 12Ψ master + Adam state, divided by N where the stage shards."""
    for by_stage in run_ranks(world, bf16_bytes):
        for stage, (got, want, pad, n) in by_stage.items():
            slack = {"params": 2 * pad / world, "grads": 2 * pad / world,
                     "optimizer": 12 * pad / world + 4 * n}
            for role in slack:
                assert abs(got[role] - want[role]) <= slack[role] + 64, (stage, role, got, want)


def test_estimator_reproduces_the_7b_table():
    got = [zf.estimate_model_state_bytes(7e9, 8, s)["total"] / 1e9 for s in range(4)]
    assert got == [112.0, 38.5, 26.25, 14.0]
    fp32 = zf.estimate_model_state_bytes(7e9, 8, 0, param_dtype=torch.float32)
    assert math.isclose(fp32["total"], 16 * 7e9)


def test_mixed_precision_alone_says_what_to_do():
    _, model = make_models()
    with pytest.raises(ValueError, match="shards nothing"):
        zf.mixed_precision()(model, make_optimizer("sgd", model.parameters()))


def scaler_through_checkpoint(rank, world, path):
    """fp16 + NVMe offload: the loss scale and its counters, params and Adam state all come
    back from a checkpoint, into a model with another stage and cpu offload."""
    from zerofn.checkpoint import load_checkpoint, save_checkpoint
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zf.compose(zf.shard_params(), zf.mixed_precision(torch.float16),
                            zf.offload("nvme", path=path))(model, opt)
    train_sharded(model, opt, batches(4, 1, world), rank, world, scale=True)
    saved = opt.state_dict()["zerofn_loss_scaler"]
    save_checkpoint(path + "/ckpt", model, opt, step=4)
    want = zf.get_state_dict(model, opt, full=True)
    _, fresh = make_models(seed=3)
    fresh_opt = make_optimizer("adamw", fresh.parameters())
    fresh, fresh_opt = zf.compose(zf.shard_grads(), zf.mixed_precision(torch.float16),
                                  zf.offload("cpu"))(fresh, fresh_opt)
    load_checkpoint(path + "/ckpt", fresh, fresh_opt)
    got = zf.get_state_dict(fresh, fresh_opt, full=True)
    same = all(torch.equal(want[0][k], got[0][k]) for k in want[0]) and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(got[1]["state"][f][k]))
        for f, st in want[1]["state"].items() for k, v in st.items())
    return same, saved, fresh_opt.state_dict()["zerofn_loss_scaler"]


@pytest.mark.multirank
def test_loss_scale_and_offloaded_state_survive_a_checkpoint(tmp_path):
    for same, saved, loaded in run_ranks(2, scaler_through_checkpoint, str(tmp_path)):
        assert same
        assert saved == loaded and saved["iteration"] == 4


def fp16_defaults(rank, world):
    """DeepSpeed's defaults (2**16, hysteresis 2): the first steps overflow, the scale backs
    off, and training then proceeds, identically on every rank."""
    model, opt = build_parity(3, "adamw", zf.mixed_precision(torch.float16))
    before = zf.get_state_dict(model, opt, full=True)[0]
    scales = []
    for micro in batches(8, 1, world):
        train_sharded(model, opt, [micro], rank, world, scale=True)
        scales.append(opt.state_dict()["zerofn_loss_scaler"]["scale"])
    after = zf.get_state_dict(model, opt, full=True)[0]
    return scales, any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.multirank
def test_fp16_default_scale_backs_off_then_trains():
    results = run_ranks(2, fp16_defaults)
    assert results[0] == results[1]
    scales, moved = results[0]
    assert scales[0] == 2.0 ** 16 and scales[-1] < 2.0 ** 16, scales   # hysteresis, then halving
    assert moved


class RecordsInputs(torch.nn.Module):
    """A model whose forward notes the dtypes its inputs arrive in, nested ones too."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = {}

    def forward(self, x, pair, *, scale=None, ids=None):
        self.seen = {"x": x.dtype, "pair": tuple(t.dtype for t in pair),
                     "scale": scale.dtype, "ids": ids.dtype}
        return self.lin(x * scale + pair[0] + pair[1]).sum() + ids.sum()


def inputs_as_cast(rank, world, stage, cast):
    torch.manual_seed(0)
    model = RecordsInputs()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = zf.compose(zero(stage), zf.mixed_precision(
        torch.bfloat16, cast_forward_inputs=cast))(model, opt)
    x = torch.randn(2, 4)
    try:
        model(x, (x, x.double()), scale=x, ids=torch.arange(2)).backward()
    except RuntimeError as e:
        return str(e)
    return model.seen


def inputs_both_ways(rank, world, stage):
    return [inputs_as_cast(rank, world, stage, cast) for cast in (True, False)]


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_casts_the_forwards_floating_inputs_as_fsdp2_does(stage):
    """cast_forward_inputs (default True): floating tensors, nested and keyword ones too,
    arrive in the compute dtype; integer ones as they were. False leaves them, and fp32
    data then meets bf16 weights."""
    [(cast, left)] = run_ranks(1, inputs_both_ways, stage)
    assert cast == {"x": torch.bfloat16, "pair": (torch.bfloat16, torch.bfloat16),
                    "scale": torch.bfloat16, "ids": torch.int64}
    assert "dtype" in left, left


def bf16_model_state(rank, world, mixed):
    """A model built in bf16, under ZeRO-2 with or without mixed precision: the dtypes of
    its masters and Adam's moments, and what the set-up log said."""
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerofn").addHandler(handler)
    logging.getLogger("zerofn").setLevel(logging.INFO)
    _, model = make_models()
    model = model.to(torch.bfloat16)
    opt = make_optimizer("adamw", model.parameters())
    extra = [zf.mixed_precision(torch.bfloat16)] if mixed else []
    model, opt = zf.compose(zero(2), *extra)(model, opt)
    step_once(model, opt, rank, world)
    _, osd = zf.get_state_dict(model, opt)
    masters = {p.dtype for g in opt.param_groups for p in g["params"]}
    moments = {v.dtype for st in osd["state"].values() for k, v in st.items() if k != "step"}
    return masters, moments, [(r.levelname, r.getMessage()) for r in records]


def bf16_model_states(rank, world):
    """bf16_model_state with mixed precision, then without (a fresh log for each)."""
    return [bf16_model_state(rank, world, mixed) for mixed in (True, False)]


@pytest.mark.multirank
def test_a_bf16_model_gets_fp32_masters_under_mixed_precision_and_is_told_otherwise():
    [(mixed0, (m0, _, log0)), (mixed1, (_, _, log1))] = run_ranks(2, bf16_model_states)
    for masters, moments, log in (mixed0, mixed1):
        assert masters == moments == {torch.float32}
    assert m0 == {torch.bfloat16}
    assert [lvl for lvl, _ in log0] == ["WARNING"] and log1 == []     # rank 0 says it, once
    assert "masters and optimizer state bf16" in log0[0][1]
    assert "zf.mixed_precision(torch.bfloat16)" in log0[0][1]
