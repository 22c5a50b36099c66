"""zerofn as a Lightning strategy (zerofn.integrations.lightning, docs/lightning.md).

Two launches do the training (tests/scripts/lightning_jobs.py, one module-scoped fixture each):
``two`` under torchrun on two gloo ranks, ``one`` in a single process. Each run starts
from seed 0 and reads the same global batches: 2 epochs of 10 steps, 2 micro-batches a
step, clipped at global norm 1, AdamW with an LR warm-up. The tests compare what the runs
recorded. The options, precision mapping and refusals that need no ranks run here.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="needs the lightning package (pip install -e '.[lightning]')")

import lightning as L  # noqa: E402
from lightning.pytorch.plugins.precision import (DoublePrecision, HalfPrecision,  # noqa: E402
                                                 MixedPrecision, Precision)
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

import zerofn.integrations.lightning as zl  # noqa: E402
from zerofn import cli  # noqa: E402
from zerofn.consolidate import to_full  # noqa: E402
from support import SLOW  # noqa: E402
from support.compare import TOL  # noqa: E402
from support.imports import loaded_by_zerofn  # noqa: E402
from support.jobs import ROOT, SCRIPT_PATH, SCRIPTS, finish, torchrun  # noqa: E402
from support.lightning_gpt import VAL_WINDOWS, LitGPT, Windows  # noqa: E402
from support.tensorboard_runs import read  # noqa: E402

JOBS = os.path.join(SCRIPTS, "lightning_jobs.py")
FABRIC_NAMES = ("zerofn_stage_2_offload", "zerofn_stage_3")    # the jobs' default subset
STOPPED = "ckpt/epoch=0-step=10.ckpt"                          # ModelCheckpoint's, step 10
STRAIGHT = "trainer-zerofn_stage_3"         # ZeRO-3 not stopped (lightning_jobs.py's)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    flags = ["two", str(out)] + (["--every-name"] if SLOW else [])
    code, output, _ = finish(torchrun(["--standalone", "--nproc-per-node", "2"], flags,
                                      script=JOBS), timeout=900)
    assert code == 0, output[-6000:]
    return out


@pytest.fixture(scope="module")
def one(two) -> Path:
    env = dict(os.environ, PYTHONPATH=SCRIPT_PATH, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, JOBS, "one", str(two)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return two


def record(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def gap(a: dict, b: dict) -> float:
    """The largest difference between two runs' final weights (the same names in both)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def same_run(run: dict, ref: dict, skip: int = 0) -> None:
    """``run`` followed ``ref`` from ``ref``'s micro-batch ``skip`` (step ``skip / 2``)."""
    assert gap(run["weights"], ref["weights"]) < TOL
    assert len(run["losses"]) == len(ref["losses"]) - skip
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][skip:])) < TOL
    assert run["lrs"] == ref["lrs"][skip // 2:]


# -- following DDP ----------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("name", zl.STRATEGY_NAMES)
def test_the_trainer_follows_ddp_under_each_registered_name(two, name):
    ddp = record(two, "trainer-ddp")
    run = record(two, f"trainer-{name}")
    same_run(run, ddp)
    assert run["global_step"] == 20
    # torch's LR scheduler finds torch's own optimizer.step (no "overridden" warning), and
    # callbacks that read the module's state (EMA) see the sharded state dict FSDP gives.
    assert run["overridden"] == 0
    assert run["module_state"].keys() == ddp["module_state"].keys()
    assert set(run["module_state"].values()) == {"DTensor"}


@pytest.mark.multirank
def test_hybrid_sharding_and_manual_optimization_follow_ddp(two):
    """``device_mesh=(2, 1)``: two replicas of one shard (HSDP), ZeRO-3; and a
    LightningModule stepping its optimizer itself (manual optimization, ZeRO-2)."""
    same_run(record(two, "trainer-hsdp"), record(two, "trainer-ddp"))
    same_run(record(two, "manual-zerofn_stage_2"), record(two, "manual-ddp"))


@pytest.mark.multirank
def test_clipping_and_training_move_the_weights_beyond_the_tolerance(two):
    """Parity within TOL means something: without clipping the run lands elsewhere, and
    training moved the weights far from where they started."""
    ddp = record(two, "trainer-ddp")
    assert gap(record(two, "trainer-ddp-unclipped")["weights"], ddp["weights"]) > 100 * TOL
    assert ddp["losses"][-1] < ddp["losses"][0] - 0.3


@pytest.mark.multirank
@pytest.mark.parametrize("name", [
    n if n in FABRIC_NAMES else
    pytest.param(n, marks=pytest.mark.slow(reason="Fabric under every name: 4 more runs"))
    for n in zl.STRATEGY_NAMES])
def test_fabric_follows_ddp(two, name):
    ddp = record(two, "fabric-ddp")
    run = record(two, f"fabric-{name}")
    assert gap(run["weights"], ddp["weights"]) < TOL
    assert max(abs(a - b) for a, b in zip(run["losses"], ddp["losses"])) < TOL


@pytest.mark.multirank
def test_fabric_checkpoints_move_between_stages_and_formats(two):
    """Fabric's ZeRO-3 directory into a model set up alone (ZeRO-2) and into a model and
    optimizer (ZeRO-1), saved from there as one full file, that loaded at ZeRO-3: the same
    weights and Adam moments, and the plain value ("step") comes back."""
    trained = record(two, "fabric-zerofn_stage_3")["weights"]
    moved = record(two, "fabric-checkpoints")
    assert gap(moved["alone"]["weights"], trained) == 0 and moved["alone"]["step"] == 20
    assert gap(moved["full"], trained) == 0 and moved["step"] == 20
    assert moved["moment_gap"] == 0
    assert moved["by_name"]        # optimizer.state_dict(): zerofn's, keyed by name


@pytest.mark.multirank
def test_clipping_by_value_follows_ddp(two):
    run = record(two, "value-zerofn_stage_2")
    assert "error" not in run, run.get("error")
    same_run(run, record(two, "value-ddp"))


# -- checkpoints ------------------------------------------------------------------------
@pytest.mark.multirank
def test_resumed_at_another_stage_follows_the_run_not_stopped(two):
    """ZeRO-3 stopped at step 10 by ModelCheckpoint, resumed at ZeRO-2 (sharded) and at
    ZeRO-1 (from one full file): weights, losses, LR schedule and Lightning's counters."""
    straight = record(two, STRAIGHT)
    for name in ("resumed-world2-stage2", "resumed-full-stage1"):
        run = record(two, name)
        same_run(run, straight, skip=20)
        assert run["start"] == dict(global_step=10, epoch=1, scheduler_step=10,
                                    lr=straight["lrs"][10], loss_scale=None), name
        assert (run["global_step"], run["epoch"]) == (20, 2)


@pytest.mark.multirank
def test_ddps_checkpoint_resumes_under_zero3(two):
    """A run switched from DDP to zerofn at step 10 by changing the strategy's name: DDP's
    file (full weights, optimizer state keyed by index) resumes under ZeRO-3."""
    run = record(two, "resumed-from-ddp")
    same_run(run, record(two, "trainer-ddp"), skip=20)
    assert run["start"]["global_step"] == 10


@pytest.mark.multirank
def test_resumed_on_one_device_follows_the_run_not_stopped(one):
    straight = record(one, STRAIGHT)
    run = record(one, "resumed-world1-stage1")
    same_run(run, straight, skip=20)
    assert run["start"]["global_step"] == 10 and run["start"]["epoch"] == 1


@pytest.mark.multirank
def test_checkpoints_on_disk(two):
    """ModelCheckpoint's path holds zerofn's DCP checkpoint with Lightning's entries; the
    full one is Lightning's own file, full tensors and optimizer state by name."""
    sharded = two / STOPPED
    assert sorted(os.listdir(sharded)) == ["latest", "step-00000010"]
    keys = FileSystemReader(str(sharded / "step-00000010")).read_metadata().state_dict_metadata
    assert "extra.lightning" in keys and "model.model.blocks.0.fc.weight" in keys
    assert any(k.startswith("optim.state.model.tok.weight.exp_avg") for k in keys)
    full = torch.load(two / "full.ckpt", weights_only=False)
    assert {"state_dict", "optimizer_states", "loops", "lr_schedulers", "epoch"} <= set(full)
    assert full["state_dict"]["model.tok.weight"].shape == (256, 48)
    assert "model.tok.weight" in full["optimizer_states"][0]["state"]


@pytest.mark.multirank
def test_a_zero3_checkpoint_loads_into_a_plain_lightning_module(two, tmp_path):
    """``zerofn consolidate to-full --lightning``: LightningModule.load_from_checkpoint
    reads it; without --lightning, torch.load gives the module's own state dict. And the
    validation loss ``trainer.validate`` found under ZeRO-3 is the plain module's."""
    stopped = record(two, "stopped")["weights"]
    for out, extra in ((tmp_path / "gpt.ckpt", ["--lightning"]), (tmp_path / "gpt.pt", [])):
        assert cli.main(["consolidate", "to-full", str(two / STOPPED), str(out), *extra]) == 0
    plain = LitGPT.load_from_checkpoint(tmp_path / "gpt.ckpt")
    assert plain.hparams.world == 2 and gap(full_state(plain), stopped) == 0
    module = LitGPT()
    module.load_state_dict(torch.load(tmp_path / "gpt.pt"))
    assert gap(full_state(module), stopped) == 0
    # trainer.validate(ckpt_path=) of the checkpoint, sharded at ZeRO-3 to evaluate
    windows = Windows(VAL_WINDOWS, held_out=True)
    with torch.no_grad():
        plain = torch.stack([module(*windows[i:i + 1]) for i in range(len(windows))]).mean()
    assert abs(record(two, "validated")["val_loss"] - plain.item()) < TOL


def test_consolidating_for_lightning_needs_lightnings_entries(tmp_path):
    """A checkpoint without them (here zerofn's to-dcp of a plain state dict) is refused,
    naming what is missing; so is a safetensors file as the output."""
    torch.save({"w": torch.ones(2, 3)}, tmp_path / "plain.pt")
    assert cli.main(["consolidate", "to-dcp", str(tmp_path / "plain.pt"),
                     str(tmp_path / "dcp")]) == 0
    with pytest.raises(ValueError, match=r"no Lightning entries \(extra.lightning\)"):
        to_full(tmp_path / "dcp", tmp_path / "out.ckpt", lightning=True)
    with pytest.raises(ValueError, match="a Lightning checkpoint is a torch.save file"):
        to_full(tmp_path / "dcp", tmp_path / "out.safetensors", lightning=True)


def full_state(module) -> dict:
    return {k: v.float() for k, v in module.state_dict().items()}


# -- meta device, precision, TensorBoard --------------------------------------------------
@pytest.mark.multirank
def test_configure_model_on_meta_never_holds_the_full_model(two):
    """A 57M-parameter GPT built in configure_model: each rank's resident memory rose by
    its share and about a unit while set-up materialized it, well below the model."""
    peak = record(two, "meta-peak")
    for rise in peak["rises"]:
        assert rise < peak["share"] + 2 * peak["largest"], (rise, peak)
        assert rise < 0.75 * peak["full"], f"set-up peak {rise / peak['full']:.2f}x the model"
    assert all(torch.isfinite(torch.tensor(record(two, "meta")["losses"])))


@pytest.mark.multirank
@pytest.mark.parametrize("flag", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_low_precision_trains(two, flag):
    losses = torch.tensor(record(two, flag)["losses"])
    assert losses.isfinite().all() and losses[-4:].mean() < losses[:4].mean() - 0.1


@pytest.mark.multirank
def test_fp16_loss_scale_rides_in_the_checkpoint(two):
    scale = record(two, "fp16-scale")
    assert scale["saved"] == scale["resumed"] < 2.0 ** 16     # an early overflow halved it
    keys = FileSystemReader(str(two / "fp16.ckpt" / "step-00000010")).read_metadata()
    assert {f"optim.zerofn_loss_scaler.{k}" for k in ("scale", "iteration")} <= \
        set(keys.state_dict_metadata)


@pytest.mark.multirank
def test_zerofn_series_land_in_the_tensorboard_logger_directory(two):
    """Beside LightningModule.log's, in the same run; the resumed fit numbers its steps on
    from the checkpoint's (11 to 20), so no step comes twice."""
    log_dir = record(two, "tensorboard-dir")["log_dir"]
    tags, norm_steps = set(), []
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        acc = read(path)
        tags |= set(acc.Tags()["scalars"])
        if "train/grad_norm" in acc.Tags()["scalars"]:
            norm_steps += [e.step for e in acc.Scalars("train/grad_norm")]
    assert "loss" in tags                                                  # Lightning's
    assert {"time/step", "train/grad_norm", "comm/reduce_scatter/bytes"} <= tags  # zerofn's
    assert sorted(norm_steps) == list(range(1, 21))


# -- what zerofn cannot honour ----------------------------------------------------------
@pytest.mark.multirank
def test_refusals_name_the_option_on_every_rank(two):
    by_rank = record(two, "refusals")["by_rank"]
    assert by_rank[0] == by_rank[1]
    for option, message in by_rank[0].items():
        assert message is not None and option in message, (option, message)


@pytest.mark.parametrize("flag", ["64-true", "16-true"])
def test_precisions_zerofn_cannot_train_are_refused_at_construction(flag):
    zl.register_strategies()
    with pytest.raises(ValueError, match=f"precision='{flag}'"):
        L.Trainer(strategy="zerofn_stage_3", precision=flag, accelerator="cpu", devices=1)


def test_options_are_checked_by_zerofns_transforms():
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        zl.ZeroStrategy(stage=4)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['offlaod'\]"):
        zl.ZeroStrategy(offlaod="cpu")
    with pytest.raises(TypeError, match=r"shard_params\(\)'s options \['prefetch'\] were given at stage 2"):
        zl.ZeroFabricStrategy(stage=2, prefetch=2)
    with pytest.raises(ValueError, match="ratio"):
        zl.ZeroStrategy(offload="cpu", offload_ratio=2.0)
    with pytest.raises(ValueError, match="state_dict_type"):
        zl.ZeroStrategy(state_dict_type="consolidated")
    strategy = zl.ZeroStrategy(stage=2, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype set, but precision='32-true'"):
        strategy.precision_plugin = Precision()


def test_lightning_plugins_become_zerofns():
    strategy = zl.ZeroStrategy()
    for plugin, flag in ((Precision(), "32-true"), (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
                         (MixedPrecision("16-mixed", "cpu"), "16-mixed"),
                         (HalfPrecision("bf16-true"), "bf16-true")):
        strategy.precision_plugin = plugin
        assert isinstance(strategy.precision_plugin, zl.ZeroPrecision)
        assert strategy.precision_plugin.precision == flag
    with pytest.raises(ValueError, match="DoublePrecision"):
        strategy.precision_plugin = DoublePrecision()


def test_the_names_are_registered_by_the_call_not_the_import():
    code = ("import zerofn.integrations.lightning as zl\n"
            "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "names = lambda: [n for n in zl.STRATEGY_NAMES\n"
            "                 if n in StrategyRegistry or n in STRATEGY_REGISTRY]\n"
            "print(len(names()))\n"
            "zl.register_strategies()\n"
            "print(len(names()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "6"]


def test_the_names_are_registered_with_the_trainer_and_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry
    zl.register_strategies()
    assert zl.STRATEGY_NAMES == ("zerofn_stage_1", "zerofn_stage_2", "zerofn_stage_2_offload",
                                 "zerofn_stage_3", "zerofn_stage_3_offload",
                                 "zerofn_stage_3_offload_nvme")
    nvme = StrategyRegistry.get("zerofn_stage_3_offload_nvme")
    assert isinstance(nvme, zl.ZeroStrategy)
    assert (nvme.zero.stage, nvme.zero.offload, nvme.zero.offload_params) == (3, "nvme", True)
    assert isinstance(STRATEGY_REGISTRY.get("zerofn_stage_2_offload"), zl.ZeroFabricStrategy)


def test_zerofn_itself_never_imports_lightning():
    lightning = {m for m in loaded_by_zerofn() if m.split(".")[0] in ("lightning",
                                                                      "pytorch_lightning")}
    assert not lightning, sorted(lightning)
