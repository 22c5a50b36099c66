"""Weights that are tensor subclasses with FSDP2's all-gather hooks (float8 training's, a
quantized gather's): ZeRO-3 gathers what ``fsdp_pre_all_gather`` gives, in its dtype, and
computes with what ``fsdp_post_all_gather`` builds, as FSDP2 does. ``Int8Gathered`` gathers
each row as int8 codes and a scale, so the weights a model trains on are rounded by the
gather: zerofn must round them as FSDP2 does, and move a quarter of the bytes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.utils.parametrize
import torch.utils.checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zerofn as zf
from support.compare import TOL
from support.errors import error_of
from support.ranks import run_ranks
from support.subclass import (HOOK_CALLS, Int8Built, Int8Contagious, Int8Flat, Int8Gathered,
                              Int8Unpadded, PreHookOnly, computed_with, quantize_rows)
from zerofn.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.multirank

STEPS, WIDTH = 4, 32
LAYERS = ("0", "2", "4")      # the Linear layers: each a unit (zerofn), a fully_shard (FSDP2)


def subclass_model(seed: int = 0, hooked: bool = True, out: int = 4,
                   kind: type = Int8Gathered) -> nn.Sequential:
    """An MLP whose Linear weights are ``kind`` (``hooked``) or plain; ``out``: the last
    layer's rows."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH),
                          nn.ReLU(), nn.Linear(WIDTH, out))
    for i in LAYERS if hooked else ():
        model[int(i)].weight = nn.Parameter(kind(model[int(i)].weight.detach()))
    return model


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]


def train(model, opt, rank, world, steps=range(STEPS),
          look=None) -> tuple[list[float], list[dict]]:
    """The ``steps``' batches; each step's loss and hook calls; ``look()`` is called between
    each forward and its backward."""
    losses, calls = [], []
    for step in steps:
        HOOK_CALLS.clear()
        loss = model(batch(step, rank, world)).pow(2).mean()
        if look is not None:
            look()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        calls.append(dict(HOOK_CALLS))
    return losses, calls


