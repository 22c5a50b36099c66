"""Whole-tensor optimizers (torch.optim.Muon beside AdamW, torch.optim.Adafactor) under every
ZeRO stage: each owned parameter stepped whole on one rank, the weights as plain PyTorch's
on the same global batch, Newton-Schulz run once per matrix per step over all ranks.

Muon's Newton-Schulz runs in bf16, where the order of the gradients' reduction shows (DDP
itself lands 1e-3 from single-process PyTorch); these tests run it in fp32 so that 1e-5
tells a right step from a wrong one (Muon stepping shards of rows lands 2.6e-2 away at
ZeRO-2, world 2).
tools/bench_muon.py measures the bf16 figures against DDP's."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import zerofn as zf
from support import slow_variant
from support.compare import worst
from support.errors import error_of
from zerofn.runtime import runtime_of
from zerofn.state.state_dict import get_model_state_dict
from support.loops import zero
from support.models import batches, make_models
from support.owned import (OPTIMIZERS, counted_newton_schulz, step_all, train_reference,
                           train_sharded)
from support.ranks import run_ranks

STEPS, TOL = 4, 1e-5

EXTRAS = {
    "none": lambda path: (),
    "cpu": lambda path: (zf.offload("cpu"),),
    "nvme": lambda path: (zf.offload("nvme", path=path),),
    "nvme params": lambda path: (zf.offload("nvme", path=path, params=True),),
    "bf16": lambda path: (zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32),),
}


def trained(rank, world, stage, kind, accum, extra="none", clip=None, path=None, **options):
    """The largest difference of the full weights from plain PyTorch's after ``STEPS``
    steps, this rank's Newton-Schulz calls, and its owned matrices' cost."""
    data = batches(STEPS, accum, world)
    want, reference = _reference(kind, accum, world, clip)
    _, model = make_models()
    with counted_newton_schulz(fp32=True) as calls:
        model, opts = zf.compose(zero(stage, **options), *EXTRAS[extra](path))(
            model, OPTIMIZERS[kind](model))
        train_sharded(model, opts, data, rank, world, clip=clip)
    full = get_model_state_dict(model, full=True)
    err = max(worst(full[k].float() - v.float()) for k, v in want.items())
    owned = runtime_of(model).owned_load()
    return err, len(calls), reference, owned


# Plain PyTorch's runs in this rank's process, by (kind, accum, world, clip): the cases a
# test runs one after another on the same ranks share them.
_REFERENCES: dict = {}


def _reference(kind, accum, world, clip):
    """Plain PyTorch's weights after ``STEPS`` steps on the global batches, and its
    Newton-Schulz calls."""
    key = (kind, accum, world, clip)
    if key not in _REFERENCES:
        data = batches(STEPS, accum, world)
        ref, _ = make_models()
        with counted_newton_schulz(fp32=True) as calls:
            ref_opts = OPTIMIZERS[kind](ref)
            if clip:
                _clip_reference(ref, ref_opts, data, clip)
            else:
                train_reference(ref, ref_opts, data)
        _REFERENCES[key] = (ref.state_dict(), len(calls))
    return _REFERENCES[key]


def cases(rank, world, fn, *each):
    """``fn(rank, world, *args, **dict(options))`` for each (args, options) of ``each``, one
    after another on the same ranks (``options``: (name, value) pairs)."""
    return [fn(rank, world, *args, **dict(options)) for args, options in each]


def run_cases(world, fn, *each):
    """``cases`` on ``world`` ranks: per case, every rank's result."""
    return list(zip(*run_ranks(world, cases, fn, *each, timeout=240)))


