"""FSDP2's order: the transforms applied to the model alone, the optimizer built after over
``model.parameters()`` and found at its first step, trains exactly as the documented order
(the optimizer given to the transform) and as plain PyTorch; what zerofn cannot serve is
refused at that step on every rank."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import zerofn as zf
from support.compare import TOL, assert_same_state, full_state, max_errors
from support.containers import PartsOptimizer, schedulers
from support.fsdp2 import fsdp2_full
from support.errors import error_of
from support.loops import train_reference, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks

STEPS, ACCUM, CLIP = 4, 2, 0.05

# Each configuration's transforms beyond the stage.
EXTRAS = {
    "none": lambda: (),
    "offload": lambda: (zf.offload("cpu"),),
    "bf16 int8": lambda: (zf.mixed_precision(torch.bfloat16),
                          zf.offload("cpu", state_dtype=torch.int8)),
}


def torch_loop(model, opt, data, rank, world, sched=None, nan_at=None):
    """The loop as a PyTorch user writes it: torch's clip over ``model.parameters()``,
    accumulation by plain repeated backwards, ``opt.zero_grad()``; ``nan_at``: a step whose
    loss is nan on rank 0 (the non-finite guard skips it on every rank)."""
    for step, micro in enumerate(data):
        for x, y in micro:
            loss = model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)
            if step == nan_at and rank == 0:
                loss = loss * float("nan")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()




def both_orders(rank, world, stage, extra, data, ref):
    """Final state of the FSDP2 order and of the documented order, and the former's
    distance from ``ref`` (plain PyTorch on the global batch and its optimizer; fp32
    configurations)."""
    _, model = make_models()
    model = zf.compose(zero(stage), *EXTRAS[extra]())(model)
    opt = make_optimizer("adamw", model.parameters())      # after the transform
    torch_loop(model, opt, data, rank, world)
    after = full_state(model, opt)
    errs = None if extra == "bf16 int8" else max_errors(*ref, model, opt)
    _, model = make_models()
    model, opt = zf.compose(zero(stage), *EXTRAS[extra]())(
        model, make_optimizer("adamw", model.parameters()))
    torch_loop(model, opt, data, rank, world)
    return after, full_state(model, opt), errs


def every_order(rank, world):
    """``both_orders`` at every stage and extra, one after another on the same ranks,
    against one reference."""
    data = batches(STEPS, ACCUM, world)
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    train_reference(ref, ref_opt, data, CLIP)
    return {(stage, extra): both_orders(rank, world, stage, extra, data, (ref, ref_opt))
            for stage in (1, 2, 3) for extra in EXTRAS}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_built_after_the_transform_trains_as_the_one_given_to_it(
        stage, extra, world, shared_runs):
    """(Every case of a world from one run of its ranks: ``every_order``.)"""
    for by_case in shared_runs(world, every_order, timeout=300):
        after, before, errs = by_case[stage, extra]
        assert_same_state(after, before)
        if errs is not None:
            assert max(errs) < TOL, errs


def skipped_step_in_both_orders(rank, world, stage, offload):
    """A nan on rank 0 at step 2 (the guard skips it on every rank), under a share of the
    state on the device or the swap file: the two orders stay the same bits."""
    data = batches(STEPS, 1, world)
    out = []
    for after in (True, False):
        _, model = make_models()
        transform = zf.compose(zero(stage), zf.offload(**offload))
        if after:
            model = transform(model)
            opt = make_optimizer("adamw", model.parameters())
        else:
            model, opt = transform(model, make_optimizer("adamw", model.parameters()))
        torch_loop(model, opt, data, rank, world, nan_at=2)
        out.append(full_state(model, opt))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("stage,offload", [(2, {"ratio": 0.5}), (3, {"device": "nvme"})])
def test_a_skipped_step_and_a_split_or_swapped_state_keep_the_two_orders_equal(
        stage, offload, tmp_path):
    if offload.get("device") == "nvme":
        offload = dict(offload, path=str(tmp_path))
    for after, before in run_ranks(2, skipped_step_in_both_orders, stage, offload, timeout=300):
        assert_same_state(after, before)


def no_scheduler_warning(rank, world, stage):
    """torch's LR scheduler over a bound optimizer: its check that step() was not replaced
    (a warning) stays quiet, as an error here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, model = make_models()
        model = zero(stage)(model)
        opt = make_optimizer("adamw", model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        torch_loop(model, opt, batches(3, 1, world), rank, world, sched)
        _, model = make_models()
        model, opt = zero(stage, on_nonfinite="raise")(
            model, make_optimizer("sgd", model.parameters()))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        torch_loop(model, opt, batches(3, 1, world), rank, world, sched)
        return opt.param_groups[0]["lr"], type(opt).step is type(opt).__dict__.get("step", type(opt).step)


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 3])
def test_lr_schedulers_see_torchs_own_step(stage):
    for lr, plain in run_ranks(2, no_scheduler_warning, stage, timeout=120):
        assert lr == pytest.approx(0.1 * 0.1 ** 3) and plain


