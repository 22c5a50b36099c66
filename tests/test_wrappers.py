"""Models as a loop holds them: compiled by ``torch.compile`` (its ``_orig_mod``) or handed
back by ``zf.auto`` at stage 0 (DDP) go through zerofn's functions; a model another
data-parallel wrapper holds is refused by the transforms, naming it."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import zerofn as zf
from support.compare import assert_same_state, full_state
from support.errors import error_of
from support.loops import zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.planner.candidates import Candidate

STEPS = 4


def loop(model, opt, data, rank, world):
    for micro in data:
        for x, y in micro:
            zf.scale_loss(model, model(x.chunk(world)[rank], y.chunk(world)[rank])).backward()
        zf.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()




def build(kind: str, seed: int = 0):
    """The parity model as the loop holds it: ``"compiled"`` (ZeRO-3, then compiled) or
    ``"ddp"`` (what zf.auto's stage 0 hands back)."""
    _, model = make_models(seed=seed)
    if kind == "compiled":
        model = torch.compile(zero(3)(model), backend="eager")
        return model, make_optimizer("adamw", model.parameters())
    return Candidate(stage=0).apply(model, make_optimizer("adamw", model.parameters()))


def save_train_resume(rank, world, kind, root):
    """Train, save, train on: then a fresh model loads the save and trains the same steps;
    both end in the same state. The save also loads into a ZeRO-3 model."""
    data = batches(STEPS, 1, world)
    model, opt = build(kind)
    loop(model, opt, data[:2], rank, world)
    zf.save_checkpoint(root, model, opt, step=2)
    loop(model, opt, data[2:], rank, world)
    straight = full_state(model, opt)
    model, opt = build(kind, seed=7)
    assert zf.load_checkpoint(root, model, opt)["step"] == 2
    loop(model, opt, data[2:], rank, world)
    _, other = make_models(seed=9)
    other, other_opt = zero(3)(other, make_optimizer("adamw", other.parameters()))
    zf.load_checkpoint(root, other, other_opt)
    loop(other, other_opt, data[2:], rank, world)
    return straight, full_state(model, opt), full_state(other, other_opt)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["compiled", "ddp"])
def test_compiled_and_auto_ddp_models_go_through_zerofns_functions(kind, tmp_path):
    for straight, resumed, zero3 in run_ranks(2, save_train_resume, kind, str(tmp_path),
                                              timeout=300):
        assert_same_state(straight, resumed)
        assert zero3[0].keys() == straight[0].keys()
        assert max((zero3[0][k] - v).abs().max().item() for k, v in straight[0].items()) < 1e-5


def wrapped(rank, world):
    _, model = make_models()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _, other = make_models()
    for block in other.blocks:
        fully_shard(block)
    return error_of(zero(3), ddp), error_of(zf.shard_optimizer(), other)


@pytest.mark.multirank
def test_a_model_another_wrapper_holds_is_refused_naming_it():
    for ddp, fsdp in run_ranks(2, wrapped, timeout=60):
        assert ddp.startswith("zerofn: this model is wrapped in DistributedDataParallel"), ddp
        assert "give the transform the module inside" in ddp
        assert fsdp.startswith("zerofn: this model holds FSDPBlock"), fsdp