def _clip_reference(ref, opts, data, clip):
    for micro in data:
        for x, y in micro:
            (ref(x, y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad()


def check(results, world, tol=TOL):
    errs = [r[0] for r in results]
    assert max(errs) < tol, errs
    # Newton-Schulz once per matrix per step, over all ranks together (the reference ran
    # it once per matrix per step in one process).
    assert sum(r[1] for r in results) == results[0][2], [r[1] for r in results]
    loads = results[0][3]
    assert len(loads) == world and max(loads) <= 1.3 * sum(loads) / world, loads


# Four ranks on the CI machine's two cores cost the most: each stage's step runs at one and
# two ranks every time, the owners spread over four at ZeRO-3 (the same assignment at every
# stage and for every whole-tensor optimizer); ZEROFN_SLOW=1 runs the rest at four.
FOUR = "test_muon_and_adamw_step_as_pytorch_at_every_stage[3-4]"


@pytest.mark.multirank
@pytest.mark.parametrize("stage, world", [
    (stage, world) if world < 4 or stage == 3 else
    slow_variant(stage, world, covered_by=f"[{stage}-2] and [3-4]")
    for world in (1, 2, 4) for stage in (1, 2, 3)])
def test_muon_and_adamw_step_as_pytorch_at_every_stage(stage, world, shared_runs):
    """(Every stage of a world from one run of its ranks, but at four, where the stages but
    ZeRO-3 are slow variants.)"""
    stages = (1, 2, 3) if world < 4 else (stage,)
    results = shared_runs(world, cases, trained, *(((s, "muon", 2), ()) for s in stages),
                   timeout=240)
    check([r[stages.index(stage)] for r in results], world, tol=1e-6 if world == 1 else TOL)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, slow_variant(4, covered_by=f"[2] and {FOUR}")])
def test_adafactor_steps_as_pytorch_at_every_stage(world):
    stages = (1, 2, 3)
    for stage, results in zip(stages, run_cases(world, trained,
                                                *(((s, "adafactor", 2), ()) for s in stages))):
        errs = [r[0] for r in results]
        assert max(errs) < (1e-6 if world == 1 else TOL), (stage, errs)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, slow_variant(4, covered_by=f"[2] and {FOUR}")])
def test_muon_under_cpu_offload_with_clipping_and_accumulation(world):
    """ZeRO-3 and ZeRO-2 with offload("cpu"): the owned matrices' masters on the host,
    gathered to their owner and scattered back; one global clip across both optimizers;
    accumulation 1 and 4."""
    for results in run_cases(world, trained, *(((stage, "muon", accum, "cpu", 0.5), ())
                                               for stage, accum in ((3, 4), (2, 1)))):
        check(results, world)


def step_traffic(rank, world):
    """Bytes per step zf.comm_stats counts at each stage, AdamW over every parameter against
    Muon + AdamW on the same model, and the owned matrices' (rows, inner) shapes."""
    data = batches(2, 1, world)
    out = {}
    for stage, kind, options in [(stage, kind, {}) for stage in (1, 2, 3)
                                 for kind in ("adamw", "muon")] + \
            [(3, "muon to owner", {"reduce_to_owner": True})]:
        _, model = make_models()
        opts = (torch.optim.AdamW(model.parameters(), lr=1e-3),) if kind == "adamw" \
            else OPTIMIZERS["muon"](model)
        model, opts = zero(stage, **options)(model, opts)
        train_sharded(model, opts, data, rank, world)
        out[stage, kind] = sum(v for k, v in zf.comm_stats(model).items()
                               if k.endswith("_bytes"))
    _, model = make_models()
    out["owned"] = [tuple(p.shape) for p in OPTIMIZERS["muon"](model)[0].param_groups[0]["params"]]
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_owned_traffic_is_the_formula(world):
    """Over ZeRO's own AdamW traffic: at ZeRO-1/2 the gradient's gather to the owner
    (padded rows) and the owner's broadcast of the whole matrix, which the unit's
    all-gather no longer carries (its padded rows, aligned in the shard): +1x the owned
    matrices' bytes, less the alignment. At ZeRO-3 the gather and the scatter of the rows
    back: +2x the padded rows. With ``reduce_to_owner`` the reduce to the owner carries the
    padded rows the reduce-scatter no longer does (their aligned columns), and the scatter
    back is +1x: +1x the padded rows, less the alignment (and the vote's one more fp32
    flag: a p.grad edit the step refuses)."""
    from zerofn.core.units import aligned, chunk_rows
    for out in run_ranks(world, step_traffic, timeout=240):
        owned = out["owned"]
        whole = sum(a * b * 4 for a, b in owned)
        padded = sum(world * chunk_rows(a, world) * b * 4 for a, b in owned)
        alignment = sum(world * (aligned(chunk_rows(a, world) * b) - chunk_rows(a, world) * b) * 4
                        for a, b in owned)
        for stage in (1, 2):
            extra = out[stage, "muon"] - out[stage, "adamw"]
            assert extra == whole - alignment and extra <= whole, (stage, out)
        assert out[3, "muon"] - out[3, "adamw"] == 2 * padded, out
        extra = out[3, "muon to owner"] - out[3, "adamw"]
        assert extra == padded - alignment + 4 and extra <= padded + 4, out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_muon_under_nvme_offload_with_accumulation(world, tmp_path):
    """ZeRO-2 with offload("nvme") (and ZeRO-3 with the parameter shards in the file too):
    AdamW's parameters stream through the swap file (CPU Adam), the owned matrices keep
    their masters' rows there too, their momentum on the owner; accumulation 1 and 4, a
    global clip at 4. Adafactor alone: no parameter left to CPU Adam."""
    configs = ((2, "nvme", "muon", 1, None), (2, "nvme", "muon", 4, 0.5),
               (3, "nvme params", "muon", 4, 0.5), (2, "nvme", "adafactor", 2, None))
    ran = run_cases(world, trained, *(((stage, kind, accum, extra, clip, str(tmp_path)), ())
                                      for stage, extra, kind, accum, clip in configs))
    for (stage, extra, kind, accum, clip), results in zip(configs, ran):
        errs = [r[0] for r in results]
        assert max(errs) < (1e-6 if world == 1 else TOL), (stage, extra, kind, errs)
        if kind == "muon":
            check(results, world)


