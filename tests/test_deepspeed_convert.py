"""DeepSpeed checkpoints in: ``python -m zerofn.deepspeed.convert`` on real DeepSpeed 0.19.8
checkpoints (tests/data/deepspeed_checkpoints, made by tools/make_deepspeed_checkpoints.py).

Each converts to exactly DeepSpeed's own fp32 consolidation, Adam moments, steps and loss
scale; loads into zerofn at worlds 1, 2 and 4 and every stage; and zerofn's next two
training steps give the losses DeepSpeed recorded for them. Broken checkpoints get errors
that say what is wrong.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from support import SLOW
from support.compare import worst
from support.errors import expect_error
from support.loops import zero
from support.ranks import run_ranks
from zerofn.deepspeed import ds_files, ds_read
from zerofn.deepspeed.convert import convert, main, read_checkpoint
from zerofn.runtime.optimizer import SCALER_KEY

pytestmark = pytest.mark.deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "deepspeed_checkpoints")
TOOL_PATH = os.path.join(HERE, "..", "tools", "make_deepspeed_checkpoints.py")


def _tool():
    """The generator defines the model, its param groups and the data; import it as is."""
    spec = importlib.util.spec_from_file_location("make_deepspeed_checkpoints", TOOL_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TOOL = _tool()
CASES = sorted(TOOL.CASES)
# zerofn's next two steps against DeepSpeed's. fp32: the losses within 1e-5 and the fp32
# masters after them within 1e-6 (measured: 5e-7 and 1.2e-7, the latter DeepSpeed's C++ CPU
# Adam against torch's AdamW; 4e-9 with torch's AdamW on both sides). bf16/fp16: DeepSpeed
# records each rank's loss as a 16-bit number, and the loss is computed in 16 bits, so at
# DeepSpeed's own world size (the same rows per rank) the losses agree within 1e-5
# (measured: exactly), while at another world size the rounding falls elsewhere: within two
# 16-bit steps of the loss (bf16 2**-6 apart near 3.1, fp16 2**-9; measured 0.67 and 1.5
# steps). Their masters differ by the 16-bit gradient reductions: within 2e-4, a fifth of one
# Adam update at lr 1e-3 (measured 9e-5; fp16 at DeepSpeed's world size: exactly equal).
LOSS_TOL = {"fp32": 1e-5, "bf16": 2 * 2 ** -6, "fp16": 2 * 2 ** -9}
SAME_WORLD_LOSS_TOL = 1e-5
MASTER_TOL = {"fp32": 1e-6, "bf16": 2e-4, "fp16": 2e-4}
EXTRAS = ("epoch", "samples_seen", "deepspeed")


def checkpoint_dir(name: str) -> str:
    return os.path.join(DATA, name, "checkpoint")


def reference(name: str) -> dict:
    return torch.load(os.path.join(DATA, name, "reference.pt"), weights_only=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every committed checkpoint converted once: ``{case: (zerofn root, read checkpoint)}``."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name in CASES:
        _, ck = convert(checkpoint_dir(name), root / name)
        out[name] = (str(root / name), ck)
    return out


# -- the conversion equals DeepSpeed's own view ---------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_weights_moments_and_steps_equal_deepspeeds(converted, name):
    _, ck = converted[name]
    ref, case = reference(name), TOOL.CASES[name]
    assert (ck.stage, ck.world, ck.step) == (case.stage, case.world, ref["global_step"])
    for fqn, master in ref["master"].items():   # safe_get_full_fp32_param: bit for bit
        assert torch.equal(ck.model[fqn], master), fqn
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ck.optim["state"][fqn][key], ref[key][fqn]), (fqn, key)
        step = ck.optim["state"][fqn]["step"]
        assert step.dtype == torch.float32 and step.item() == ref["adam_step"], fqn
    if ref["zero_to_fp32"] is not None:          # zero_to_fp32: the same tensors, every name
        for fqn, value in ref["zero_to_fp32"].items():
            expected = value.float() if value.is_floating_point() else value
            assert torch.equal(ck.model[fqn], expected), fqn
    if case.parameter_alignment:   # the layout this case is for: padding between parameters
        file = os.path.join(checkpoint_dir(name), "global_step3",
                            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        osd = ds_files.load_file(file, "optimizer_state_dict")["optimizer_state_dict"]
        assert any(any(group) for group in osd["param_alignment_paddings"])
    # zero_to_fp32 drops ZeRO-1's frozen parameters; the module state keeps them.
    assert ck.model["pos.weight"].shape == (TOOL.CONFIG["context"], TOOL.CONFIG["width"])
    assert ck.model["head.weight"] is ck.model["tok.weight"]
    assert ck.model["shift"].dtype == torch.int64
    assert set(ck.optim["state"]) == set(ref["master"])


@pytest.mark.parametrize("name", CASES)
def test_param_groups_scaler_and_extras(converted, name):
    _, ck = converted[name]
    ref, case = reference(name), TOOL.CASES[name]
    decay, no_decay = ck.optim["param_groups"]
    assert (decay["lr"], decay["weight_decay"]) == (TOOL.LR, TOOL.WEIGHT_DECAY)
    assert (no_decay["lr"], no_decay["weight_decay"]) == (TOOL.NO_DECAY_LR, 0.0)
    assert decay["decoupled_weight_decay"] is True   # AdamW, also from DeepSpeed's CPU Adam
    model = TOOL.TinyLM()
    expected = [[n for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2],
                [n for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]]
    assert [sorted(g["params"]) for g in (decay, no_decay)] == [sorted(e) for e in expected]
    if case.dtype == "fp16":
        assert ck.optim[SCALER_KEY]["scale"] == ref["loss_scale"] == 2.0 ** 15
        assert ref["skipped_steps"] == 2 and ref["adam_step"] == 1
    else:
        assert SCALER_KEY not in ck.optim
    info = ck.extras["deepspeed"]
    assert (info["zero_stage"], info["world_size"], info["dtype"]) == \
        (case.stage, case.world, case.dtype)
    assert info["gradient_clipping"] == TOOL.CLIP
    assert {k: ck.extras[k] for k in TOOL.CLIENT_STATE} == TOOL.CLIENT_STATE


# -- the converted checkpoint trains on in zerofn like DeepSpeed did --------------------
def build(name: str, stage: int, offload: bool, scaling: dict):
    case = TOOL.CASES[name]
    model = TOOL.TinyLM()
    # Hyperparameters unlike DeepSpeed's: the checkpoint's must replace them.
    opt = torch.optim.AdamW(TOOL.param_groups(model), lr=0.5, weight_decay=0.0)
    transforms = [zero(stage)]
    if case.dtype == "bf16":   # BF16_Optimizer reduces fp32 gradients, ZeRO in bf16
        transforms.append(zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32
                                             if case.grad_accum_fp32 else None))
    elif case.dtype == "fp16":
        transforms.append(zf.mixed_precision(torch.float16, **scaling))
    if offload:
        transforms.append(zf.offload("cpu"))
    return zf.compose(*transforms)(model, opt)


def continue_training(rank, world, runs):
    """For each (root, case, stage, offload, fp16 loss-scaling options): load the converted
    checkpoint, check it against DeepSpeed's reference, train DeepSpeed's next two steps;
    return their losses and how far the fp32 masters then are from DeepSpeed's."""
    results = []
    for root, name, stage, offload, scaling in runs:
        ref = reference(name)
        model, opt = build(name, stage, offload, scaling)
        got = zf.load_checkpoint(root, model, opt, **{k: None for k in EXTRAS})
        assert got["step"] == ref["global_step"] and got["epoch"] == 1, got
        assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == \
            [(TOOL.LR, TOOL.WEIGHT_DECAY), (TOOL.NO_DECAY_LR, 0.0)]
        msd, osd = zf.get_state_dict(model, opt, full=True)
        for fqn, master in ref["master"].items():
            assert torch.equal(msd[fqn], master), (name, fqn)
            assert torch.equal(osd["state"][fqn]["exp_avg_sq"], ref["exp_avg_sq"][fqn]), fqn
        losses = []
        for step in range(TOOL.BEFORE, TOOL.BEFORE + TOOL.AFTER):
            x, y = TOOL.rank_rows(TOOL.global_batch(step), rank, world)
            loss = model(x, y)
            zf.scale_loss(model, loss).backward()
            zf.clip_grad_norm_(model, got["deepspeed"]["gradient_clipping"])
            opt.step()
            opt.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        msd, _ = zf.get_state_dict(model, opt, full=True)
        drift = max(worst(msd[k] - v) for k, v in ref["after"]["master"].items())
        results.append((losses, drift))
    return results


