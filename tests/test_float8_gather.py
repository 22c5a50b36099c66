"""torchao's float8 training weights under ZeRO-3, gathered in float8 as FSDP2 gathers them.

``convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each Linear weight a ``WeightWithDynamicFloat8CastTensor``: its pre-hook casts a rank's
rows to float8 (one scale for the whole weight, its amax all-reduced over the ranks), and its
post-hook builds a ``Float8TrainingTensor``, a tensor subclass, that the forward and backward
matmuls use as they are. zerofn must compute with that subclass, reduce its gradient like
any other, and land where FSDP2 lands, gathering a quarter of fp32's bytes."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zerofn as zf
from support.compare import TOL, worst
from support.errors import error_of
from support.ranks import run_ranks
from support.subclass import computed_with
from zerofn.checkpoint import load_checkpoint, save_checkpoint

# Found, not imported: torchao's import patches torch (inductor, pytree) in the process that
# runs the tests; only the ranks, processes of their own, import it.
pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed, so float8 training weights cannot be built (set-up "
           "installs it with the tests' extras; an offline set-up goes on without it)")]

STEPS = 4
SIZES = (32, 64, 32, 16)        # features: each divisible by 16, as float8 matmuls need
LAYERS = (0, 2, 4)              # the Linear layers: each a unit (zerofn), a fully_shard (FSDP2)


def convert(model: nn.Module) -> nn.Module:
    """torchao's float8 training conversion, its weights gathered in float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def float8_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return convert(nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(),
                                 nn.Linear(SIZES[1], SIZES[2]), nn.ReLU(),
                                 nn.Linear(SIZES[2], SIZES[3])))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.randn(16, SIZES[0],
                       generator=torch.Generator().manual_seed(step)).chunk(world)[rank]


def train(model, opt, rank: int, world: int) -> tuple[list[float], list]:
    """Each step's loss, and what the second layer's forward computed with
    (``computed_with``: the weight's type, and whether its float8 bytes outlived the
    forward; its input needs a gradient, so autograd saves its weight)."""
    seen = []
    handle, look = computed_with(model[2], seen)
    losses = []
    for step in range(STEPS):
        loss = model(batch(step, rank, world)).pow(2).mean()
        look()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    handle.remove()
    return losses, [tuple(s) for s in seen]


# zerofn's transforms on top of ZeRO-3, and FSDP2's policy for the same, by name.
VARIANTS = {
    "fp32": ((), None),
    "bf16": ((zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32),),
             MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "offload": ((zf.offload("cpu", params=True),), None),
}


