"""A model torch's tensor parallelism split (``parallelize_module`` on a (dp, tp) mesh of 4
gloo ranks) shards under zerofn as under FSDP2: the same weights after training, the same
placements of every parameter and state tensor, checkpoints that move both ways and to
other layouts; and what zerofn cannot shard is refused on every rank."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial

import zerofn as zf
import zerofn.optim.lowp as lowp
from support.compare import full_state, max_error
from support.errors import error_of
from support.loops import STAGES
from support.ranks import run_ranks
from support.subclass import Wrapped
from support.tp_models import TPModel, make_tp_model, mesh_clip, parallelize, tp_batches
from zerofn.optim.lowp import MIN_8BIT_NUMEL

pytestmark = pytest.mark.multirank

STEPS, ACCUM, ROWS, CLIP, LR = 5, 2, 4, 0.05, 1e-3
TOL = 1e-6


def zerofn_tp(stage: int, mesh, extra=(), seed: int = 0, sp: bool = False):
    """The model split by tensor parallelism over mesh["tp"], then ZeRO-``stage`` over
    ``mesh["dp"]`` (FSDP2's order: the optimizer built after)."""
    model = parallelize(make_tp_model(seed), mesh["tp"], sp)
    *first, last = STAGES[stage]
    model = zf.compose(*(getattr(zf, n)() for n in first),
                       getattr(zf, last)(group=mesh["dp"]), *extra)(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def fsdp2_tp(mesh, seed: int = 0, sp: bool = False, bf16: bool = False):
    """FSDP2 + TP; ``bf16``: computing in bf16, reducing in fp32 (zerofn's
    ``mixed_precision(torch.bfloat16, reduce_dtype=torch.float32)``)."""
    model = parallelize(make_tp_model(seed), mesh["tp"], sp)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(model, opt, data, mesh, poisoned=None):
    """Each data-parallel rank its rows (the tensor-parallel ranks of one the same), the
    micro-batches accumulated, the global norm clipped. ``poisoned``: (step, rank) whose
    first micro-batch's loss is made nan on that rank alone."""
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    for step, micro in enumerate(data):
        for i, (x, y) in enumerate(micro):
            loss = model(x.chunk(dp)[rank], y.chunk(dp)[rank]) / len(micro)
            if (step, torch.distributed.get_rank(), i) == (*(poisoned or (None, None)), 0):
                loss = loss * float("nan")
            loss.backward()
        if zf.is_transformed(model):
            zf.clip_grad_norm_(model, CLIP)
        else:
            mesh_clip(model, CLIP)
        opt.step()
        opt.zero_grad()


def fsdp2_full(model, opt):
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return ({k: v.clone() for k, v in msd.items()},
            {"state": {f: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                       for f, st in osd["state"].items()}})


def layouts(model, opt, sharded_state, params: bool = True) -> dict:
    """Every state tensor's placements by name and, where ``params`` (ZeRO-3: sharded
    parameters, as FSDP2's), every parameter's."""
    out = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()} \
        if params else {}
    for fqn, st in sharded_state["state"].items():
        out.update({f"{fqn}.{k}": str(v.placements) for k, v in st.items()
                    if isinstance(v, DTensor)})
    return out


# name: (stage, the transforms after it, given the NVMe directory). Each trains as FSDP2 + TP
# in fp32, but "bf16" (as FSDP2 with the same MixedPrecisionPolicy) and "nonfinite" (a nan
# on one rank at step POISONED: skipped on every rank, so as FSDP2 without that step).
CONFIGS = {"zero1": (1, lambda tmp: ()), "zero2": (2, lambda tmp: ()),
           "zero3": (3, lambda tmp: ()), "zero3 cpu": (3, lambda tmp: (zf.offload("cpu"),)),
           "zero3 nvme": (3, lambda tmp: (zf.offload("nvme", path=tmp),)),
           "zero1 cpu ratio": (1, lambda tmp: (zf.offload("cpu", ratio=0.5),)),
           "zero2 placement": (2, lambda tmp: (zf.offload("cpu", path=tmp, placement={
               "blocks.0": "nvme", "<root>": "device"}),)),
           "zero3 nvme params": (3, lambda tmp: (zf.offload("nvme", path=tmp, params=True),)),
           "zero2 bf16 state": (2, lambda tmp: (zf.offload("cpu", state_dtype=torch.bfloat16),)),
           "zero3 int8 state": (3, lambda tmp: (zf.offload("cpu", state_dtype=torch.int8),)),
           "zero3 bf16": (3, lambda tmp: (zf.mixed_precision(torch.bfloat16,
                                                             reduce_dtype=torch.float32),)),
           "zero2 nonfinite": (2, lambda tmp: ())}
POISONED = (2, 3)        # (step, rank): tensor-parallel rank 1 of data-parallel rank 1
# Bounds other than TOL (weights and moments alike), about twice the gap measured, and why.
# bf16 moments (8 bits of mantissa, rounded stochastically) move each update by up to about
# 1 % of lr (1e-3): 2.6e-5 after 5 steps (6e-5 after 10). 8-bit codes hold a block's
# moments to 1/127 of its largest, which a moment far smaller than its block's largest
# loses most of: 3.3e-4 (5e-4 after 10). A piece laid out wrongly (codes of one rank's rows
# read as another's) is off by the weights' own size, 1e-2 and more.
TOLS = {"zero2 bf16 state": 6e-5, "zero3 int8 state": 7e-4}


def against_fsdp2(rank, world, sp, names, tmp):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = tp_batches(STEPS, ACCUM, ROWS)
    refs = {"fp32": (data, False), "bf16": (data, True),
            "nonfinite": (data[:POISONED[0]] + data[POISONED[0] + 1:], False)}
    want, want_layout = {}, None
    for ref in {_reference(n) for n in names}:
        ref_data, bf16 = refs[ref]
        model, opt = fsdp2_tp(mesh, sp=sp, bf16=bf16)
        train(model, opt, ref_data, mesh)
        want[ref] = fsdp2_full(model, opt)
        if ref == "fp32":
            want_layout = {zero3: layouts(model, opt, get_state_dict(model, opt)[1], zero3)
                           for zero3 in (False, True)}
    out = {}
    for name in names:
        stage, extra = CONFIGS[name]
        # Every piece in 8-bit codes: this model's are below the size that keeps fp32 moments.
        lowp.MIN_8BIT_NUMEL = 0 if "int8" in name else MIN_8BIT_NUMEL
        model, opt = zerofn_tp(stage, mesh, extra(tmp), sp=sp)
        train(model, opt, data, mesh, POISONED if name.endswith("nonfinite") else None)
        lowp.MIN_8BIT_NUMEL = MIN_8BIT_NUMEL
        got = full_state(model, opt)
        out[name] = (_gap(got, want[_reference(name)]),
                     layouts(model, opt, zf.get_state_dict(model, opt)[1], stage == 3)
                     == want_layout[stage == 3])
    return out


def _reference(name: str) -> str:
    """Which FSDP2 run config ``name`` is held to."""
    return next((ref for ref in ("bf16", "nonfinite") if name.endswith(ref)), "fp32")


def _gap(got, want) -> float:
    err = max((got[0][k] - v).abs().max().item() for k, v in want[0].items())
    for fqn, st in want[1]["state"].items():
        for k, v in st.items():
            err = max(err, (torch.as_tensor(got[1]["state"][fqn][k]).float()
                            - torch.as_tensor(v).float()).abs().max().item())
    return err


@pytest.mark.parametrize("sp,names", [(False, list(CONFIGS)),
                                      (True, ["zero1", "zero2", "zero3"])])
def test_each_stage_over_tensor_parallelism_trains_as_fsdp2_with_its_placements(sp, names,
                                                                                tmp_path):
    out = run_ranks(4, against_fsdp2, sp, names, str(tmp_path), timeout=600)
    for rank, by_name in enumerate(out):
        for name, (gap, same_layout) in by_name.items():
            assert gap < TOLS.get(name, TOL), (rank, name, gap)
            assert same_layout, (rank, name)


def checkpoints_both_ways(rank, world, root):
    """zerofn (2, 2) saves; FSDP2 + TP (2, 2) loads it, and saves; zerofn (2, 2) loads that.
    Each load holds the saved state exactly."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = tp_batches(3, ACCUM, ROWS)
    model, opt = zerofn_tp(3, mesh)
    train(model, opt, data, mesh)
    ckpt = zf.save_checkpoint(root, model, opt, step=3)
    saved = full_state(model, opt)
    fmodel, fopt = fsdp2_tp(mesh, seed=7)
    msd, osd = get_state_dict(fmodel, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fmodel, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    to_fsdp2 = _gap(fsdp2_full(fmodel, fopt), saved)
    msd, osd = get_state_dict(fmodel, fopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "fsdp2"))
    model, opt = zerofn_tp(2, mesh, seed=9)
    zf.load_checkpoint(os.path.join(root, "fsdp2"), model, opt)
    return to_fsdp2, _gap(full_state(model, opt), saved), saved


def without_tensor_parallelism(rank, world, root):
    """The (2, 2) checkpoint into the model never split by tensor parallelism: ZeRO-3 over
    every rank, or the plain model on one (zerofn's functions take it as it is)."""
    model = make_tp_model(5)
    if world > 1:
        model = zf.compose(*(getattr(zf, n)() for n in STAGES[3]))(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    zf.load_checkpoint(root, model, opt)
    return full_state(model, opt)


def test_checkpoints_move_to_fsdp2_and_back_and_to_layouts_without_tensor_parallelism(tmp_path):
    root = str(tmp_path)
    to_fsdp2, back, saved = run_ranks(4, checkpoints_both_ways, root, timeout=300)[0]
    assert to_fsdp2 == 0.0 and back == 0.0, (to_fsdp2, back)
    for world in (4, 1):
        assert _gap(run_ranks(world, without_tensor_parallelism, root, timeout=300)[0],
                    saved) == 0.0, world


def hybrid(rank, world, how):
    """HSDP x TP on (replicate 2, shard 1, tp 2): zerofn or FSDP2 over the 2-D data-parallel
    sub-mesh of one 3-D mesh."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh["replicate", "shard"]
    model = parallelize(make_tp_model(), mesh["tp"])
    if how == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    else:
        model = zf.compose(*(getattr(zf, n)() for n in STAGES[2]), zf.shard_params(group=dp))(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rows, replica = 2, mesh["replicate"].get_local_rank()
    for micro in tp_batches(STEPS // 2, ACCUM, ROWS):
        for x, y in micro:
            (model(x.chunk(rows)[replica], y.chunk(rows)[replica]) / len(micro)).backward()
        opt.step()
        opt.zero_grad()
    state = fsdp2_full(model, opt) if how == "fsdp2" else full_state(model, opt)
    return state, {n: str(p.placements) for n, p in model.named_parameters()}


def test_hybrid_sharding_with_tensor_parallelism_follows_fsdp2s():
    want, want_layout = run_ranks(4, hybrid, "fsdp2", timeout=300)[0]
    got, layout = run_ranks(4, hybrid, "zerofn", timeout=300)[0]
    assert _gap(got, want) < TOL and layout == want_layout


def refusals(rank, world):
    """What zerofn cannot shard, refused on every rank (before any collective but set-up's
    one), naming what to do."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    [(x, y)] = tp_batches(1, 1, ROWS)[0]
    out = {"none": error_of(zf.shard_params(), parallelize(make_tp_model(), mesh["tp"])),
           "overlapping": error_of(zf.shard_params(group=other["b"]),
                                   parallelize(make_tp_model(), mesh["tp"]))}
    model = make_tp_model()
    model.head.weight = torch.nn.Parameter(
        DTensor.from_local(model.head.weight.detach(), mesh["tp"], [Partial()]))
    out["partial"] = error_of(zf.shard_params(group=mesh["dp"]), model)
    model = zf.shard_grads(group=mesh["dp"])(make_tp_model())
    parallelize(model, mesh["tp"])        # after zerofn: its parameters replaced
    out["after"] = error_of(model, x, y)
    split = parallelize(make_tp_model(), mesh["tp"])
    out["plan"] = error_of(zf.plan, split, (x, y), world=2)
    out["auto"] = error_of(zf.auto, split, torch.optim.AdamW(split.parameters()), (x, y))
    return out


def test_what_zerofn_cannot_shard_is_refused_naming_what_to_do():
    for out in run_ranks(4, refusals, timeout=300):
        assert "are not slices of one mesh" in out["none"], out["none"]
        assert "Cannot concatenate overlapping meshes" in out["overlapping"], out["overlapping"]
        assert "take both from the same init_device_mesh" in out["overlapping"]
        assert "placement P(sum), which zerofn cannot shard over" in out["partial"], out["partial"]
        assert out["after"].startswith("zerofn: the model's parameter 'blocks.0.attn.q.weight' "
                                       "is no longer the one zerofn sharded"), out["after"]
        # (tests/test_plan_tensor_parallel.py: the plan over group=mesh["dp"])
        assert out["plan"].startswith("parameter 'blocks.0.attn.q.weight' is a DTensor"), \
            out["plan"]
        assert "group=mesh['dp']" in out["plan"], out["plan"]
        assert out["auto"].startswith("zf.auto does not apply a plan to a model tensor "
                                      "parallelism split (parameter 'blocks.0.attn.q.weight' "
                                      "is a DTensor)"), out["auto"]


def subclass_refused(rank, world, stage):
    model = make_tp_model()
    model.head.weight = torch.nn.Parameter(Wrapped(model.head.weight.detach()))
    return error_of(zf.compose(*(getattr(zf, n)() for n in STAGES[stage])), model)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_tensor_subclass_parameter_is_refused_on_every_rank_naming_the_way_out(stage):
    for out in run_ranks(2, subclass_refused, stage, timeout=300):
        assert "cannot shard parameter 'head.weight': its tensor is a Wrapped, a tensor " \
            "subclass" in out, out
        assert "FSDP2's fully_shard" in out, out


def built_on_meta(rank, world, stage, meta):
    """The model built on the meta device (or not), split by tensor parallelism, then
    ZeRO-``stage`` materializes it: its weights, whole, and what this rank holds."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = TPModel()
    parallelize(model, mesh["tp"])
    torch.manual_seed(0)       # (the init's stream: the eager model drew it at construction)
    model, opt = zerofn_tp_of(model, stage, mesh)
    return full_state(model, opt)[0], zf.model_state_bytes(model)


def zerofn_tp_of(model, stage: int, mesh):
    *first, last = STAGES[stage]
    model = zf.compose(*(getattr(zf, n)() for n in first), getattr(zf, last)(group=mesh["dp"]))(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def built_both_ways(rank, world):
    """``built_on_meta`` at ZeRO-2 and ZeRO-3, eager and on meta, one after another on the
    same ranks."""
    return {(stage, meta): built_on_meta(rank, world, stage, meta)
            for stage in (2, 3) for meta in (False, True)}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_built_on_meta_is_initialized_as_the_eager_one_piece_by_piece(stage, shared_runs):
    """The same weights; and the same bytes held: a tensor-parallel parameter's whole,
    initialized first, is not kept once its piece is taken (at ZeRO-1/2 too, where the
    plain parameters beside it stay in the unit's materialized buffer). (Both stages from
    one run of the ranks.)"""
    built = shared_runs(4, built_both_ways, timeout=300)[0]
    (eager, eager_held), (meta, meta_held) = built[stage, False], built[stage, True]
    assert eager.keys() == meta.keys()
    assert all(torch.equal(eager[k], meta[k]) for k in eager)
    assert meta_held == eager_held, (meta_held, eager_held)
