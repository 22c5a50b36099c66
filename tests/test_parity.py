"""Every stage matches plain single-process PyTorch on the same global batch."""
from __future__ import annotations

import itertools

import pytest
import torch

from support import SLOW
from support.compare import TOL, max_errors
from support.loops import train_reference, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks

STEPS = 5


def run_config(rank, world, refs, stage, kind, accum, clip=None, no_sync=False,
               checkpoint=False, groups=False, opts=None, zero_grad="opt"):
    """One config's errors against plain PyTorch. ``refs`` holds the references trained so
    far: configs that differ only in what the reference does not see (stage, no_sync,
    zerofn's options, how gradients are cleared) share one."""
    ref, model = make_models(checkpoint=checkpoint)
    opt = make_optimizer(kind, model.parameters(), groups)
    model, opt = zero(stage, **(opts or {}))(model, opt)
    data = batches(STEPS, accum, world)
    key = (kind, accum, clip, checkpoint, groups)
    if key not in refs:
        ref_opt = make_optimizer(kind, ref.parameters(), groups)
        train_reference(ref, ref_opt, data, clip)
        refs[key] = ref, ref_opt
    train_sharded(model, opt, data, rank, world, clip, no_sync=no_sync, zero_grad=zero_grad)
    return max_errors(*refs[key], model, opt)


def matrix(rank, world, configs):
    refs = {}
    return [run_config(rank, world, refs, *c[:3], **c[3]) for c in configs]


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
    (2, "sgd", 1, {"zero_grad": "model"}),
    (3, "adamw", 3, {"zero_grad": "model"}),
]


# At 4 ranks (twice the CI machine's cores) what the rank count changes: each stage's
# uneven shards and accumulation (AdamW), no_sync, the clip's global norm, zero_grad on the
# model, the kept and persisted units. What does not depend on it (SGD's plain runs, param
# groups, activation checkpointing alone, prefetch depth) is the same code as at 2 ranks,
# where the whole matrix runs; ZEROFN_SLOW=1 runs the whole matrix at 4 as well.
WORLD_4 = [c for c in BASE if c[1] == "adamw"] + [
    c for c in EXTRA if set(c[3]) & {"clip", "no_sync", "zero_grad", "opts"}
    and "prefetch" not in c[3].get("opts", {})]


def configs_at(world: int) -> list:
    return WORLD_4 if world == 4 and not SLOW else BASE + EXTRA


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_matrix(world):
    """stage x optimizer x accumulation, plus checkpointing, clipping, no_sync, param groups."""
    configs = configs_at(world)
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
