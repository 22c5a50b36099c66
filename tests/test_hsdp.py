"""HSDP: ``group=`` a 2-D (replicate, shard) DeviceMesh shards over one dim and averages over
the other. Every stage matches plain PyTorch on the global batch, traffic per dimension
follows docs/design.md, and checkpoints move both ways with FSDP2's HSDP and with zerofn's
1-D layouts, also at another world size.

Four ranks as 2 x 2 run in one set of processes (one spawn for many checks); eight as
2 x 4 only under ZEROFN_SLOW=1.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import zerofn as zf
from support.compare import TOL, TOL_BF16_VS_FP32, assert_same_state, max_error, worst
from support.fsdp2 import fsdp2_full, fsdp2_parity
from support.loops import build_parity, step_once, train_reference, train_sharded
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.checkpoint import load_checkpoint, save_checkpoint
from zerofn.runtime.runtime import runtime_of

pytestmark = pytest.mark.multirank

STEPS = 3
NAMES = ("replicate", "shard")
# (stage, accumulation, transform options, extra transforms, train_sharded options)
PARITY = [
    (1, 1, {}, (), {}),
    (1, 3, {}, (), {"clip": 0.05}),
    (2, 3, {}, (), {}),
    (2, 3, {}, (), {"no_sync": True, "clip": 0.05}),
    (3, 3, {}, (), {"clip": 0.05}),
    (3, 1, {"reshard_after_forward": False}, (), {}),
    (2, 1, {}, ("cpu",), {"clip": 0.05}),
    (3, 2, {}, ("nvme",), {"clip": 0.05}),
    (3, 2, {}, ("bf16",), {}),
]


def mesh_2d(shape=(2, 2), names=NAMES):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def build(stage, group, opts=None, extra=(), path=None):
    """The parity model under ``stage`` on ``group``; ``extra`` adds "cpu" or "nvme" offload
    (the swap files under ``path``) or "bf16" mixed precision."""
    more = {"cpu": lambda: zf.offload("cpu"), "nvme": lambda: zf.offload("nvme", path=path),
            "bf16": lambda: zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32)}
    return build_parity(stage, "adamw", *(more[e]() for e in extra), group=group,
                        **(opts or {}))


def expected_traffic(model, stage: int, accum: int, no_sync: bool) -> dict:
    """docs/design.md's per-dimension formula for the last step (fp32 reduction): the shard
    dim reduce-scatters the padded gradients of every reducing backward; the replicate dim
    all-reduces each reduced shard, 1/shard_size of that, plus the step's vote, which
    the shard dim carries too (its only all-reduce, clipping's norm riding on it)."""
    rt = runtime_of(model)
    padded = sum(rt.world * u.shard_numel for u in rt.units if u.trainable)
    reductions = 1 if no_sync else accum
    votes = zf.comm_stats(model).get("all_reduce_bytes", 0)
    return {"reduce_scatter_bytes": 4 * reductions * padded,
            "replicate.all_reduce_bytes": 4 * reductions * padded // rt.world + votes}


def parity(rank, world, mesh, root):
    """Each config against single-process PyTorch: (param error, state error, traffic)."""
    out, refs = [], {}      # one reference per (accumulation, clip), shared by configs
    for stage, accum, opts, extra, train_opts in PARITY:
        data = batches(STEPS, accum, world)
        key = accum, train_opts.get("clip")
        if key not in refs:
            ref, _ = make_models()
            refs[key] = ref, make_optimizer("adamw", ref.parameters())
            train_reference(*refs[key], data, key[1])
        ref, ref_opt = refs[key]
        model, opt = build(stage, mesh, opts, extra, root)
        train_sharded(model, opt, data, rank, world, **train_opts)
        msd, osd = zf.get_state_dict(model, opt, full=True)
        p_err = max(worst(msd[k] - v) for k, v in ref.state_dict().items())
        names = {p: n for n, p in ref.named_parameters()}
        s_err = max(worst(osd["state"][names[p]][k] - v)
                    for p, st in ref_opt.state.items() for k, v in st.items() if v.dim())
        stats = zf.comm_stats(model)
        want = expected_traffic(model, stage, accum, train_opts.get("no_sync", False))
        out.append((p_err, s_err, {k: (stats.get(k), v) for k, v in want.items()}))
    return out


def check_parity(results):
    for rank, errs in enumerate(results):
        for config, (p_err, s_err, traffic) in zip(PARITY, errs):
            tol = TOL_BF16_VS_FP32 if "bf16" in config[3] else TOL
            assert p_err < tol and s_err < tol, (rank, config, p_err, s_err)
            for key, (got, want) in traffic.items():
                assert got == want, (rank, config, key, got, want)


def layout(rank, world, mesh):
    """ZeRO-3's parameters are (Replicate(), Shard(0)) DTensors on the 2-D mesh (in the mesh's
    dim order), and a rank holds exactly what 1-D sharding over the shard dim holds."""
    model, opt = build(3, mesh)
    p = next(p for p in model.parameters() if p.requires_grad)
    assert isinstance(p, DTensor) and p.device_mesh is mesh
    assert tuple(p.placements) == (Replicate(), Shard(0)), p.placements
    flipped, _ = build(3, mesh_2d(names=("shard", "replicate")))
    assert tuple(next(flipped.parameters()).placements) == (Shard(0), Replicate())
    assert tuple(next(build(3, mesh_2d(names=None))[0].parameters()).placements) == \
        (Replicate(), Shard(0))      # unnamed: dim 0 replicates, as FSDP2 reads it
    flat, flat_opt = build(3, mesh["shard"])
    for m, o in ((model, opt), (flat, flat_opt)):
        step_once(m, o, rank, world)
    assert zf.model_state_bytes(model) == zf.model_state_bytes(flat)


def on_a_slice(rank, world) -> None:
    """HSDP on the (replicate, shard) slice of a 3-D mesh, two ranks of four: set-up and
    state dicts agree over the slice's own ranks, and it matches PyTorch on their batch."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp",) + NAMES)["replicate",
                                                                              "shard"]
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    data = batches(STEPS, 1, 2)
    train_reference(ref, ref_opt, data)
    model, opt = build(2, mesh)
    train_sharded(model, opt, data, mesh.get_local_rank("shard"), 2)
    msd = zf.get_state_dict(model, opt, full=True)[0]
    err = max(worst(msd[k] - v) for k, v in ref.state_dict().items())
    assert err < TOL, err


def bf16_vs_fsdp2(rank, world, mesh) -> dict[int, float]:
    """bf16 compute with fp32 reduction, each stage against FSDP2's HSDP with the same
    MixedPrecisionPolicy: the largest parameter difference (measured: none)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp2, fsdp2_opt = fsdp2_parity(mesh, policy=policy)
    data = batches(STEPS, 1, world)
    train_sharded(fsdp2, fsdp2_opt, data, rank, world)
    want = fsdp2_full(fsdp2, fsdp2_opt)[0]
    out = {}
    for stage in (1, 2, 3):
        model, opt = build(stage, mesh, extra=("bf16",))
        train_sharded(model, opt, data, rank, world)
        got = zf.get_state_dict(model, opt, full=True)[0]
        out[stage] = max(worst(got[k] - want[k]) for k in want)
    return out


def fsdp2_load(model, opt, path):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def continued(rank, world, model, opt, saved, later, expected) -> float:
    """A loaded model holds ``saved`` and continues to ``expected`` on ``later``."""
    full = (lambda: fsdp2_full(model, opt)) if not hasattr(model, "_zerofn") \
        else (lambda: zf.get_state_dict(model, opt, full=True))
    assert_same_state(saved, full())
    train_sharded(model, opt, later, rank, world)
    return max_error(expected, full())


def checkpoints(rank, world, mesh, root):
    """Checkpoints between zerofn HSDP, FSDP2 HSDP and zerofn 1-D, each continued."""
    first, later = batches(STEPS, 1, world), batches(STEPS, 1, world, seed=2)
    errors = {}
    for name, make, stage in (("zerofn-hsdp", lambda: build(3, mesh), 3),
                              ("fsdp2-hsdp", lambda: fsdp2_parity(mesh, 0), None),
                              ("zerofn-1d", lambda: build(2, None), 2)):
        model, opt = make()
        train_sharded(model, opt, first, rank, world)
        path = os.path.join(root, name)
        if stage is None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            saved = fsdp2_full(model, opt)
        else:
            path = save_checkpoint(path, model, opt, step=STEPS)
            saved = zf.get_state_dict(model, opt, full=True)
        train_sharded(model, opt, later, rank, world)
        expected = fsdp2_full(model, opt) if stage is None \
            else zf.get_state_dict(model, opt, full=True)
        if name == "zerofn-hsdp":
            errors[(name, "zerofn-1d-world-2")] = at_world_2(mesh, path, saved, later, expected)
        targets = {"fsdp2-hsdp": lambda: fsdp2_parity(mesh, 7), "zerofn-1d": lambda: build(3, None),
                   "zerofn-hsdp-1": lambda: build(1, mesh), "zerofn-hsdp-3": lambda: build(3, mesh)}
        for target, make_target in targets.items():
            if target.startswith(name):
                continue
            tm, to = make_target()
            if target == "fsdp2-hsdp":
                fsdp2_load(tm, to, path)
            else:
                load_checkpoint(path, tm, to)
            errors[(name, target)] = continued(rank, world, tm, to, saved, later, expected)
    return errors


def pretrained_files(rank, world, mesh, root) -> bool:
    """save_pretrained from 2 x 2 ZeRO-3 (one writer, not one per replica), loaded back into
    2 x 2 ZeRO-1: the same parameters."""
    model, opt = build(3, mesh)
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    zf.save_pretrained(model, os.path.join(root, "pretrained"))
    other, other_opt = build(1, mesh)
    zf.load_pretrained(other, os.path.join(root, "pretrained"))
    a = zf.get_state_dict(model, opt, full=True)[0]
    b = zf.get_state_dict(other, other_opt, full=True)[0]
    return all(torch.equal(a[k], b[k]) for k in a)


def tensorboard_dirs(rank, world, mesh, root) -> tuple[list[str], dict, dict]:
    """zf.tensorboard(ranks="all") at 2 x 2: one directory per rank of the mesh (replicas
    share shard ranks, and must not write over each other); this rank's comm/ series of
    step 1, and zf.comm_stats."""
    from support.tensorboard_runs import read, scalars
    logdir = os.path.join(root, "runs")
    model, opt = build_parity(2, "adamw", zf.tensorboard(logdir, every=1, ranks="all"),
                              group=mesh)
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    zf.flush_logs(model)
    dist.barrier()
    acc = read(os.path.join(logdir, f"rank{rank}"))
    series = {tag: scalars(acc, tag)[1] for tag in acc.Tags()["scalars"]
              if tag.startswith("comm/")}
    return sorted(os.listdir(logdir)), series, zf.comm_stats(model)


def bad_meshes(rank, world):
    """Each bad mesh is refused on every rank before any collective: the ranks stay in step
    (the all-reduce at the end would hang or mismatch otherwise)."""
    messages = []
    for shape, names in (((1, 2, 2), ("pp", "replicate", "shard")), ((2, 2), ("replicate", "tp")),
                         ((4,), ("replicate",))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with pytest.raises(ValueError) as err:
            build(2, mesh)
        messages.append(str(err.value))
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, t.item()


def hsdp_2x2(rank, world, root):
    """Every 2 x 2 check in one set of processes; checks that raise fail the rank."""
    mesh = mesh_2d()
    layout(rank, world, mesh)
    on_a_slice(rank, world)
    return {"parity": parity(rank, world, mesh, root),
            "checkpoints": checkpoints(rank, world, mesh, root),
            "bad meshes": bad_meshes(rank, world), "overflow": overflow_vote(rank, world, mesh),
            "pretrained": pretrained_files(rank, world, mesh, root),
            "tensorboard": tensorboard_dirs(rank, world, mesh, root),
            "bf16": bf16_vs_fsdp2(rank, world, mesh)}


def at_world_2(mesh, path, saved, later, expected) -> float:
    """The 2 x 2 checkpoint loaded by 1-D ZeRO-3 over two ranks (each shard group of the
    mesh is one such world), continued on the same global batches."""
    model, opt = build(3, mesh["shard"])
    load_checkpoint(path, model, opt)
    return continued(mesh.get_local_rank("shard"), 2, model, opt, saved, later, expected)


def test_hsdp_2x2_parity_traffic_checkpoints_and_bad_meshes(tmp_path):
    results = run_ranks(4, hsdp_2x2, str(tmp_path), timeout=400)
    check_parity([r["parity"] for r in results])
    for rank, r in enumerate(results):
        errors, (messages, total), (same, scale, stats) = \
            r["checkpoints"], r["bad meshes"], r["overflow"]
        for (src, dst), err in errors.items():
            assert err < TOL, f"rank {rank}: {dst} continued {src}'s checkpoint {err} away"
        assert len(errors) == 9
        assert "3-D mesh" in messages[0] and "mesh['replicate', 'shard']" in messages[0]
        assert "('replicate', 'tp')" in messages[1] and "Name both dims" in messages[1]
        assert "named 'replicate'" in messages[2]
        assert total == 4.0
        assert same and scale == 2.0 ** 7, "an inf on rank 3 must skip the step everywhere"
        # the reduced shards, and the vote (the shard dim's only all-reduce here)
        assert stats["replicate.all_reduce"] == stats["reduce_scatter"] // 2 + stats["all_reduce"]
        assert r["pretrained"], "save_pretrained / load_pretrained under HSDP changed the weights"
        dirs, series, stats = r["tensorboard"]
        assert dirs == [f"rank{i}" for i in range(4)], dirs
        # The replicate dimension's traffic has its own series: each unit's reduced shard,
        # and the step's vote.
        assert series["comm/replicate.all_reduce/bytes"] == stats["replicate.all_reduce_bytes"]
        assert series["comm/replicate.all_reduce/count"] == \
            series["comm/reduce_scatter/count"] + 1
        assert series["comm/replicate.all_reduce/busbw_gbps"] > 0
        assert series["comm/all_reduce/bytes"] == stats["all_reduce_bytes"]
        assert all(e == 0.0 for e in r["bf16"].values()), f"bf16 vs FSDP2's: {r['bf16']}"


def overflow_vote(rank, world, mesh):
    """fp16 loss scaling: an inf in one rank's loss skips the step on all four ranks."""
    model, opt = build_parity(2, "adamw", zf.mixed_precision(
        torch.float16, initial_scale_power=8, hysteresis=1), group=mesh)
    before = zf.get_state_dict(model, opt, full=True)
    train_sharded(model, opt, batches(1, 1, world), rank, world, scale=True, inf_on=(0, 3))
    after = zf.get_state_dict(model, opt, full=True)
    return (all(torch.equal(before[0][k], after[0][k]) for k in before[0]),
            opt.state_dict()["zerofn_loss_scaler"]["scale"], zf.comm_stats(model))


def hsdp_2x4(rank, world, root):
    return parity(rank, world, mesh_2d((2, 4)), root)


@pytest.mark.slow(reason="eight processes on this machine")
def test_hsdp_2x4_parity(tmp_path):
    check_parity(run_ranks(8, hsdp_2x4, str(tmp_path), timeout=900))