def refusals(rank, world):
    """What a whole-tensor optimizer cannot do, refused on every rank with its reason."""
    out = {}
    _, model = make_models()
    overlap = zf.compose(zero(2), zf.offload("cpu", overlap_step=True))
    out["overlap"] = error_of(overlap, model, OPTIMIZERS["muon"](model))
    _, model = make_models()
    out["lbfgs"] = error_of(zero(2), model, torch.optim.LBFGS(model.parameters()))
    _, model = make_models()
    with tempfile.TemporaryDirectory() as tmp:
        nvme = zf.compose(zero(2), zf.offload("nvme", path=tmp))
        muon, adamw = OPTIMIZERS["muon"](model)
        sgd = torch.optim.SGD([p for g in adamw.param_groups for p in g["params"]], lr=0.1)
        out["nvme"] = error_of(nvme, model, (muon, sgd))
    _, model = make_models()
    out["not a sequence"] = error_of(zero(2), model, "adamw", error=TypeError)
    _, model = make_models()
    with tempfile.TemporaryDirectory() as tmp:
        nvme = zf.compose(zero(3, reduce_to_owner=True), zf.offload("nvme", path=tmp))
        out["nvme to owner"] = error_of(nvme, model, OPTIMIZERS["muon"](model))
    return out


@pytest.mark.multirank
def test_what_owned_parameters_cannot_do_is_refused_on_every_rank():
    for out in run_ranks(2, refusals, timeout=120):
        assert "leave overlap_step off" in out["overlap"], out["overlap"]
        assert "LBFGS steps through a closure" in out["lbfgs"], out["lbfgs"]
        assert "(got Muon + SGD); use offload('cpu')" in out["nvme"], out["nvme"]
        assert "(model, (optimizer, ...))" in out["not a sequence"], out["not a sequence"]
        assert "reduce_to_owner=True) with offload('nvme')" in out["nvme to owner"], out