def zerofn_model(seed: int = 0, *extra, kind: type = Int8Gathered):
    model = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(
        units=list(LAYERS)), *extra)(subclass_model(seed, kind=kind))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp2_model(world: int, policy=None, kind: type = Int8Gathered):
    model, mesh = subclass_model(kind=kind), init_device_mesh("cpu", (world,))
    mp = {} if policy is None else {"mp_policy": policy}
    for i in LAYERS:
        fully_shard(model[int(i)], mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_weights(model, opt, fsdp2: bool) -> dict:
    if fsdp2:
        msd, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    else:
        msd, _ = zf.get_state_dict(model, opt, full=True)
    return {k: v.detach().clone() for k, v in msd.items()}


def gathered_bytes(world: int) -> int:
    """What Int8Gathered's hooks gather in a step: each weight's padded rows as int8 and a
    fp32 scale a row, each padded to 16 bytes, from every rank, at the forward's gather and
    backward's."""
    def align(n):
        return -(-n // 16) * 16
    shapes = [(2 * WIDTH, WIDTH), (WIDTH, 2 * WIDTH), (4, WIDTH)]
    per_rank = sum(align(-(-r // world) * c) + align(-(-r // world) * 4) for r, c in shapes)
    return 2 * world * per_rank


def plain_bytes(world: int) -> int:
    """What the units' own all-gathers move in a step: the fp32 biases alone, each rank's
    rows padded to 16 elements, at the forward's gather and backward's."""
    return 2 * 4 * world * sum(-(-(-(-b // world)) // 16) * 16 for b in (2 * WIDTH, WIDTH, 4))


def zerofn_to_fsdp2(rank, world, root):
    """zerofn's checkpoint read by FSDP2 through torch's own DCP calls; both train on."""
    model, opt = zerofn_model()
    train(model, opt, rank, world)
    ckpt = save_checkpoint(root, model, opt, step=STEPS)
    fmodel, fopt = fsdp2_model(world)
    msd, osd = get_state_dict(fmodel, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fmodel, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_weights(fmodel, fopt, True), full_weights(model, opt, False)
    return loaded, train(fmodel, fopt, rank, world)[0], train(model, opt, rank, world)[0]


def fsdp2_to_zerofn(rank, world, root):
    """FSDP2's DCP checkpoint (its optimizer state is Int8Gathered too: zeros_like keeps
    the subclass, so the files pickle it) loaded by zerofn, the class trusted."""
    fmodel, fopt = fsdp2_model(world)
    train(fmodel, fopt, rank, world)
    msd, osd = get_state_dict(fmodel, fopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    model, opt = zerofn_model(seed=3)
    zf.trust_class(Int8Gathered)
    zf.trust_class(torch._utils._rebuild_wrapper_subclass)
    load_checkpoint(root, model, opt)
    loaded = full_weights(fmodel, fopt, True), full_weights(model, opt, False)
    return loaded, train(fmodel, fopt, rank, world)[0], train(model, opt, rank, world)[0]


@pytest.mark.parametrize("move", [zerofn_to_fsdp2, fsdp2_to_zerofn])
def test_checkpoints_move_between_zerofn_and_fsdp2_and_training_goes_on_the_same(move, tmp_path):
    for (fsdp2_w, zerofn_w), fsdp2_losses, zerofn_losses in run_ranks(2, move, str(tmp_path),
                                                                       timeout=300):
        for k, v in fsdp2_w.items():
            assert torch.equal(zerofn_w[k], v), k
        assert fsdp2_losses == zerofn_losses, (fsdp2_losses, zerofn_losses)


class RoundTrip(torch.autograd.Function):
    """The weight as Int8Gathered's hooks gather it whole (one rank), its gradient passed
    straight through to the full-precision weight, as a gather's is."""

    @staticmethod
    def forward(ctx, weight):
        codes, scale = quantize_rows(weight)
        return codes.float() * scale

    @staticmethod
    def backward(ctx, grad):
        return grad


class Rounded(nn.Module):
    def forward(self, weight):
        return RoundTrip.apply(weight)


def rounded_model(out: int = 4):
    """Plain PyTorch on one process, rounding its weights as the gather does."""
    model = subclass_model(hooked=False, out=out)
    for i in LAYERS:
        torch.nn.utils.parametrize.register_parametrization(model[int(i)], "weight", Rounded())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def weights_of_rounded(model) -> dict:
    return {k.replace(".parametrizations.weight.original", ".weight"): v.detach().clone()
            for k, v in model.state_dict().items()}


# Where the masters, state and (params=True) parameter shards live, by name.
OFFLOADS = {None: lambda path: (), "state": lambda path: (zf.offload("cpu"),),
            "params": lambda path: (zf.offload("cpu", params=True),),
            "nvme": lambda path: (zf.offload("nvme", path=path, params=True),)}


def against_reference(rank, world, offload, path, kind, references: dict):
    """zerofn's training, and (``references``, filled here on a kind's first case) the
    reference's: FSDP2 at two ranks, plain PyTorch rounding as the gather does at one, and
    plain PyTorch without the rounding."""
    model, opt = zerofn_model(0, *OFFLOADS[offload](path), kind=kind)
    shard = model[0].weight
    out = {"shard": (type(shard).__name__, type(shard.to_local()).__name__,
                     tuple(shard.to_local().shape))}
    out["seen"] = []
    handle, look = computed_with(model[2], out["seen"])
    out["zerofn"] = train(model, opt, rank, world, look=look)
    handle.remove()
    out["stats"] = dict(zf.comm_stats(model))
    out["zerofn_w"] = full_weights(model, opt, fsdp2=False)
    if kind not in references:
        references[kind] = _reference(rank, world, kind)
    return {**out, **references[kind]}


def _reference(rank, world, kind):
    out = {}
    if world > 1:
        fmodel, fopt = fsdp2_model(world, kind=kind)
        out["ref"] = train(fmodel, fopt, rank, world)
        out["ref_w"] = full_weights(fmodel, fopt, fsdp2=True)
    else:   # (FSDP2 on one rank gathers a subclass's first pre-hook output only: torch 2.13)
        ref, ref_opt = rounded_model()
        out["ref"] = train(ref, ref_opt, rank, world)
        out["ref"] = (out["ref"][0], [{"pre": 6, "post": 6}] * STEPS)   # (no hooks there)
        out["ref_w"] = weights_of_rounded(ref)
    plain = subclass_model(hooked=False)          # the same training without the rounding
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        plain(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))) \
            .pow(2).mean().backward()
        popt.step()
        popt.zero_grad()
    out["plain_w"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    return out


def every_against_reference(rank, world, path, cases):
    """``against_reference`` for each (offload, kind) of ``cases``, one after another on
    the same ranks, the references of a kind trained once."""
    references: dict = {}
    return {(offload, kind): against_reference(rank, world, offload, path, kind, references)
            for offload, kind in cases}


GATHERS = [(1, None, Int8Gathered), (2, None, Int8Gathered), (2, "state", Int8Gathered),
           (2, "params", Int8Gathered), (2, "nvme", Int8Gathered),
           (1, None, Int8Built), (2, None, Int8Built), (2, "params", Int8Built)]


@pytest.mark.parametrize("world,offload,kind", GATHERS)
def test_zero3_gathers_through_the_hooks_as_fsdp2_does(world, offload, kind, shared_runs, nvme_dir):
    """Two ranks against FSDP2 on the same subclass model, also offloaded (the pre-hook
    then runs on the host rows, and its outputs are what goes to the device); one rank
    against plain PyTorch rounding its weights as the gather does. ``Int8Built``'s
    post-hook builds a tensor subclass, as float8 training's does: the module computes
    with it and its gradient is reduced like any other. (Every case of a world from one
    run of its ranks: ``every_against_reference``.)"""
    cases = tuple((o, k) for w, o, k in GATHERS if w == world)
    for by_case in shared_runs(world, every_against_reference, nvme_dir, cases, timeout=300):
        out = by_case[offload, kind]
        # The registered shard is the subclass over this rank's rows, as FSDP2's is.
        assert out["shard"] == ("DTensor", kind.__name__, (2 * WIDTH // world, WIDTH))
        # The forward computes with what the post-hook built; a subclass, autograd keeps
        # none of until backward (it is rebuilt from backward's gather).
        built = [["Dequantized", False]] if kind is Int8Built else [["Parameter", False]]
        assert out["seen"] == built * STEPS, out["seen"]
        (z_loss, z_calls), (f_loss, f_calls) = out["zerofn"], out["ref"]
        error = max((out["zerofn_w"][k] - v).abs().max().item() for k, v in out["ref_w"].items())
        if offload:   # (zerofn's host Adam, not torch's AdamW: rounded otherwise)
            assert error < TOL and z_loss == pytest.approx(f_loss, rel=1e-6), \
                (error, z_loss, f_loss)
        else:         # bit for bit, every step
            assert z_loss == f_loss and error == 0, (error, z_loss, f_loss)
        # Each weight is gathered at the forward and again at backward: both hooks run
        # twice a step for each, as under FSDP2.
        assert z_calls == f_calls == [{"pre": 6, "post": 6}] * STEPS, (z_calls, f_calls)
        # The weights travel as int8 and scales; only the biases in their own fp32.
        stats = out["stats"]
        assert stats["subclass_all_gather_bytes"] == gathered_bytes(world), stats
        fp32 = 2 * 4 * sum(p.numel() for p in subclass_model(hooked=False).parameters()
                           if p.dim() == 2)
        assert stats["subclass_all_gather_bytes"] < 0.3 * fp32, stats
        assert stats["all_gather_bytes"] == plain_bytes(world), stats
        # The rounding is real: the same training on plain weights ends elsewhere.
        moved = max((out["zerofn_w"][k] - v).abs().max().item()
                    for k, v in out["plain_w"].items())
        assert moved > 1e-4, moved


def mixed(rank, world):
    """bf16 compute, fp32 reduction and masters: the pre-hook reads the fp32 masters and
    the post-hook builds a bf16 weight, under zerofn and FSDP2 alike."""
    model, opt = zerofn_model(0, zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32))
    losses = train(model, opt, rank, world)
    fmodel, fopt = fsdp2_model(world, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    return (losses, train(fmodel, fopt, rank, world), full_weights(model, opt, False),
            full_weights(fmodel, fopt, True))


def test_mixed_precision_gathers_through_the_hooks_as_fsdp2_does():
    for ours, theirs, weights, fsdp2_weights in run_ranks(2, mixed, timeout=300):
        assert ours == theirs, (ours, theirs)       # losses and hook calls, every step
        for k, v in fsdp2_weights.items():
            assert torch.equal(weights[k], v), (k, (weights[k] - v).abs().max())


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed(rank, world, reentrant):
    """``Int8Built`` weights, the middle layer's forward recomputed in backward (the
    subclass compute weight given to it there), against the same without recomputing."""
    def run(wrap):
        model = subclass_model(kind=Int8Built)
        if wrap:
            model[2] = Checkpointed(model[2], reentrant)
        model = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(
            units=["0", "2.inner" if wrap else "2", "4"]))(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train(model, opt, rank, world)[0]
        weights = {k.replace(".inner", ""): v for k, v in full_weights(model, opt, False).items()}
        return losses, weights

    return run(True), run(False)


def assert_same_training(ours, theirs) -> None:
    """Two trainings' ``(losses, full weights)``: equal, bit for bit."""
    (losses, weights), (their_losses, their_weights) = ours, theirs
    assert losses == their_losses, (losses, their_losses)
    for k, v in their_weights.items():
        assert torch.equal(weights[k], v), k


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_subclass_compute_weight_under_activation_checkpointing(reentrant):
    for recomputed, kept in run_ranks(2, checkpointed, reentrant, timeout=300):
        assert_same_training(recomputed, kept)


def accumulated(rank, world):
    """Two micro-batches a step, the first under ``no_sync``: ``Int8Built`` (its compute
    weight a subclass) against ``Int8Gathered`` (the same values as a plain tensor)."""
    def run(kind):
        model, opt = zerofn_model(kind=kind)
        losses = []
        for step in range(STEPS):
            with model.no_sync():
                model(batch(2 * step, rank, world)).pow(2).mean().backward()
            loss = model(batch(2 * step + 1, rank, world)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, full_weights(model, opt, False)

    return run(Int8Built), run(Int8Gathered)


def test_a_subclass_compute_weight_accumulates_under_no_sync_as_a_plain_one():
    for built, plain in run_ranks(2, accumulated, timeout=300):
        assert_same_training(built, plain)


def uneven(rank, world):
    """A last layer of 5 rows over 2 ranks: 3 and 2, the short shard padded by the hook;
    against plain PyTorch on the whole batch, rounding its weights as the gather does."""
    model = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(
        units=list(LAYERS)))(subclass_model(out=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = model[4].weight.to_local().shape[0]
    train(model, opt, rank, world)
    ref, ref_opt = rounded_model(out=5)
    train(ref, ref_opt, 0, 1)
    ours = full_weights(model, opt, False)
    return rows, max((ours[k] - v).abs().max().item()
                     for k, v in weights_of_rounded(ref).items())


def test_uneven_rows_are_gathered_through_the_hooks_padding():
    shards = run_ranks(2, uneven, timeout=300)
    assert [rows for rows, _ in shards] == [3, 2]
    assert max(error for _, error in shards) < TOL, shards


def subclass_built(rank, world):
    """A post-hook building a subclass of another shape than the weight's, and one whose
    gradient comes back a subclass (the last layer's, the first backward reaches)."""
    def step(model):
        model(batch(0, rank, world)).pow(2).mean().backward()

    def model_with(i, kind):
        model = subclass_model(hooked=False)
        model[i].weight = nn.Parameter(kind(model[i].weight.detach()))
        return zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                          zf.shard_params(units=list(LAYERS)))(model)

    return (error_of(step, model_with(0, Int8Flat), error=TypeError),
            error_of(step, model_with(4, Int8Contagious), error=TypeError))


def test_a_post_hook_building_what_zerofn_cannot_compute_with_is_refused_on_every_rank():
    for flat, contagious in run_ranks(2, subclass_built, timeout=300):
        assert "fsdp_post_all_gather of '0.weight' returned a Dequantized of shape (2048,); " \
            "zerofn computes with a plain tensor of at least the parameter's 2048 elements, " \
            "or a tensor subclass of its shape (64, 32)" in flat, flat
        assert "the gradient of '4.weight''s gathered weight came back as a Contagious; " \
            "zerofn reduces a plain tensor" in contagious, contagious


def on_top(rank, world):
    """ZeRO-3, then offload applied on top after two steps (the model is rebuilt from its
    restored parameters: still Int8Gathered, holding the trained values), against the two
    composed from the start."""
    model, opt = zerofn_model()
    first = train(model, opt, rank, world, range(2))[0]
    model = zf.offload("cpu")(model)
    kept = type(model[0].weight.to_local()).__name__
    later = train(model, opt, rank, world, range(2, STEPS))[0]
    whole, whole_opt = zerofn_model(0, zf.offload("cpu"))
    return kept, first + later, train(whole, whole_opt, rank, world)[0]


def test_a_transform_applied_on_top_keeps_gathering_through_the_hooks():
    for kept, stepwise, composed in run_ranks(2, on_top, timeout=300):
        assert kept == "Int8Gathered"
        assert stepwise == pytest.approx(composed, rel=1e-6), (stepwise, composed)


def round_trip(rank, world, root):
    model, opt = zerofn_model()
    train(model, opt, rank, world)
    ckpt = save_checkpoint(root, model, opt, step=STEPS)
    later = train(model, opt, rank, world)[0]
    again, again_opt = zerofn_model(seed=5)      # other weights, overwritten by the load
    assert load_checkpoint(ckpt, again, again_opt) == {"step": STEPS}
    assert type(again[0].weight.to_local()).__name__ == "Int8Gathered"
    return later, train(again, again_opt, rank, world)[0], \
        full_weights(model, opt, False), full_weights(again, again_opt, False)


def test_a_checkpoint_round_trips_and_training_goes_on_the_same(tmp_path):
    for later, resumed, weights, resumed_w in run_ranks(2, round_trip, str(tmp_path),
                                                         timeout=300):
        assert later == resumed, (later, resumed)
        for k, v in weights.items():
            assert torch.equal(resumed_w[k], v), k


def refusals(rank, world):
    def apply(model, *transforms):
        return zf.compose(*transforms)(model)

    one = subclass_model(hooked=False)
    one[0].weight = nn.Parameter(PreHookOnly(one[0].weight.detach()))
    short = subclass_model(hooked=False, out=5)
    short[4].weight = nn.Parameter(Int8Unpadded(short[4].weight.detach()))
    return {
        "zero2": error_of(apply, subclass_model(), zf.shard_optimizer(), zf.shard_grads()),
        "hybrid": error_of(apply, subclass_model(), zf.shard_optimizer(), zf.shard_grads(),
                           zf.shard_params(group=init_device_mesh(
                               "cpu", (2, 1), mesh_dim_names=("replicate", "shard")))),
        "mixed": error_of(apply, subclass_model(), zf.shard_optimizer(), zf.shard_grads(),
                          zf.shard_params(), zf.mixed_precision(torch.bfloat16),
                          zf.offload("cpu")),
        "one": error_of(apply, one, zf.shard_optimizer(), zf.shard_grads(), zf.shard_params()),
        "unpadded": error_of(apply, short, zf.shard_optimizer(), zf.shard_grads(),
                             zf.shard_params()),
    }


def test_what_is_not_gathered_through_the_hooks_yet_is_refused_on_every_rank():
    for out in run_ranks(2, refusals, timeout=300):
        what = "parameter '0.weight' is a Int8Gathered gathered by its FSDP2 hooks, and "
        assert what + "zerofn calls those hooks at ZeRO-3 only" in out["zero2"], out
        assert what + "hybrid sharding" in out["hybrid"], out
        assert what + "mixed precision (param_dtype) with offload" in out["mixed"], out
        assert "defines fsdp_pre_all_gather but not fsdp_post_all_gather" in out["one"], out
        # Only rank 1's shard is short, and both ranks say so.
        assert "set-up failed on rank 1: fsdp_pre_all_gather of '4.weight' returned tensors " \
            "of shapes [(2, 32), (2, 1)] for this rank's 2 rows; every rank's must have the " \
            "padded share, 3 rows" in out["unpadded"], out