def zerofn_model(variant: str = "fp32", seed: int = 0):
    model = zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                       zf.shard_params(units=[str(i) for i in LAYERS]),
                       *VARIANTS[variant][0])(float8_model(seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp2_model(world: int, variant: str = "fp32", seed: int = 0):
    model, mesh = float8_model(seed), init_device_mesh("cpu", (world,))
    policy = VARIANTS[variant][1]
    mp = {} if policy is None else {"mp_policy": policy}
    for i in LAYERS:
        fully_shard(model[i], mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def zerofn_run(rank: int, world: int, variant: str) -> dict:
    model, opt = zerofn_model(variant)
    shard = model[0].weight.to_local()
    out = {"shard": (type(shard).__name__, tuple(shard.shape))}
    out["losses"], out["kept"] = train(model, opt, rank, world)
    stats = zf.comm_stats(model)
    out["bytes"] = stats["subclass_all_gather_bytes"]
    # The gradient of one more backward, as the loop sees it: plain rows.
    model(batch(0, rank, world)).pow(2).mean().backward()
    grad = model[0].weight.grad.to_local()
    out["grad"] = (type(grad).__name__, grad.dtype == model[0].bias.grad.to_local().dtype,
                   tuple(grad.shape))
    opt.zero_grad()
    # Its optimizer state, as a state dict shows it: plain rows too.
    state = zf.get_state_dict(model, opt)[1]["state"]["0.weight"]
    out["state"] = {k: type(v.to_local()).__name__ for k, v in state.items() if v.dim()}
    msd, _ = zf.get_state_dict(model, opt, full=True)
    out["weights"] = {k: v.detach().clone() for k, v in msd.items()}
    return out


def fsdp2_run(rank: int, world: int, variant: str) -> dict:
    model, opt = fsdp2_model(world, variant)
    out = {}
    out["losses"], out["kept"] = train(model, opt, rank, world)
    msd, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out["weights"] = {k: v.detach().clone() for k, v in msd.items()}
    return out


def plain_run(rank: int, world: int) -> dict:
    """Plain PyTorch, one process, the whole batch: the same conversion, the weight cast
    to float8 by the forward itself instead of by the gather."""
    model = float8_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {}
    out["losses"], _ = train(model, opt, 0, 1)
    out["weights"] = {k: (v._tensor if hasattr(v, "_tensor") else v).detach().clone()
                      for k, v in model.state_dict().items()}
    return out


def every_variant(rank: int, world: int, variants: tuple) -> dict:
    """Per variant, one after another on the same ranks (each rank imports torchao once):
    zerofn's run, FSDP2's, and on one rank plain PyTorch's."""
    return {variant: (zerofn_run(rank, world, variant), fsdp2_run(rank, world, variant),
                      plain_run(0, 1) if world == 1 else None) for variant in variants}


def float8_bytes(world: int) -> int:
    """What the pre-hooks send in a step: each weight's rows on a rank as float8 (a byte
    each), padded to 16 bytes, from every rank, at the forward's gather and backward's."""
    shapes = list(zip(SIZES[1:], SIZES[:-1]))
    return 2 * world * sum(-(-(r // world) * c // 16) * 16 for r, c in shapes)


GATHERS = [(1, "fp32"), (2, "fp32"), (2, "bf16"), (2, "offload")]


@pytest.mark.parametrize("world,variant", GATHERS)
def test_float8_weights_gather_in_float8_and_train_as_under_fsdp2(world, variant, shared_runs):
    """Against FSDP2 with the same conversion; on one rank against plain PyTorch too (the
    weight cast by the forward: the same float8 values as the gather's). (Every variant of
    a world from one run of its ranks.)"""
    variants = tuple(v for w, v in GATHERS if w == world)
    for by_variant in shared_runs(world, every_variant, variants, timeout=300):
        ours, fsdp2, plain = by_variant[variant]
        # Sharded as FSDP2 shards it: the float8 wrapper over this rank's rows.
        assert ours["shard"] == ("WeightWithDynamicFloat8CastTensor",
                                 (SIZES[1] // world, SIZES[0]))
        # The forward computes with the post-hook's float8 tensor, and autograd keeps no
        # copy of it until backward (rebuilt from backward's gather), as under FSDP2.
        assert ours["kept"] == [("Float8TrainingTensor", False)] * STEPS, ours["kept"]
        # (FSDP2 keeps the tensor, its storage freed: resized to 0 bytes)
        assert [t for t, _ in fsdp2["kept"]] == ["Float8TrainingTensor"] * STEPS
        # Its gradient comes back plain, this rank's rows in the dtype of any other
        # parameter's (its bias's).
        assert ours["grad"] == ("Tensor", True, (SIZES[1] // world, SIZES[0])), ours["grad"]
        assert ours["state"] == {"exp_avg": "Tensor", "exp_avg_sq": "Tensor"}, ours["state"]
        for name, ref in (("FSDP2", fsdp2), ("plain PyTorch", plain)):
            if ref is None:
                continue
            error = max(worst(ours["weights"][k] - v) for k, v in ref["weights"].items())
            print(f"world {world}, {variant}: weights {error:.3g} from {name}'s")
            if variant == "offload":   # (zerofn's host Adam rounds otherwise than AdamW)
                assert error < TOL and \
                    ours["losses"] == pytest.approx(ref["losses"], rel=1e-6), \
                    (name, error, ours["losses"], ref["losses"])
            else:                      # bit for bit, every step
                assert ours["losses"] == ref["losses"] and error == 0, \
                    (name, error, ours["losses"], ref["losses"])
        # float8 on the wire: a quarter of fp32's bytes.
        fp32 = 2 * 4 * sum(r * c for r, c in zip(SIZES[1:], SIZES[:-1]))
        assert ours["bytes"] == float8_bytes(world) == fp32 // 4, (ours["bytes"], fp32)


def resumed(rank: int, world: int, root: str) -> tuple[list, list, list]:
    """zerofn's checkpoint after ``STEPS`` steps, read back by zerofn and by FSDP2 (torch's
    own DCP calls) into models that started elsewhere: the losses of ``STEPS`` more steps
    of the saved model, and of each reader."""
    model, opt = zerofn_model()
    train(model, opt, rank, world)
    ckpt = save_checkpoint(root, model, opt, step=STEPS)
    later = train(model, opt, rank, world)[0]
    again, again_opt = zerofn_model(seed=1)
    load_checkpoint(ckpt, again, again_opt)
    fsdp2, fsdp2_opt = fsdp2_model(world, seed=1)
    msd, osd = get_state_dict(fsdp2, fsdp2_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fsdp2, fsdp2_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return later, train(again, again_opt, rank, world)[0], train(fsdp2, fsdp2_opt, rank, world)[0]


def test_a_float8_checkpoint_resumes_under_zerofn_and_under_fsdp2(tmp_path):
    for later, zerofn_losses, fsdp2_losses in run_ranks(2, resumed, str(tmp_path), timeout=300):
        assert zerofn_losses == later and fsdp2_losses == later, \
            (later, zerofn_losses, fsdp2_losses)


def uneven(rank: int, world: int) -> str | None:
    """A last layer of 17 rows over 2 ranks: 9 and 8. torchao's pre-hook does not pad the
    short share; every rank calls it at set-up (it all-reduces the amax), and all refuse."""
    model = float8_model()
    model[4] = convert(nn.Linear(SIZES[2], 17))
    return error_of(zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                               zf.shard_params(units=[str(i) for i in LAYERS])), model)


def test_float8_rows_that_do_not_divide_over_the_ranks_are_refused_on_every_rank():
    for message in run_ranks(2, uneven, timeout=300):
        assert "set-up failed on rank 1: fsdp_pre_all_gather of '4.weight' returned tensors " \
            "of shapes [(8, 32)] for this rank's 8 rows; every rank's must have the padded " \
            "share, 9 rows" in message, message