def resumed(rank, world, stage, path, resume, extra="none", **options):
    """The first two of four steps saved by ``save_checkpoint`` in the background, or
    (``resume``) the last two after ``load_checkpoint``, returning the weights' distance
    from plain PyTorch's four steps. The global batch is the same at every world size.
    ``extra``'s swap file, if any, goes to ``path``/swap."""
    data = batches(4, 2, world, per_rank=4 // world)
    ref, model = make_models()
    swap = os.path.join(path, "swap")
    os.makedirs(swap, exist_ok=True)
    with counted_newton_schulz(fp32=True):
        model, opts = zf.compose(zero(stage, **options), *EXTRAS[extra](swap))(
            model, OPTIMIZERS["muon"](model))
        if not resume:
            train_sharded(model, opts, data[:2], rank, world)
            # In the background, while the next steps change the state: it saves step 2's.
            zf.save_checkpoint(path, model, opts, step=2, async_save=True)
            train_sharded(model, opts, data[2:], rank, world)
            zf.wait_for_checkpoint()
            return None
        zf.load_checkpoint(path, model, opts)
        train_sharded(model, opts, data[2:], rank, world)
        train_reference(ref, OPTIMIZERS["muon"](ref), data)
    full = get_model_state_dict(model, full=True)
    return max(worst(full[k].float() - v.float()) for k, v in ref.state_dict().items())


@pytest.mark.multirank
def test_a_checkpoint_from_two_ranks_resumes_at_one_and_four_at_other_stages(tmp_path):
    """Owned state saved as every other state (Shard(0) rows), loaded at another world
    size and stage, re-owned there at the next step: the run goes on as uninterrupted."""
    run_ranks(2, resumed, 3, str(tmp_path), False, timeout=240)
    for world, stage in ((1, 1), (4, 2)):
        errs = run_ranks(world, resumed, stage, str(tmp_path), True, timeout=240)
        assert max(errs) < TOL, (world, stage, errs)


def resumed_to_owner(rank, world, path, resume):
    return resumed(rank, world, 3, path, resume, reduce_to_owner=True)


@pytest.mark.multirank
def test_a_checkpoint_with_gradients_reduced_to_owners_resumes_at_another_world_size(tmp_path):
    """ZeRO-3 with reduce_to_owner at two ranks, resumed at four: the first step after the
    load gathers the masters' rows to the new owners beside the reduced gradients."""
    run_ranks(2, resumed_to_owner, str(tmp_path), False, timeout=240)
    errs = run_ranks(4, resumed_to_owner, str(tmp_path), True, timeout=240)
    assert max(errs) < TOL, errs


@pytest.mark.multirank
def test_a_checkpoint_under_nvme_offload_resumes_at_another_world_size(tmp_path):
    """ZeRO-2 + offload("nvme") at two ranks, saved in the background while the next steps
    change the swap file and the owners' momentum, resumed at one rank as uninterrupted."""
    run_ranks(2, resumed, 2, str(tmp_path), False, "nvme", timeout=240)
    errs = run_ranks(1, resumed, 2, str(tmp_path), True, "nvme", timeout=240)
    assert max(errs) < TOL, errs


def zerofn_to_fsdp2(rank, world, root):
    """zerofn's ZeRO-3 checkpoint of Muon + AdamW loaded by FSDP2 running the same
    optimizers (torch's get_state_dict over both, dcp.load, set_state_dict); both go on two
    more steps. Returns the weights' distance between them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    data = batches(4, 1, world)
    with counted_newton_schulz(fp32=True):
        _, model = make_models()
        model, opts = zero(3)(model, OPTIMIZERS["muon"](model))
        train_sharded(model, opts, data[:2], rank, world)
        ckpt = zf.save_checkpoint(root, model, opts, step=2)
        zf.wait_for_checkpoint()
        _, fmodel = make_models(seed=7)
        mesh = init_device_mesh("cpu", (world,))
        for block in fmodel.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(fmodel, mesh=mesh)
        fopts = OPTIMIZERS["muon"](fmodel)
        msd, osd = get_state_dict(fmodel, list(fopts))
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(fmodel, list(fopts), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for model_, opts_ in ((model, opts), (fmodel, fopts)):
            train_sharded(model_, opts_, data[2:], rank, world)
    ours = get_model_state_dict(model, full=True)
    theirs = {k: v.full_tensor() for k, v in fmodel.state_dict().items()
              if hasattr(v, "full_tensor")}
    return max(worst(ours[k] - v) for k, v in theirs.items())


@pytest.mark.multirank
def test_fsdp2_running_muon_reads_zerofns_checkpoint(tmp_path):
    errs = run_ranks(2, zerofn_to_fsdp2, str(tmp_path), timeout=240)
    assert max(errs) < TOL, errs


def tensor_parallel_refusal(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from support.tp_models import make_tp_model, parallelize
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(make_tp_model(), mesh["tp"])
    opts = OPTIMIZERS["muon"](model)
    stage = zf.compose(zf.shard_optimizer(), zf.shard_grads(group=mesh["dp"]))
    return error_of(stage, model, opts)


@pytest.mark.multirank
def test_muon_over_tensor_parallel_matrices_is_refused_naming_one():
    for out in run_ranks(4, tensor_parallel_refusal, timeout=120):
        assert out is not None and "is split by tensor parallelism" in out, out
        assert "'blocks.0.attn.q.weight'" in out, out


def one_transform_at_a_time(rank, world):
    """ZeRO-1 for two steps, then shard_grads and shard_params applied on top (each restores
    the model and optimizer whole, Muon's momentum included, and shards them again) for two
    more: as plain PyTorch's four steps."""
    data = batches(4, 1, world)
    ref, model = make_models()
    with counted_newton_schulz(fp32=True):
        model, opts = zf.shard_optimizer()(model, OPTIMIZERS["muon"](model))
        train_sharded(model, opts, data[:1], rank, world)
        model, opts = zf.shard_grads()(model, opts)
        train_sharded(model, opts, data[1:3], rank, world)
        model, opts = zf.shard_params()(model, opts)
        train_sharded(model, opts, data[3:], rank, world)
        train_reference(ref, OPTIMIZERS["muon"](ref), data)
    full = get_model_state_dict(model, full=True)
    return max(worst(full[k].float() - v.float()) for k, v in ref.state_dict().items())


@pytest.mark.multirank
def test_transforms_applied_one_at_a_time_keep_muons_momentum():
    errs = run_ranks(2, one_transform_at_a_time, timeout=240)
    assert max(errs) < TOL, errs


@pytest.mark.multirank
def test_muon_under_bf16_mixed_precision_stays_near_fp32_pytorch():
    """bf16 compute, fp32 reduction and masters: the owned matrices' gradients reach the
    owner in the masters' dtype and their updated rows go back to bf16 compute shards. A
    gross-error bound (bf16 compute against an fp32 run, compare.py's TOL_BF16_VS_FP32).
    ZeRO-3 with reduce_to_owner too: the owner's whole gradient cast to the masters'."""
    from support.compare import TOL_BF16_VS_FP32
    stages = (2, 3, "3 to owner")
    for stage, results in zip(stages, run_cases(
            2, trained, ((2, "muon", 2, "bf16"), ()), ((3, "muon", 2, "bf16"), ()),
            ((3, "muon", 2, "bf16"), (("reduce_to_owner", True),)))):
        errs = [r[0] for r in results]
        assert max(errs) < TOL_BF16_VS_FP32, (stage, errs)
        assert sum(r[1] for r in results) == results[0][2]


def owned_bytes(rank, world):
    """The optimizer-role bytes zf.model_state_bytes counts on this rank after two steps,
    and the owned state and whole masters this rank holds."""
    data = batches(2, 1, world)
    _, model = make_models()
    model, opts = zero(2)(model, OPTIMIZERS["muon"](model))
    train_sharded(model, opts, data, rank, world)
    counted = sum(roles["optimizer"] for roles in zf.model_state_bytes(model).values())
    muon = opts[0]
    whole = sum(t.numel() * t.element_size() for st in muon.state.values() for t in st.values())
    return counted, whole, len(muon.state)


@pytest.mark.multirank
def test_owned_state_is_counted_on_its_owner_only():
    """Muon's momentum and the owner's whole masters: each matrix's once over the ranks,
    as much as one process holds (two whole matrices' worth of Muon's)."""
    _, model = make_models()
    matrices = sum(p.numel() * 4 for n, p in model.named_parameters()
                   if n.startswith("blocks.") and p.ndim == 2)
    results = run_ranks(2, owned_bytes, timeout=120)
    assert sum(r[1] for r in results) == matrices           # the momentum, once
    assert sum(r[2] for r in results) == 8 and all(r[2] for r in results)
    alone = run_ranks(1, owned_bytes, timeout=120)[0]
    # Over the ranks: rows of every master and AdamW's state, the momentum and the whole
    # masters once; at one rank the same, but for the rows' padding (a few elements each).
    total = sum(r[0] for r in results)
    assert alone[0] <= total <= alone[0] + 1024 and alone[0] >= 2 * matrices, (total, alone)


def hybrid(rank, world, stage, **options):
    """HSDP on a 2 x 2 (replicate, shard) mesh: owners within each shard group, every
    replica computing its owned matrices alike."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return trained(rank, world, stage, "muon", 2, group=mesh, **options)


@pytest.mark.multirank
def test_muon_under_hybrid_sharding():
    """ZeRO-2, ZeRO-3, and ZeRO-3 with each owned gradient reduced to its owner, then
    averaged over the replicas' owners."""
    stages = (2, 3, "3 to owner")
    for stage, results in zip(stages, run_cases(4, hybrid, ((2,), ()), ((3,), ()),
                                                ((3,), (("reduce_to_owner", True),)))):
        assert max(r[0] for r in results) < TOL, (stage, [r[0] for r in results])
        # (each replica runs Newton-Schulz for its shard group's matrices: twice over all)
        assert sum(r[1] for r in results) == 2 * results[0][2]


@pytest.mark.multirank
def test_an_optimizer_the_user_marks_whole_steps_as_pytorch():
    """zf.whole_tensors(opt): an optimizer torch does not ship, whose update reads its
    tensor's norm, stepped whole on owners at ZeRO-2 and ZeRO-3."""
    for stage, results in zip((2, 3), run_cases(2, trained, ((2, "normalized", 2), ()),
                                                ((3, "normalized", 2), ()))):
        errs = [r[0] for r in results]
        assert max(errs) < TOL, (stage, errs)


# -- shard_params(reduce_to_owner=True): runtime/to_owner.py ------------------------------

def to_owner(rank, world, kind, accum, extra="none", clip=None):
    """``trained`` at ZeRO-3 with each owned gradient reduced whole to its owner."""
    return trained(rank, world, 3, kind, accum, extra, clip, reduce_to_owner=True)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_reduced_to_their_owners_step_as_pytorch(world):
    """Muon + AdamW (accumulation 1 and 4) and Adafactor at ZeRO-3, the owned gradients
    reduced to their owners: the weights as plain PyTorch's, Newton-Schulz once per matrix
    per step over all ranks."""
    tol = 1e-6 if world == 1 else TOL
    accum1, accum4, rows, adafactor = run_cases(
        world, trained, ((3, "muon", 1), (("reduce_to_owner", True),)),
        ((3, "muon", 4), (("reduce_to_owner", True),)), ((3, "muon", 4), ()),
        ((3, "adafactor", 2), (("reduce_to_owner", True),)))
    for results in (accum1, accum4):
        check(results, world, tol=tol)
    # The owner sums the ranks' gradients in the reduce-scatter's order (comm.py's
    # ``reduce``): the weights are the default's to the last bit, not only near PyTorch's.
    assert [r[0] for r in accum4] == [r[0] for r in rows], (accum4, rows)
    errs = [r[0] for r in adafactor]
    assert max(errs) < tol, errs


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, slow_variant(4, covered_by="[2]")])
def test_gradients_reduced_to_their_owners_under_cpu_offload_with_clipping(world):
    """offload("cpu"): the owners' whole gradients stay on the device, the rest land on
    the host; one global clip reads each owned gradient once, on its owner."""
    tol = 1e-6 if world == 1 else TOL
    configs = (("muon", 4), ("muon", 1), ("adafactor", 2))
    ran = run_cases(world, to_owner, *(((kind, accum, "cpu", 0.5), ()) for kind, accum in configs))
    for (kind, accum), results in zip(configs, ran):
        assert max(r[0] for r in results) < tol, (kind, accum, [r[0] for r in results])
        if kind == "muon":
            check(results, world, tol=tol)


