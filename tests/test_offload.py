"""offload("cpu"): every stage matches the same run without offload, and the device keeps
no optimizer state (and, with params=True, no parameter shards)."""
from __future__ import annotations

import pytest
import torch

import zerofn as zf
from models import batches, make_models, make_optimizer
from multiproc import run_ranks
from test_parity import STAGES, max_errors, train_reference, train_sharded

CONFIGS = [(1, "adamw", {}), (2, "adamw", {}), (3, "adamw", {}), (3, "adamw", {"params": True}),
           (2, "sgd", {}), (3, "adam", {"params": True})]


def build(stage, kind, offload=None, precision=None):
    _, model = make_models()
    opt = make_optimizer(kind, model.parameters())
    extra = ([zf.offload("cpu", **offload)] if offload is not None else []) + \
        ([zf.mixed_precision(precision)] if precision else [])
    return zf.compose(*(getattr(zf, n)() for n in STAGES[stage]), *extra)(model, opt)


def offload_runs(rank, world):
    out = []
    data = batches(5, 1, world)
    for stage, kind, opts in CONFIGS:
        ref, _ = make_models()
        ref_opt = make_optimizer(kind, ref.parameters())
        train_reference(ref, ref_opt, data)
        plain, plain_opt = build(stage, kind)
        off, off_opt = build(stage, kind, opts)
        train_sharded(plain, plain_opt, data, rank, world, clip=0.05)
        train_sharded(off, off_opt, data, rank, world, clip=0.05)
        a = zf.get_state_dict(plain, plain_opt, full=True)
        b = zf.get_state_dict(off, off_opt, full=True)
        vs_plain = max(max((a[0][k] - b[0][k]).abs().max().item() for k in a[0]),
                       max((v - b[1]["state"][f][k]).abs().max().item()
                           for f, st in a[1]["state"].items() for k, v in st.items()
                           if torch.is_tensor(v) and v.dim()))
        out.append((vs_plain, off_opt.state_dict()["param_groups"] == plain_opt.state_dict()["param_groups"]))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offload_matches_the_run_without_it(world):
    for rank_out in run_ranks(world, offload_runs, timeout=400):
        for config, (err, same_groups) in zip(CONFIGS, rank_out):
            assert err < 1e-6, (config, err)
            assert same_groups, config


def offload_vs_pytorch(rank, world):
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    model, opt = build(3, "adamw", {"params": True})
    data = batches(5, 1, world)
    train_reference(ref, ref_opt, data)
    train_sharded(model, opt, data, rank, world)
    return max_errors(ref, ref_opt, model, opt)


def test_offload_matches_plain_pytorch():
    for p_err, s_err in run_ranks(2, offload_vs_pytorch):
        assert p_err < 1e-5 and s_err < 1e-5


def where_state_lives(rank, world):
    out = {}
    for stage, opts in ((1, {}), (2, {}), (3, {}), (3, {"params": True})):
        model, opt = build(stage, "adamw", opts, precision=torch.bfloat16)
        x, y = batches(1, 1, world)[0][0]
        model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        out[(stage, bool(opts))] = zf.model_state_bytes(model)
    return out


def test_device_holds_no_optimizer_state_under_offload():
    for by_config in run_ranks(2, where_state_lives):
        for (stage, params_too), mem in by_config.items():
            assert mem["cpu"]["optimizer"] == 0, (stage, mem)
            assert mem["host"]["optimizer"] > 0, (stage, mem)
            assert (mem["cpu"]["params"] == 0) == params_too, (stage, mem)


def test_parameter_offload_needs_zero3():
    _, model = make_models()
    with pytest.raises(ValueError, match="only ZeRO-3"):
        zf.compose(zf.shard_grads(), zf.offload("cpu", params=True))(
            model, make_optimizer("sgd", model.parameters()))
