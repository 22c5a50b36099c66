"""offload(..., overlap_step=True): the host steps each unit while backward goes on
([Note: the host step during backward] in zerofn/runtime/overlap.py). The same step
as plain PyTorch's, at worlds 1 and 2; the conditions it rests on are checked; and a
profile of one step shows the host's Adam inside backward."""
from __future__ import annotations

import time

import pytest
import torch

import zerofn as zf
from support.compare import max_errors
from support.errors import expect_error
from support.loops import build_parity, train_reference, train_sharded
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime.runtime import runtime_of

SMALL_BUCKETS = 2_000   # elements: reductions are waited during backward, not at its end

CONFIGS = [(2, {}), (3, {}), (3, {"params": True}), (2, {"state_dtype": torch.int8}),
           (3, {"ratio": 0.5})]


def build(stage: int, opts: dict, precision=None):
    extra = [zf.offload("cpu", overlap_step=True, **opts)] + \
        ([zf.mixed_precision(precision)] if precision else [])
    return build_parity(stage, "adamw", *extra, bucket_size=SMALL_BUCKETS)


def overlap_runs(rank, world):
    """Each config, 2 micro-batches a step (the first under no_sync), against plain
    PyTorch; and how many units the host stepped during backward."""
    data = batches(4, 2, world)
    out = []
    for stage, opts in CONFIGS:
        ref, _ = make_models()
        ref_opt = make_optimizer("adamw", ref.parameters())
        train_reference(ref, ref_opt, data)
        model, opt = build(stage, opts)
        early = runtime_of(model).stepper.early
        train_sharded(model, opt, data, rank, world, no_sync=True)
        errors = max_errors(ref, ref_opt, model, opt)
        if "state_dtype" in opts:       # (8-bit moments: against the same run without overlap)
            plain = build_parity(stage, "adamw", zf.offload("cpu", **opts),
                                 bucket_size=SMALL_BUCKETS)
            train_sharded(*plain, data, rank, world, no_sync=True)
            a, b = (zf.get_state_dict(*m, full=True)[0] for m in (plain, (model, opt)))
            errors = (max((a[k] - b[k]).abs().max().item() for k in a), 0.0)
        out.append((max(errors), early.stepped))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_the_host_step_during_backward_is_plain_pytorchs_step(world):
    for rank_out in run_ranks(world, overlap_runs, timeout=400):
        for (stage, opts), (err, stepped) in zip(CONFIGS, rank_out):
            assert err < 1e-5, (stage, opts, err)
            assert stepped > 0, (stage, opts)      # some units did step during backward


def refusals(rank, world):
    messages = []
    for stage, opts, precision in ((1, {}, None), (2, {}, torch.float16)):
        _, model = make_models()
        opt = make_optimizer("adamw", model.parameters())
        messages.append(str(expect_error(
            ["overlap_step"], lambda: zf.compose(
                *build_stage(stage), zf.offload("cpu", overlap_step=True, **opts),
                *([zf.mixed_precision(precision)] if precision else []))(model, opt))))
    # Clipping, and a second reducing backward before the step, raise where they happen.
    model, opt = build(2, {})
    x, y = batches(1, 1, world)[0][0]
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    messages.append(expect_error(["clip_grad_norm_", "overlap_step"], zf.clip_grad_norm_,
                                 model, 1.0))
    messages.append(expect_error(["no_sync", "overlap_step"],
                                 lambda: model(x.chunk(world)[rank],
                                               y.chunk(world)[rank]).backward(),
                                 error=RuntimeError))
    return messages


def build_stage(stage: int):
    return [zf.shard_optimizer(bucket_size=SMALL_BUCKETS)] + [zf.shard_grads()] * (stage >= 2)


@pytest.mark.multirank
def test_what_the_overlap_rests_on_is_checked():
    run_ranks(2, refusals)


def timed_step(rank, world):
    """One step of a 6-block GPT: when backward ran, and when the host got and stepped
    each unit (perf_counter_ns; torch.profiler records no ops of other threads)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=97, width=64, heads=2, ffn=256, layers=6, context=16))
    model, opt = zf.compose(zf.shard_optimizer(bucket_size=SMALL_BUCKETS), zf.shard_grads(),
                            zf.offload("cpu", overlap_step=True))(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 97, (4, 16))
    for _ in range(2):                                   # (the first one warms up)
        loss = model(x, x)
        start = time.perf_counter_ns()
        loss.backward()
        end = time.perf_counter_ns()
        opt.step()
        opt.zero_grad()
    return (start, end), runtime_of(model).stepper.early.timeline


@pytest.mark.multirank
def test_a_timed_step_shows_the_host_adam_inside_backward():
    (start, end), adam = run_ranks(1, timed_step)[0]
    assert len(adam) >= 5, adam          # the blocks' units, each stepped on landing
    # Each block's Adam is handed over while backward still runs the earlier blocks
    # (behaviour: the order of events, not their speed)...
    handed = [name for name, submitted, _, _ in adam if submitted < end]
    assert len(handed) >= 4, (adam, end)
    # ...and how much of it ran inside backward is this machine's to say.
    ran = sum(max(0, min(e, end) - s) for _, _, s, e in adam)
    print(f"backward {(end - start) / 1e6:.2f} ms; {len(handed)} of {len(adam)} units' host "
          f"Adam handed over inside it; {ran / 1e6:.2f} of "
          f"{sum(e - s for _, _, s, e in adam) / 1e6:.2f} ms of Adam ran inside it")