def check_losses(runs, results, world: int):
    for (_, name, stage, offload, _), (losses, drift) in zip(runs, results):
        case, ref = TOOL.CASES[name], reference(name)
        tol = SAME_WORLD_LOSS_TOL if world == case.world else LOSS_TOL[case.dtype]
        err = max(abs(a - b) for a, b in zip(losses, ref["losses"][TOOL.BEFORE:]))
        assert err <= tol, (name, stage, offload, losses, ref["losses"], err)
        assert drift <= MASTER_TOL[case.dtype], (name, stage, offload, drift)


def run(converted, name: str, stage: int, offload: bool) -> tuple:
    """One continuation; fp16 takes DeepSpeed's loss-scaling settings, which the
    conversion hands over as zerofn's mixed_precision options."""
    root, ck = converted[name]
    return root, name, stage, offload, ck.extras["deepspeed"].get("loss_scaling", {})


def matrix(world: int) -> list[tuple[str, int, bool]]:
    """(case, stage, offload) to continue at ``world``: every case at one stage, rotating so
    that the two worlds together give each case two stages and each world every stage;
    the cases DeepSpeed offloaded continue under zerofn's offload at world 2.
    ZEROFN_SLOW=1: every case at every stage, with and without offload."""
    if SLOW:
        return [(name, stage, offload) for name in CASES for stage in (1, 2, 3)
                for offload in (False, True)[:1 + TOOL.CASES[name].offload]]
    return [(name, 1 + (i + world) % 3, TOOL.CASES[name].offload and world == 2)
            for i, name in enumerate(CASES)]


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_next_step_losses_equal_deepspeeds(converted, world):
    runs = [run(converted, *spec) for spec in matrix(world)]
    results = run_ranks(world, continue_training, runs)
    assert all(r == results[0] for r in results)
    check_losses(runs, results[0], world)