MATRIX = "blocks.0.attn.proj.weight"     # a Muon matrix, 48 x 48


def held_grads(rank, world, edit):
    """p.grad of an owned matrix under ``reduce_to_owner`` after one backward, what reading
    it does, and what the step makes of ``edit``: "replace" (rank 1 only puts another
    tensor there) or "none" (every rank sets it to None). Returns what each rank saw and
    how far the matrix and another parameter moved."""
    _, model = make_models()
    model, opts = zero(3, reduce_to_owner=True)(model, OPTIMIZERS["muon"](model))
    [[(x, y)]] = batches(1, 1, world)
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    params = dict(model.named_parameters())
    before = {k: v.full_tensor().clone() for k, v in params.items()}
    g = params[MATRIX].grad
    out = {"shown": (type(g).__name__, tuple(g.shape), [str(p) for p in g.placements]),
           "read": error_of(lambda: g.sum(), error=RuntimeError),
           "torch clip": error_of(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0,
                                  error=RuntimeError),
           "other readable": bool(params["tok.weight"].grad.full_tensor().abs().sum() > 0)}
    if edit == "replace" and rank == 1:
        params[MATRIX].grad = params[MATRIX].detach().clone()
    if edit == "none":
        params[MATRIX].grad = None
    out["step"] = error_of(step_all, opts)
    after = {k: v.full_tensor() for k, v in params.items()}
    out["moved"] = {k: worst(after[k] - before[k]) for k in (MATRIX, "tok.weight")}
    return out


