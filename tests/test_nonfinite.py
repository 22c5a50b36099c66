"""The non-finite guard (runtime/step_grads.py's [Note: the non-finite guard]): a step whose
gradients hold inf or nan on any rank is skipped on every rank ("skip", the default),
stops every rank naming the step and a parameter ("raise"), or is taken as plain PyTorch
takes it ("ignore"); fp16 keeps its loss scaler's rule, and overlap_step is refused what
it cannot keep. The poison goes into one rank's loss, or into one parameter's gradient
rows on one rank only."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from support.errors import error_of
from support.loops import build_parity
from support.models import batches, make_models, make_optimizer
from support.plans import plan_of
from support.ranks import run_ranks
from support.tensorboard_runs import read, scalars
from zerofn import train
from zerofn.train.job import transforms as job_transforms
from zerofn.runtime import runtime_of

pytestmark = pytest.mark.multirank

POISONED = "blocks.1.fc.weight"     # the parameter whose gradient rows get a nan
NAN = float("nan")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def poisoned_steps(model, opt, data, rank, world, bad=None, *, clip=None):
    """Train on this rank's rows of ``data``; ``bad``: (step, rank, "loss" or "grad"), a
    nan multiplied into that rank's loss, or written into the first of its gradient rows
    of POISONED after backward. Returns whether each step was skipped."""
    skipped = []
    for step, ((x, y),) in enumerate(data):
        loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
        if bad == (step, rank, "loss"):
            loss = loss * NAN
        zf.scale_loss(model, loss).backward()
        if bad == (step, rank, "grad"):
            dict(model.named_parameters())[POISONED].grad.to_local().view(-1)[0] = NAN
        if clip:
            zf.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        skipped.append(runtime_of(model).step_skipped())
    return skipped


def full_state(model, opt):
    msd, osd = zf.get_state_dict(model, opt, full=True)
    return {**{k: v.clone() for k, v in msd.items()},
            **{f"{p}.{k}": torch.as_tensor(v).clone()
               for p, st in osd["state"].items() for k, v in st.items()}}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def build(stage, precision, group=None, **options):
    """The parity model at ``stage`` in ``precision`` (fp16: a scale of 2**8 that the clean
    batches never overflow, halved by one overflow)."""
    scaling = dict(initial_scale_power=8, hysteresis=1) if precision == "fp16" else {}
    extra = [zf.mixed_precision(PRECISIONS[precision], **scaling)] if PRECISIONS[precision] \
        else []
    if group is not None:
        options["group"] = group
    return build_parity(stage, "adamw", *extra, **options)


# (stage, precision, clip, where the nan goes, HSDP): the poisoned step is the second of three.
SKIPS = [(1, "fp32", None, "loss", False), (2, "bf16", 1.0, "grad", False),
         (3, "fp32", 1.0, "grad", False), (3, "bf16", None, "loss", True),
         (2, "fp16", 1.0, "grad", False)]


def skip_runs(rank, world):
    """Each case: whether every step was skipped where expected, the state right after
    the poisoned step against the state before it, and the final state against a run that
    never saw the poisoned batch (fp16: whether its scale was lowered instead)."""
    out = []
    for stage, precision, clip, where, hsdp in SKIPS:
        group = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) \
            if hsdp else None
        data = batches(3, 1, world)
        model, opt = build(stage, precision, group)
        poisoned_steps(model, opt, data[:1], rank, world, clip=clip)
        before = full_state(model, opt)
        skipped = poisoned_steps(model, opt, data[1:2], rank, world, (0, world - 1, where),
                                 clip=clip)
        unchanged = same(before, full_state(model, opt))
        skipped += poisoned_steps(model, opt, data[2:], rank, world, clip=clip)
        if precision == "fp16":
            alike = opt.state_dict()["zerofn_loss_scaler"]["scale"] == 2.0 ** 7
        else:
            clean, clean_opt = build(stage, precision, group)
            poisoned_steps(clean, clean_opt, data[::2], rank, world, clip=clip)
            alike = same(full_state(model, opt), full_state(clean, clean_opt))
        out.append((skipped, unchanged, alike))
    return out


def test_skip_leaves_every_rank_as_if_the_step_never_came():
    """"skip" (the default): masters, moments and the step count stay as they were on
    every rank (the nan in one rank's rows), and the run then goes on bit for bit as one
    that never saw that batch; clipping, HSDP (the vote over both dims) and fp16 (the
    scaler's skip, its scale lowered) alike. (World 1: tools/fault_campaign.py's
    nonfinite row, whose short version the suite runs.)"""
    for rank_out in run_ranks(2, skip_runs, timeout=300):
        for case, (skipped, unchanged, alike) in zip(SKIPS, rank_out):
            assert skipped == [True, False], case
            assert unchanged and alike, case


def raise_runs(rank, world, stage, precision, clip):
    """The nan in POISONED's rows on the last rank only, under "raise": the error on this
    rank, whether the state is as before, and whether training then goes on."""
    data = batches(3, 1, world)
    model, opt = build(stage, precision, on_nonfinite="raise")
    poisoned_steps(model, opt, data[:1], rank, world, clip=clip)
    before = full_state(model, opt)
    message = error_of(poisoned_steps, model, opt, data[1:2], rank, world,
                       (0, world - 1, "grad"), clip=clip, error=zf.NonFiniteGradient)
    unchanged = same(before, full_state(model, opt))
    opt.zero_grad()                # the loop caught it: the next step is a clean one
    poisoned_steps(model, opt, data[2:], rank, world, clip=clip)
    after = full_state(model, opt)
    return message, unchanged, not same(before, after) and all(
        bool(v.isfinite().all()) for v in after.values() if v.is_floating_point())


@pytest.mark.parametrize("stage, precision, clip", [(2, "bf16", None), (3, "fp32", 1.0)])
def test_raise_names_the_step_and_the_parameter_on_every_rank(stage, precision, clip):
    messages = []
    for message, unchanged, goes_on in run_ranks(2, raise_runs, stage, precision, clip):
        assert message is not None, "a rank did not raise"
        assert "step 2" in message and f"the gradient of {POISONED!r} holds nan" in message \
            and "rank 1's rows" in message and "nothing was stepped" in message, message
        assert unchanged and goes_on
        messages.append(message)
    assert messages[0] == messages[1]


def ignore_runs(rank, world):
    """"ignore": the nan reaches the weights, as in plain PyTorch."""
    model, opt = build(2, "bf16", on_nonfinite="ignore")
    data = batches(2, 1, world)
    skipped = poisoned_steps(model, opt, data, rank, world, (1, 0, "loss"))
    msd, _ = zf.get_state_dict(model, opt, full=True)
    return skipped, sum(bool(v.isnan().any()) for v in msd.values())


def test_ignore_takes_the_step_as_plain_pytorch_does():
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    for (x, y), in batches(1, 1, 1):
        (ref(x, y) * NAN).backward()
    ref_opt.step()
    expected = sum(bool(v.isnan().any()) for v in ref.state_dict().values())
    [(skipped, nans)] = run_ranks(1, ignore_runs)
    assert skipped == [False, False] and nans == expected > 0


def refusal_runs(rank, world):
    """What each refused combination says, on this rank, before any collective."""
    def message(stage, precision, **options):
        return error_of(build, stage, precision, **options)
    return [message(2, "fp16", on_nonfinite="raise"), message(2, "fp16", on_nonfinite="ignore"),
            error_of(zf.shard_grads, on_nonfinite="drop"),
            error_of(build_parity, 2, "adamw", zf.offload("cpu", overlap_step=True),
                     on_nonfinite="skip")]


def overlap_runs(rank, world):
    """Under overlap_step the default is "raise", and the error says the host had stepped
    units during backward (with the loss's nan in their gradients)."""
    model, opt = build_parity(2, "adamw", zf.offload("cpu", overlap_step=True), bucket_size=2000)
    data = batches(2, 1, world)
    poisoned_steps(model, opt, data[:1], rank, world)
    return error_of(poisoned_steps, model, opt, data[1:], rank, world, (0, 0, "loss"),
                    error=zf.NonFiniteGradient)


def test_what_the_guard_cannot_keep_is_refused_at_set_up():
    for messages in run_ranks(2, refusal_runs):
        fp16_raise, fp16_ignore, bad, overlap_skip = messages
        for m, given in ((fp16_raise, "raise"), (fp16_ignore, "ignore")):
            assert m and f"on_nonfinite={given!r}: under loss scaling" in m, m
        assert bad and "on_nonfinite='drop'" in bad and "'skip' or 'raise' or 'ignore'" in bad
        assert overlap_skip and "on_nonfinite='skip': offload(overlap_step=True)" in overlap_skip
    for m in run_ranks(2, overlap_runs):
        assert m and "step 2" in m and "had already stepped" in m and "resume from" in m, m


def tensorboard_runs(rank, world, logdir):
    model, opt = build_parity(1, "adamw", zf.tensorboard(logdir, every=3))
    poisoned_steps(model, opt, batches(3, 1, world), rank, world, (1, 0, "loss"))
    zf.flush_logs(model)


def test_skips_are_counted_in_tensorboard(tmp_path):
    run_ranks(1, tensorboard_runs, str(tmp_path))
    acc = read(str(tmp_path))
    assert scalars(acc, "nonfinite/skipped") == {3: 1.0}
    assert scalars(acc, "train/skipped_steps") == {3: 1.0}


def flag_runs(rank, world):
    """``zerofn train --on-nonfinite``: the refusals, and the rule each job's plan takes."""
    def resolved(*argv):
        return train.resolve(train.parse_args(list(argv)), torch.device("cpu"))
    refused = [error_of(resolved, "--precision", "fp16", "--on-nonfinite", "raise"),
               error_of(resolved, "--offload", "cpu", "--stage", "2", "--clip", "0",
                        "--overlap-step", "--on-nonfinite", "skip")]
    rules = [plan_of(job_transforms(resolved(*argv))[0]).nonfinite_rule()
             for argv in ([], ["--on-nonfinite", "ignore"])]
    return refused, rules


def test_zerofn_train_takes_the_option_as_a_flag():
    [(refused, rules)] = run_ranks(1, flag_runs)
    assert "--on-nonfinite raise with --precision fp16" in refused[0], refused
    assert "--on-nonfinite skip with --overlap-step" in refused[1], refused
    assert rules == ["skip", "ignore"]
