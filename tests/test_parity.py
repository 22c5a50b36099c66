"""Every stage matches plain single-process PyTorch on the same global batch."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import zerofn as zf
from support.models import batches, make_models, make_optimizer, worst
from support.ranks import run_ranks

STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}
TOL = 1e-5
STEPS = 5


def transform(stage: int, **opts):
    return zf.compose(*(getattr(zf, name)() for name in STAGES[stage][:-1]),
                      getattr(zf, STAGES[stage][-1])(**opts))


def train_reference(ref, opt, data, clip=None):
    for micro in data:
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        ref(x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()


def train_sharded(model, opt, data, rank, world, clip=None, no_sync=False, zero="opt"):
    for micro in data:
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            ctx = model.no_sync() if no_sync and not last else contextlib.nullcontext()
            with ctx:
                (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
        if clip:
            zf.clip_grad_norm_(model, clip)
        opt.step()
        # model.zero_grad() must clear the reduced gradient shards as opt.zero_grad() does
        (model if zero == "model" else opt).zero_grad()


def max_errors(ref, ref_opt, model, opt):
    """Largest absolute differences of full params and of optimizer state, gathered onto
    the reference's device (under offload they lie on the host)."""
    device = next(ref.parameters()).device
    msd, osd = zf.get_state_dict(model, opt, full=True, device=device)
    p_err = max(worst(msd[k] - v) for k, v in ref.state_dict().items())
    names = {p: n for n, p in ref.named_parameters()}
    s_err = 0.0
    for p, state in ref_opt.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                s_err = max(s_err, worst(osd["state"][names[p]][k] - v))
            else:
                assert float(osd["state"][names[p]][k]) == float(v), (names[p], k)
    assert len(osd["state"]) == len(ref_opt.state)
    return p_err, s_err


def run_config(rank, world, stage, kind, accum, clip=None, no_sync=False, checkpoint=False,
               groups=False, opts=None, zero="opt"):
    ref, model = make_models(checkpoint=checkpoint)
    ref_opt = make_optimizer(kind, ref.parameters(), groups)
    opt = make_optimizer(kind, model.parameters(), groups)
    model, opt = transform(stage, **(opts or {}))(model, opt)
    data = batches(STEPS, accum, world)
    train_reference(ref, ref_opt, data, clip)
    train_sharded(model, opt, data, rank, world, clip, no_sync, zero)
    return max_errors(ref, ref_opt, model, opt)


def matrix(rank, world, configs):
    return [run_config(rank, world, *c[:3], **c[3]) for c in configs]


BASE = [(s, k, a, {}) for s, k, a in itertools.product((1, 2, 3), ("adamw", "sgd"), (1, 3))]
EXTRA = [
    (3, "adamw", 1, {"checkpoint": True}),
    (2, "adamw", 1, {"checkpoint": True}),
    (3, "adamw", 1, {"clip": 0.05}),
    (2, "sgd", 1, {"clip": 0.05}),
    (1, "adamw", 3, {"clip": 0.05}),
    (2, "adamw", 3, {"no_sync": True}),
    (3, "adamw", 3, {"no_sync": True}),
    (3, "adam", 1, {"groups": True}),
    (1, "adamw", 1, {"groups": True}),
    (3, "adamw", 1, {"opts": {"prefetch": 2}}),
    (3, "adamw", 1, {"opts": {"reshard_after_forward": False}}),
    (3, "adamw", 3, {"opts": {"persist_below": 200}, "clip": 0.05}),
    (3, "sgd", 3, {"checkpoint": True, "clip": 0.05}),
    (2, "sgd", 1, {"zero": "model"}),
    (3, "adamw", 3, {"zero": "model"}),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_matrix(world):
    """stage x optimizer x accumulation, plus checkpointing, clipping, no_sync, param groups."""
    configs = BASE + EXTRA
    results = run_ranks(world, matrix, configs, timeout=600)
    for rank, errs in enumerate(results):
        for config, (p_err, s_err) in zip(configs, errs):
            assert p_err < TOL and s_err < TOL, (f"world {world} rank {rank} {config}: "
                                                 f"param err {p_err:.2e}, state err {s_err:.2e}")


def test_clipping_actually_clips():
    """The clip test above is only meaningful if the norm exceeds max_norm."""
    ref, _ = make_models()
    data = batches(1, 1, 1)
    x, y = data[0][0]
    ref(x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert norm > 0.05