@pytest.mark.multirank
def test_a_gradient_reduced_to_its_owner_shows_no_values_and_refuses_a_replacement():
    """Its p.grad is a Shard(0) DTensor of the matrix's shape; reading it, or torch's clip,
    raises on every rank naming the owner; a tensor one rank puts in its place stops the
    step on every rank; p.grad = None on every rank is honoured (the matrix stays)."""
    for rank, out in enumerate(run_ranks(2, held_grads, "replace", timeout=120)):
        assert out["shown"] == ("DTensor", (48, 48), ["S(0)"]), out["shown"]
        for what, name in (("read", MATRIX), ("torch clip", "blocks.0.attn.qkv.weight")):
            assert out[what] and f"p.grad of {name!r} holds no values" in out[what] \
                and "reduce_to_owner" in out[what] and "reduced whole to rank " in out[what] \
                and "zf.clip_grad_norm_" in out[what], out[what]
        assert out["other readable"]
        said = f"p.grad of {MATRIX!r}" if rank == 1 else "another rank's loop"
        assert out["step"] and said in out["step"], out["step"]
        assert out["moved"] == {MATRIX: 0.0, "tok.weight": 0.0}, out["moved"]
    for out in run_ranks(2, held_grads, "none", timeout=120):
        assert out["step"] is None and out["moved"][MATRIX] == 0.0, out
        assert out["moved"]["tok.weight"] > 0, out


