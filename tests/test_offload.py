"""offload("cpu"): every stage matches the same run without offload, and the device keeps
no optimizer state (and, with params=True, no parameter shards)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

import zerofn as zf
from support.compare import max_errors, state_errors, worst
from support.errors import error_of
from support.loops import build_parity, step_once, train_reference, train_sharded
from support.models import batches, make_models, make_optimizer
from support.offload import build_offloaded, sharded_state_locals
from support import slow_variant
from support.ranks import run_ranks
from zerofn.runtime.runtime import runtime_of

CONFIGS = [(1, "adamw", {}), (2, "adamw", {}), (3, "adamw", {}), (3, "adamw", {"params": True}),
           (2, "sgd", {}), (3, "sgd", {"params": True}), (3, "adam", {"params": True}),
           (1, "adamw", {"nvme": True}), (2, "adamw", {"nvme": True}), (3, "adam", {"nvme": True}),
           (3, "adamw", {"nvme": True, "units_in_flight": 1})]


def world_2_runs(rank, world, path):
    """The two-rank runs of the single-case tests below, in one launch."""
    return {"vs pytorch": offload_vs_pytorch(rank, world),
            "state homes": where_state_lives(rank, world, path),
            "state dicts": offload_state_dicts(rank, world, path),
            "bf16": bf16_offload_runs(rank, world, path),
            "state locals": state_locals_runs(rank, world)}


@pytest.fixture(scope="module")
def at_world_2(tmp_path_factory) -> dict:
    """world_2_runs' results, each a list over the two ranks."""
    path = str(tmp_path_factory.mktemp("offload"))
    per_rank = run_ranks(2, world_2_runs, path, timeout=400)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def offload_runs(rank, world, path):
    out = []
    data = batches(5, 1, world)
    plains = {}     # the run without offload, trained once per (stage, optimizer)
    for stage, kind, opts in CONFIGS:
        opts = dict(opts, path=path)
        if (stage, kind) not in plains:
            plain, plain_opt = build_offloaded(stage, kind)
            train_sharded(plain, plain_opt, data, rank, world, clip=0.05)
            plains[stage, kind] = (zf.get_state_dict(plain, plain_opt, full=True),
                                   plain_opt.state_dict()["param_groups"])
        a, groups = plains[stage, kind]
        off, off_opt = build_offloaded(stage, kind, opts)
        train_sharded(off, off_opt, data, rank, world, clip=0.05)
        b = zf.get_state_dict(off, off_opt, full=True)
        out.append((max(state_errors(a, b)), off_opt.state_dict()["param_groups"] == groups))
    return out


# World 1's offloaded runs against the same runs without offload: test_offload_copies.py's
# deferred copies at world 1 train every stage, host and NVMe, against them in every run.
@pytest.mark.multirank
@pytest.mark.parametrize("world", [slow_variant(1, covered_by=(
    "[2] and test_offload_copies.py::test_deferred_copies_train_like_synchronous_ones[1]")), 2])
def test_offload_matches_the_run_without_it(world, tmp_path):
    """cpu and nvme, every stage: equal to the run without offload (CPU Adam vs torch)."""
    for rank_out in run_ranks(world, offload_runs, str(tmp_path), timeout=400):
        for config, (err, same_groups) in zip(CONFIGS, rank_out):
            assert err < 1e-6, (config, err)
            assert same_groups, config
    assert os.listdir(tmp_path) == [], "swap files outlived their processes"


def offload_vs_pytorch(rank, world):
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    model, opt = build_offloaded(3, "adamw", {"params": True})
    data = batches(5, 1, world)
    train_reference(ref, ref_opt, data)
    train_sharded(model, opt, data, rank, world)
    return max_errors(ref, ref_opt, model, opt)


@pytest.mark.multirank
def test_offload_matches_plain_pytorch(at_world_2):
    for p_err, s_err in at_world_2["vs pytorch"]:
        assert p_err < 1e-5 and s_err < 1e-5


# persist_below under parameter offload: "all" keeps every parameter whole, which leaves
# the root unit without any (DeepSpeed's ZeRO-3 example config, issue 23); "mixed" keeps
# each block's norms and biases whole and shards its weights.
PERSIST = {"all": 10**9, "mixed": 200}


