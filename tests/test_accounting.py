"""Model-state bytes equal DESIGN.md §4's fp32 formulas; traffic is 2Ψ (ZeRO-1/2) or 3Ψ (ZeRO-3)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import zerofn as zf
from models import batches, make_models, make_optimizer
from multiproc import run_ranks
from test_parity import transform


def padding_bound(model, world: int) -> int:
    """Elements torch.chunk padding may add across ranks: under ``world - 1`` rows per param."""
    return sum((world - 1) * (p.numel() // p.shape[0]) for p in model.parameters())


def step_once(model, opt, rank, world):
    x, y = batches(1, 1, world)[0][0]
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    opt.step()


def memory_at(rank, world):
    return {stage: memory_of_stage(rank, world, stage) for stage in (1, 2, 3)}


def memory_of_stage(rank, world, stage):
    _, model = make_models(frozen=False)
    psi = sum(p.numel() for p in model.parameters())
    pad = padding_bound(model, world)
    n_params = len(list(model.parameters()))
    opt = make_optimizer("adamw", model.parameters())
    model, opt = transform(stage)(model, opt)
    step_once(model, opt, rank, world)   # grads and optimizer state now exist
    return psi, pad, n_params, zf.model_state_bytes(model)["cpu"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_formulas(world):
    """fp32 AdamW: params 4Ψ | 4Ψ/N, grads 4Ψ | 4Ψ/N, Adam state 8Ψ/N, per rank."""
    for rank, by_stage in enumerate(run_ranks(world, memory_at)):
        for stage, (psi, pad, n, got) in by_stage.items():
            shard = 4 * psi / world
            want = {1: (4 * psi, 4 * psi, 2 * shard), 2: (4 * psi, shard, 2 * shard),
                    3: (shard, shard, 2 * shard)}[stage]
            # Shards may be padded; each of the n params' ``step`` counters is a 4-byte scalar.
            slack = (0, 4 * pad / world + 4, 4 * pad / world + 4)
            for role, w, extra in zip(("params", "grads", "optimizer"), want,
                                      (slack[stage == 3], slack[stage >= 2], 8 * pad / world + 4 * n)):
                assert abs(got[role] - w) <= extra + 64, (stage, world, rank, role, got[role], w)


def traffic_at(rank, world):
    """zerofn's own count, and what actually went through torch.distributed, per step."""
    seen = {"all_gather": 0, "reduce_scatter": 0}
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor",
                                "reduce_scatter")}

    def numel(t):
        return sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()

    def wrap(kind, fn):
        def counted(out, inp, *a, **k):
            seen[kind] += max(numel(out), numel(inp))
            return fn(out, inp, *a, **k)
        return counted

    for kind, fns in names.items():
        for name in fns:
            if hasattr(dist, name):
                setattr(dist, name, wrap(kind, getattr(dist, name)))
    import zerofn.runtime.comm as comm  # bind the wrapped functions zerofn calls
    comm._all_gather = dist.all_gather_single if hasattr(dist, "all_gather_single") \
        else dist.all_gather_into_tensor
    comm._reduce_scatter = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") \
        else dist.reduce_scatter_tensor
    out = {}
    for stage in (1, 2, 3):
        _, model = make_models()
        psi = sum(p.numel() for p in model.parameters())
        pad = padding_bound(model, world)
        opt = make_optimizer("adamw", model.parameters())
        model, opt = transform(stage)(model, opt)
        step_once(model, opt, rank, world)
        opt.zero_grad()
        zf.get_state_dict(model, opt)  # finishes the deferred ZeRO-1/2 all-gathers
        for k in seen:
            seen[k] = 0
        step_once(model, opt, rank, world)
        out[stage] = (psi, pad, zf.comm_stats(model), dict(seen))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_per_step(world):
    for by_stage in run_ranks(world, traffic_at):
        for stage, (psi, pad, stats, seen) in by_stage.items():
            gathers = 2 if stage == 3 else 1
            assert psi <= stats["reduce_scatter"] <= psi + pad
            assert gathers * psi <= stats["all_gather"] <= gathers * (psi + pad)
            assert stats["all_gather"] == seen["all_gather"], (stage, stats, seen)
            assert stats["reduce_scatter"] == seen["reduce_scatter"], (stage, stats, seen)
            assert stats["all_gather_bytes"] == 4 * stats["all_gather"]