@pytest.mark.multirank
def test_next_step_losses_at_world_4(converted):
    runs = [run(converted, "zero3_fp32_w3", 3, False)]
    check_losses(runs, run_ranks(4, continue_training, runs)[0], 4)


# -- the command line, without DeepSpeed -------------------------------------------------
def test_command_line_runs_where_deepspeed_cannot_be_imported(tmp_path):
    """``python -m zerofn.deepspeed.convert`` with every ``import deepspeed`` failing."""
    out = tmp_path / "zf"
    code = ("import runpy, sys; sys.modules['deepspeed'] = None; "
            "sys.argv = ['convert', sys.argv[1], sys.argv[2]]; "
            "runpy.run_module('zerofn.deepspeed.convert', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, checkpoint_dir("zero3_fp32_w3"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ZeRO-3" in done.stdout and "world size 3" in done.stdout
    assert (out / "latest").read_text().strip() == "step-00000003"
    saved = _saved_keys(out / "step-00000003")
    assert sorted(read_checkpoint(checkpoint_dir("zero3_fp32_w3")).model) == \
        sorted(k[len("model."):] for k in saved if k.startswith("model."))


def _saved_keys(ckpt) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def test_step_dir_and_tag_are_accepted(tmp_path, capsys):
    step_dir = os.path.join(checkpoint_dir("zero1_fp32_w1"), "global_step3")
    assert main([step_dir, str(tmp_path / "a")]) == 0
    save_dir = checkpoint_dir("zero1_fp32_w1")
    assert main([save_dir, str(tmp_path / "b"), "--tag", "global_step3"]) == 0
    assert main([save_dir, str(tmp_path / "c"), "--tag", "global_step9"]) == 1
    assert "no checkpoint tagged 'global_step9'" in capsys.readouterr().err
    assert main([step_dir, str(tmp_path / "a")]) == 1   # never overwrites
    assert "step-00000003 exists" in capsys.readouterr().err


def patched_load(monkeypatch, change):
    """Read the committed files, then ``change(key, data)`` before the converter sees them."""
    real = ds_read.load_file

    def load(path, key, *trusted):
        data = real(path, key, *trusted)
        change(key, data)
        return data

    monkeypatch.setattr(ds_read, "load_file", load)


def test_client_state_that_cannot_ride_along_is_dropped_and_said(monkeypatch):
    def change(key, data):
        if key == "param_shapes":   # the model file: three more client-state keys
            scaler = type("DynamicLossScaler", (ds_files.StandIn,),
                          {"path": "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"})
            data.update(step=7, deepspeed="mine", scaler={"inner": [scaler()]})
    patched_load(monkeypatch, change)
    ck = read_checkpoint(checkpoint_dir("zero1_fp32_w1"))
    assert ck.step == 3 and ck.extras["deepspeed"]["zero_stage"] == 1
    assert "scaler" not in ck.extras and ck.extras["epoch"] == 1
    assert [n.split(";")[0] for n in ck.notes] == [
        "client state 'step' collides with zerofn's own extra",
        "client state 'deepspeed' collides with zerofn's own extra",
        "client state 'scaler' holds deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"]


def test_static_fp16_loss_scale(monkeypatch):
    """DeepSpeed's fp16 "loss_scale": 128 keeps a static LossScaler in place of the dynamic one."""
    def change(key, data):
        if key == "optimizer_state_dict":
            osd = data[key]
            osd["loss_scaler"].state = {"cur_scale": 128.0, "dynamic": False}
            osd["dynamic_loss_scale"] = False
    patched_load(monkeypatch, change)
    ck = read_checkpoint(checkpoint_dir("zero2_fp16_w2"))
    assert ck.optim[SCALER_KEY] == {"scale": 128.0, "hysteresis_left": 1, "iteration": 3,
                                    "last_overflow": -1}
    assert ck.extras["deepspeed"]["loss_scaling"] == {"loss_scale": 128.0}


def test_checkpoint_saved_before_the_first_step(monkeypatch, tmp_path):
    def change(key, data):
        if key == "optimizer_state_dict":
            data[key]["optimizer_state_dict"]["state"].clear()
    patched_load(monkeypatch, change)
    _, ck = convert(checkpoint_dir("zero3_fp32_w3"), tmp_path)
    assert ck.optim["state"] == {} and "had no optimizer state yet" in ck.notes[0]
    assert all(len(g["params"]) for g in ck.optim["param_groups"])


# -- clear errors on what is not a convertible checkpoint --------------------------------
def copy_case(name: str, tmp_path) -> str:
    dst = tmp_path / name
    shutil.copytree(checkpoint_dir(name), dst)
    return str(dst / "global_step3")


def test_not_a_deepspeed_checkpoint(tmp_path):
    expect_error(["is not a DeepSpeed checkpoint", "latest"], read_checkpoint, str(tmp_path))
    expect_error(["is not a directory"], read_checkpoint, str(tmp_path / "nowhere"))
    (tmp_path / "latest").write_text("global_step7")
    expect_error(["names 'global_step7'", "does not exist"], read_checkpoint, str(tmp_path))


@pytest.mark.parametrize("name, removed, fragments", [
    ("zero3_fp32_w3", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
     ("optimizer files of data-parallel ranks [1] are missing", "found 2 of the 3")),
    ("zero3_fp32_w3", "zero_pp_rank_2_mp_rank_00_model_states.pt",
     ("model-state files of data-parallel ranks [2] are missing",)),
    ("zero1_fp32_w1", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
     ("no *_optim_states.pt", "without ZeRO")),
    ("zero2_bf16_w3", "mp_rank_00_model_states.pt", ("no *_model_states.pt",)),
])
def test_missing_file(tmp_path, name, removed, fragments):
    step_dir = copy_case(name, tmp_path)
    os.remove(os.path.join(step_dir, removed))
    expect_error(fragments, read_checkpoint, step_dir)


@pytest.mark.parametrize("name, source, added, fragments", [
    # a world-3 run's rank-2 file among a world-2 run's
    ("zero2_fp16_w2",
     "zero2_bf16_w3/checkpoint/global_step3/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
     "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
     ("mismatched files", "world size 2", "world size 3")),
    # rank 0's model file from the world-3 run
    ("zero2_fp16_w2", "zero2_bf16_w3/checkpoint/global_step3/mp_rank_00_model_states.pt",
     "mp_rank_00_model_states.pt", ("mismatched files", "world size 3", "optimizer files at 2")),
    # a second model-parallel rank
    ("zero1_fp32_w1", "zero1_fp32_w1/checkpoint/global_step3/mp_rank_00_model_states.pt",
     "mp_rank_01_model_states.pt", ("mp_rank_00, mp_rank_01", "tensor- or pipeline-parallel")),
    ("zero1_fp32_w1", "zero1_fp32_w1/checkpoint/global_step3/mp_rank_00_model_states.pt",
     "layer_01-model_states.pt", ("pipeline-parallel", "layer_01-model_states.pt")),
])
def test_foreign_file(tmp_path, name, source, added, fragments):
    step_dir = copy_case(name, tmp_path)
    shutil.copy(os.path.join(DATA, source), os.path.join(step_dir, added))
    expect_error(fragments, read_checkpoint, step_dir)


def test_optimizer_state_offloaded_to_nvme(tmp_path):
    step_dir = copy_case("zero3_fp32_w3", tmp_path)
    os.makedirs(os.path.join(step_dir, "offloaded_tensors", "rank0"))
    expect_error(["offloaded_tensors", "NVMe"], read_checkpoint, step_dir)


def test_corrupt_file(tmp_path):
    step_dir = copy_case("zero1_fp32_w1", tmp_path)
    with open(os.path.join(step_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb") as f:
        f.write(b"not a checkpoint")
    expect_error(["cannot read", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], read_checkpoint,
                 step_dir)