def persistent_offload_runs(rank, world, path):
    """``{(where, case): (sharded units, units split with the persistent one, errors vs
    plain PyTorch)}``, for cpu and nvme parameter offload."""
    data = batches(3, 1, world)
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    train_reference(ref, ref_opt, data, clip=0.05)
    out = {}
    for where in ("cpu", "nvme"):
        for case, below in PERSIST.items():
            model, opt = build_parity(3, "adamw", zf.offload(
                where, params=True, path=path if where == "nvme" else None), persist_below=below)
            train_sharded(model, opt, data, rank, world, clip=0.05)
            out[(where, case)] = (*unit_layout(model), max_errors(ref, ref_opt, model, opt))
    return out


def unit_layout(model) -> tuple[list[str], list[str]]:
    """The units with sharded parameters, and those of them whose module also holds
    persistent ones."""
    units = runtime_of(model).units
    persistent = {s.param for u in units if u.replicated for s in u.slots}
    sharded = [u for u in units if u.slots and not u.replicated]
    return ([u.name for u in sharded],
            [u.name for u in sharded if any(p in persistent for p in u.module.parameters())])


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 4])
def test_parameter_offload_with_persistent_parameters_matches_plain_pytorch(world, tmp_path):
    for rank_out in run_ranks(world, persistent_offload_runs, str(tmp_path), timeout=300):
        for (where, case), (sharded, split, (p_err, s_err)) in rank_out.items():
            if case == "all":
                assert sharded == [], (where, sharded)
            else:
                assert "blocks.0" in split, (where, split)
            assert p_err < 1e-5 and s_err < 1e-5, (where, case, p_err, s_err)


def where_state_lives(rank, world, path):
    out = {}
    for stage, opts in ((1, {}), (2, {}), (3, {}), (3, {"params": True}),
                        (2, {"nvme": True, "path": path}), (3, {"nvme": True, "path": path})):
        model, opt = build_offloaded(stage, "adamw", opts, precision=torch.bfloat16)
        step_once(model, opt, rank, world)
        out[(stage, tuple(sorted(opts)))] = zf.model_state_bytes(model)
    return out


@pytest.mark.multirank
def test_device_holds_no_optimizer_state_under_offload(at_world_2):
    for by_config in at_world_2["state homes"]:
        for (stage, opts), mem in by_config.items():
            assert mem["cpu"]["optimizer"] == 0, (stage, mem)
            assert mem["host"]["optimizer"] > 0, (stage, mem)
            assert (mem["cpu"]["params"] == 0) == ("params" in opts), (stage, mem)
            assert (mem.get("nvme", {}).get("optimizer", 0) > 0) == ("nvme" in opts), (stage, mem)


def test_parameter_offload_needs_zero3():
    _, model = make_models()
    with pytest.raises(ValueError, match="only ZeRO-3"):
        zf.compose(zf.shard_grads(), zf.offload("cpu", params=True))(
            model, make_optimizer("sgd", model.parameters()))


def nvme_fault(rank, world, path):
    return error_of(build_parity, 1, "adamw", zf.offload("nvme", path=path))