def nonfinite_owned(rank, world, rule, options):
    """Two steps at ZeRO-3 under ``on_nonfinite=rule``; in the second a nan in the last
    rank's gradient of one Muon matrix only (a hook on the parameter). Returns each step's
    error, whether it was skipped, and how far the weights moved."""
    from zerofn.runtime import NonFiniteGradient
    _, model = make_models()
    poison = [False]
    model.blocks[0].attn.proj.weight.register_hook(
        lambda g: g * float("nan") if poison[0] and rank == world - 1 else g)
    model, opts = zero(3, on_nonfinite=rule, **options)(model, OPTIMIZERS["muon"](model))
    out = []
    for step, [(x, y)] in enumerate(batches(2, 1, world)):
        poison[0] = step == 1
        model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        before = [v.full_tensor().clone() for v in model.parameters()]
        error = error_of(step_all, opts, error=NonFiniteGradient)
        moved = max(worst(v.full_tensor() - b) for v, b in zip(model.parameters(), before))
        out.append((error, runtime_of(model).step_skipped(), moved))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("options", [{}, {"reduce_to_owner": True}], ids=["rows", "to owner"])
def test_a_nan_in_one_owned_gradient_is_every_ranks_verdict(options):
    """The non-finite guard at ZeRO-3 reads each owned gradient (gathered rows, or the
    owner's whole): "skip" skips the step on every rank, "raise" names the matrix on every
    rank."""
    skipped, raised = run_cases(2, nonfinite_owned, (("skip", options), ()),
                                (("raise", options), ()))
    for steps in skipped:
        assert [s[:2] for s in steps] == [(None, False), (None, True)], steps
        assert steps[0][2] > 0 and steps[1][2] == 0.0, steps
    for steps in raised:
        message = steps[1][0]
        assert steps[0][0] is None and message is not None, steps
        assert "step 2" in message and \
            "the gradient of 'blocks.0.attn.proj.weight' holds nan" in message, message


def clip_norms(rank, world, extra, options):
    """The global gradient norm ``zf.clip_grad_norm_`` returns at ZeRO-3 after two
    accumulated micro-batches, and plain PyTorch's on the same global batch."""
    ref, model = make_models()
    [micro] = batches(1, 2, world)
    for x, y in micro:
        (ref(x, y) / len(micro)).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    model, opts = zf.compose(zero(3, **options), *EXTRAS[extra](None))(
        model, OPTIMIZERS["muon"](model))
    for x, y in micro:
        (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
    return float(zf.clip_grad_norm_(model, 1.0)), float(expected)


@pytest.mark.multirank
def test_the_global_norm_counts_each_gradient_reduced_to_its_owner_once():
    """Muon and AdamW's updates hardly move with the clip's coefficient, so the norm is
    checked itself: each owned gradient's whole norm from its owner, once, beside the rows
    of the rest (on the host under offload("cpu"))."""
    extras = ("none", "cpu")
    for extra, results in zip(extras, run_cases(2, clip_norms, *(((e, {"reduce_to_owner": True}),
                                                                  ()) for e in extras))):
        for got, expected in results:
            assert abs(got - expected) <= 1e-5 * expected, (extra, got, expected)