def sgd_on_the_host(rank, world):
    """SGD with momentum under offload, built after the transform: the host steps it with
    torch (its gradients cast as they are read), as plain PyTorch does."""
    data = batches(STEPS, 1, world)
    ref, model = make_models()
    model = zf.compose(zero(2), zf.offload("cpu"))(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
    torch_loop(model, opt, data, rank, world)
    train_reference(ref, ref_opt, data, CLIP)
    return max_errors(ref, ref_opt, model, opt)


@pytest.mark.multirank
def test_another_optimizer_built_after_steps_offloaded_rows_exactly():
    for errs in run_ranks(2, sgd_on_the_host, timeout=120):
        assert max(errs) < TOL, errs


def checkpoint_before_the_first_step(rank, world, root):
    """Save, then load, with an optimizer no step has bound yet: zerofn binds it there."""
    data = batches(STEPS, 1, world)
    _, model = make_models()
    model = zero(3)(model)
    opt = make_optimizer("adamw", model.parameters())
    torch_loop(model, opt, data[:2], rank, world)
    zf.save_checkpoint(root, model, opt, step=2)
    torch_loop(model, opt, data[2:], rank, world)
    straight = full_state(model, opt)
    _, model = make_models(seed=5)
    model = zero(3)(model)
    opt = make_optimizer("adamw", model.parameters())
    assert zf.load_checkpoint(root, model, opt)["step"] == 2
    torch_loop(model, opt, data[2:], rank, world)
    return straight, full_state(model, opt)


@pytest.mark.multirank
def test_a_checkpoint_binds_an_optimizer_that_has_not_stepped(tmp_path):
    for straight, resumed in run_ranks(2, checkpoint_before_the_first_step, str(tmp_path),
                                       timeout=120):
        assert_same_state(straight, resumed)


def takeover(rank, world):
    """A second optimizer over the same parameters takes them over with fresh state, as
    plain PyTorch's would; stepping the first again raises."""
    data = batches(STEPS, 1, world)
    ref, model = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    model, first = zero(3)(model, make_optimizer("adamw", model.parameters()))
    train_reference(ref, ref_opt, data[:2], CLIP)
    torch_loop(model, first, data[:2], rank, world)
    ref_opt = make_optimizer("adamw", ref.parameters())     # a new one, fresh state
    second = make_optimizer("adamw", model.parameters())
    train_reference(ref, ref_opt, data[2:], CLIP)
    torch_loop(model, second, data[2:], rank, world)
    errs = max_errors(ref, ref_opt, model, second)
    return errs, error_of(first.step)


@pytest.mark.multirank
def test_a_later_optimizer_takes_the_parameters_over_and_the_first_is_retired():
    for errs, refusal in run_ranks(2, takeover, timeout=120):
        assert max(errs) < TOL, errs
        assert refusal.startswith("zerofn: this AdamW no longer steps its model"), refusal


def refusals(rank, world):
    """What an optimizer found at its first step cannot do, refused on every rank."""
    out = {}
    _, model = make_models()
    model = zero(2)(model)
    params = [p for p in model.parameters() if p.requires_grad]
    stray = torch.nn.Parameter(torch.zeros(3))
    loss = model(*batches(1, 1, world)[0][0])
    loss.backward()
    out["stray"] = error_of(torch.optim.AdamW(params + [stray]).step)
    out["lbfgs"] = error_of(torch.optim.LBFGS(params).step)
    first = torch.optim.AdamW(params[:3])
    first.step()
    out["disjoint"] = error_of(torch.optim.AdamW(params[3:]).step)
    _, other = make_models()
    other = zero(2)(other)
    out["two models"] = error_of(
        torch.optim.AdamW(params[:2] + list(other.parameters())[:2]).step)
    _, model = make_models()
    out["overlap"] = error_of(zf.compose(zero(2), zf.offload("cpu", overlap_step=True)), model)
    _, model = make_models()
    model = zf.compose(zero(2), zf.offload("cpu", state_dtype=torch.bfloat16),
                       zf.mixed_precision(torch.bfloat16))(model)
    model(*batches(1, 1, world)[0][0]).backward()
    out["lowp sgd"] = error_of(torch.optim.SGD(model.parameters(), lr=0.1).step)
    return out


@pytest.mark.multirank
def test_what_the_found_optimizer_cannot_do_is_refused_on_every_rank():
    for out in run_ranks(2, refusals, timeout=120):
        assert "is not a parameter of the model" in out["stray"], out["stray"]
        assert out["stray"].startswith("zerofn cannot step this model with this AdamW (rank 0)")
        assert "LBFGS steps through a closure or sparse rows" in out["lbfgs"], out["lbfgs"]
        assert "zerofn steps one optimizer per model" in out["disjoint"], out["disjoint"]
        assert "holds parameters of 2 models zerofn transformed" in out["two models"]
        assert "offload(overlap_step=True): it steps units during backward" in out["overlap"]
        assert "stores Adam's state" in out["lowp sgd"] and "not SGD" in out["lowp sgd"]


def titan_loop(model, container, scheds, data, rank, world):
    """torchtitan's train step: zero_grad first, the micro-batches' backwards, torch's
    clip over the parameters, the container's step, then each part's LR schedule."""
    for micro in data:
        container.zero_grad()
        for x, y in micro:
            (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                       CLIP, foreach=True)
        container.step()
        for s in scheds:
            s.step()


def titan_order(rank, world, how):
    """The model parallelized first (zerofn's transforms, or FSDP2's fully_shard per block
    and root), then torchtitan-style optimizers over it; full weights after the loop."""
    data = batches(STEPS, ACCUM, world)
    _, model = make_models()
    if how == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = zf.compose(zero(3 if how == "zero3" else 2),
                           *(() if how == "zero3" else (zf.offload("cpu"),)))(model)
    container = PartsOptimizer([model], lr=1e-3, weight_decay=0.1)
    titan_loop(model, container, schedulers(container, 2, STEPS), data, rank, world)
    if how == "fsdp2":
        return {k: v.clone() for k, v in fsdp2_full(model, container.optimizers[0])[0].items()}
    return full_state(model, container.optimizers[0])[0]


def titan_reference(rank, world):
    data = batches(STEPS, ACCUM, 2)      # the global batches of two ranks, whole
    _, model = make_models()
    container = PartsOptimizer([model], lr=1e-3, weight_decay=0.1)
    titan_loop(model, container, schedulers(container, 2, STEPS), data, 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.multirank
def test_torchtitans_order_with_its_optimizer_container_follows_plain_pytorch_and_fsdp2():
    want = run_ranks(1, titan_reference)[0]
    fsdp2 = run_ranks(2, titan_order, "fsdp2", timeout=120)[0]
    assert max((fsdp2[k] - v).abs().max().item() for k, v in want.items()) < TOL
    for how in ("zero3", "zero2 offload"):
        got = run_ranks(2, titan_order, how, timeout=120)[0]
        assert max((got[k] - v).abs().max().item() for k, v in want.items()) < TOL, how
        assert max((got[k] - v).abs().max().item() for k, v in fsdp2.items()) < TOL, how