@pytest.mark.multirank
def test_nvme_path_faults_fail_at_set_up_on_every_rank(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    for path, message in ((str(tmp_path / "missing"), "not an existing directory"),
                          (str(a_file), "not an existing directory")):
        for msg in run_ranks(2, nvme_fault, path, timeout=60):
            assert msg is not None and message in msg


def test_nvme_too_small_drive_is_named():
    from zerofn.core.plan import OffloadPolicy
    from zerofn.runtime.homes import optimizer_problems
    from zerofn.runtime.homes.nvme_file import nvme_problems
    _, model = make_models()
    problems = nvme_problems("/tmp", 2**60)
    assert problems and "GiB free" in problems[0]
    nvme = OffloadPolicy(device="nvme", path="/tmp")
    assert "Adam and AdamW only" in optimizer_problems(
        nvme, make_optimizer("sgd", model.parameters()), swapped=True)[0]
    assert not optimizer_problems(nvme, make_optimizer("adamw", model.parameters()), True)


@pytest.mark.multirank
def test_swap_files_of_a_killed_run_do_not_break_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"zerofn-rank0-{dead}.swap"
    stale.write_bytes(b"left by a killed run")
    errs = run_ranks(1, offload_vs_pytorch_nvme, str(tmp_path))
    assert errs[0][0] < 1e-5 and not stale.exists()


def two_nvme_models_in_one_process(rank, world, path):
    first, first_opt = build_offloaded(2, "adamw", {"nvme": True, "path": path})
    second, second_opt = build_offloaded(2, "adamw", {"nvme": True, "path": path})
    names = sorted(os.listdir(path))
    del first, first_opt
    gc.collect()
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    data = batches(3, 1, world)
    train_reference(ref, ref_opt, data)
    train_sharded(second, second_opt, data, rank, world)
    return names, sorted(os.listdir(path)), max_errors(ref, ref_opt, second, second_opt)


@pytest.mark.multirank
def test_two_models_offloaded_to_one_drive_in_one_process_keep_their_own_swap_files(tmp_path):
    """Each swap file has its own name: the second model's file was the first's (one per
    rank and process), opened with truncation, and removed when the first was freed."""
    names, left, errs = run_ranks(1, two_nvme_models_in_one_process, str(tmp_path))[0]
    assert len(names) == 2 and len(left) == 1 and left[0] in names
    assert errs[0] < 1e-5


def offload_vs_pytorch_nvme(rank, world, path):
    ref, _ = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    model, opt = build_offloaded(2, "adamw", {"nvme": True, "path": path})
    data = batches(3, 1, world)
    train_reference(ref, ref_opt, data)
    train_sharded(model, opt, data, rank, world)
    return max_errors(ref, ref_opt, model, opt)


def offload_state_dicts(rank, world, path):
    """State moves cpu-offload -> nvme-offload -> plain, and training continues identically."""
    src, src_opt = build_offloaded(3, "adamw", {"params": True})
    train_sharded(src, src_opt, batches(3, 1, world), rank, world)
    msd, osd = zf.get_state_dict(src, src_opt)
    results = []
    for opts in ({"nvme": True, "path": path}, None):
        dst, dst_opt = build_offloaded(2, "adamw", opts)
        zf.set_state_dict(dst, dst_opt, msd, osd)
        data = batches(2, 1, world, seed=9)
        results.append((dst, dst_opt, data))
    train_sharded(src, src_opt, batches(2, 1, world, seed=9), rank, world)
    want = zf.get_state_dict(src, src_opt, full=True)
    errs = []
    for dst, dst_opt, data in results:
        train_sharded(dst, dst_opt, data, rank, world)
        got = zf.get_state_dict(dst, dst_opt, full=True)
        errs.append(max(state_errors(want, got)))
    return errs


@pytest.mark.multirank
def test_state_dicts_move_between_offload_modes(at_world_2):
    for errs in at_world_2["state dicts"]:
        assert errs[0] < 1e-6 and errs[1] < 1e-6, errs


def bf16_offload_runs(rank, world, path):
    """bf16 + offload: CPU Adam writes the bf16 compute copy in its pass (NVMe: into the
    staging ring, the frozen embedding and padding cast after it), and SGD's updated
    masters are cast into it; the run follows the same bf16 run without offload (CPU Adam
    and torch's AdamW differ by an ulp at most)."""
    out = {}
    data = batches(5, 1, world)
    nvme = {"nvme": True, "path": path}
    for kind, stage in [("adamw", 1), ("adamw", 2), ("adamw", 3), ("sgd", 2), ("sgd", 3)]:
        runs = []
        params = {"params": True} if stage == 3 else {}
        for opts in (None, {}, params) + ((nvme, dict(nvme, **params)) if kind == "adamw" else ()):
            model, opt = build_offloaded(stage, kind, opts, precision=torch.bfloat16)
            train_sharded(model, opt, data, rank, world)
            runs.append(zf.get_state_dict(model, opt, full=True)[0])
        out[(kind, stage)] = max(max(worst(runs[0][k] - r[k]) for k in r) for r in runs[1:])
    return out


@pytest.mark.multirank
def test_bf16_offload_follows_bf16_without_offload(at_world_2):
    for by_stage in at_world_2["bf16"]:
        for config, err in by_stage.items():
            assert err < 1e-6, (config, err)


def state_locals_runs(rank, world):
    out = {}
    for name, params in (("offload", False), ("offload params", True)):
        model, opt = build_parity(3, "adamw", zf.offload("cpu", params=params))
        train_sharded(model, opt, batches(1, 1, world), rank, world)
        out[name] = sharded_state_locals(model, opt)
    return out


@pytest.mark.multirank
def test_sharded_state_dicts_under_offload_are_views_of_the_host_arenas(at_world_2):
    """Sharded state dicts hand out the host rows themselves (DCP saves and loads through
    them): no copy, and on a GPU no copy to the device (tests/test_cuda.py)."""
    for by_config in at_world_2["state locals"]:
        for name, locals_ in by_config.items():
            optim = {k: v for k, v in locals_.items() if k.startswith("optim.")}
            assert optim and all(v == ("cpu", True) for v in optim.values()), (name, optim)
            model = {k: v for k, v in locals_.items() if k.startswith("model.")}
            if name == "offload params":
                assert model and all(v == ("cpu", True) for v in model.values()), model
