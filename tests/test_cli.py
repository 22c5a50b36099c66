"""The ``zerofn`` command line: dispatch, ``estimate`` (the 7B table, and its placement
against what zerofn measures on a live model), ``convert deepspeed`` and ``consolidate``
reachable. ``zerofn train`` itself runs in test_train.py."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import zerofn as zf
from support.loops import zero
from support.ranks import run_ranks
from zerofn import cli, train
from zerofn.core.estimate import estimate_placement, parse_count
from zerofn.nanogpt import GPT, PRESETS

HERE = os.path.dirname(os.path.abspath(__file__))


def test_console_script_and_module_dispatch_to_the_subcommands():
    scripts = importlib.metadata.entry_points(group="console_scripts").select(name="zerofn")
    assert [e.value for e in scripts] == ["zerofn.cli:main"], \
        "reinstall: pip install --no-build-isolation --no-deps -e ."
    done = subprocess.run([sys.executable, "-m", "zerofn", "--help"], capture_output=True,
                          text=True)
    assert done.returncode == 0
    for command in ("train", "plan", "probe", "estimate", "consolidate", "convert deepspeed"):
        assert f"zerofn {command}" in done.stdout, done.stdout
    done = subprocess.run([sys.executable, "-m", "zerofn", "trian"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "unknown command 'trian'" in done.stderr


def test_train_help_says_flags_override_the_config(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "an explicit flag wins over --config" in " ".join(out.split()), out
    for flag in ("--config", "--stage", "--precision", "--offload", "--nvme-path",
                 "--offload-params", "--grad-accum", "--activation-checkpointing", "--model",
                 "--save-dir", "--save-every", "--resume", "--nproc", "--tp"):
        assert flag in out, flag


def test_nproc_is_not_passed_on_to_torchrun():
    argv = ["--nproc", "4", "--stage", "2", "--nproc=3", "--model", "tiny"]
    assert train.without_nproc(argv) == ["--stage", "2", "--model", "tiny"]


# -- estimate ------------------------------------------------------------------------------
def test_estimate_prints_the_7b_table(capsys):
    assert cli.main(["estimate", "7B", "--world", "8"]) == 0
    out = capsys.readouterr().out
    totals = {int(s): float(t) for s, t in
              re.findall(r"^ZeRO-(\d) +device +\S+ +\S+ +\S+ +(\S+)$", out, re.M)}
    assert totals == {0: 112.0, 1: 38.5, 2: 26.25, 3: 14.0}, out


def test_estimate_places_offloaded_state(capsys):
    assert cli.main(["estimate", "7e9", "--world", "8", "--offload", "cpu",
                     "--offload-params"]) == 0
    rows = {place: [float(v) for v in values.split()] for place, values in
            re.findall(r"^ZeRO-3 +(\w+) +(.*)$", capsys.readouterr().out, re.M)}
    # bf16 shards (1.75 GB) to the host, where they are the bf16 rows the step writes, the
    # fp32 master and Adam state (10.5 GB) and the gradient landing buffer (1.75 GB); only
    # the bf16 gradient shard stays.
    assert rows == {"device": [0, 1.75, 0, 1.75], "host": [1.75, 1.75, 10.5, 14.0]}
    assert cli.main(["estimate", "--model", "tiny", "--world", "1", "--stage", "3",
                     "--precision", "fp32"]) == 0
    tiny = PRESETS["tiny"].params()
    row = re.search(r"^ZeRO-3 +device +(.*)$", capsys.readouterr().out, re.M).group(1)
    assert float(row.split()[-1]) == pytest.approx(16 * tiny / 1e9, abs=0.005)


@pytest.mark.parametrize("argv, expected", [
    (["7q"], "'7q' is not a parameter count"),
    ([], "give a parameter count (e.g. 7B) or --model PRESET"),
    (["7B", "--stage", "0", "--offload", "cpu"], "offload() shards nothing by itself"),
    (["7B", "--stage", "2", "--offload", "cpu", "--offload-params"], "only ZeRO-3"),
])
def test_estimate_refuses_what_cannot_be(argv, expected, capsys):
    assert cli.main(["estimate", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_estimate_counts_the_nvme_staging_ring_where_it_knows_the_largest_unit(capsys):
    def host_optimizer(argv):
        assert cli.main(["estimate", *argv, "--world", "2", "--stage", "3",
                         "--offload", "nvme"]) == 0
        out = capsys.readouterr().out
        return float(re.search(r"^ZeRO-3 +host +\S+ +\S+ +(\S+)", out, re.M).group(1)), out

    ring, out = host_optimizer(["--model", "1b"])   # the preset's blocks and root are known
    assert ring > 0 and "stages 2 units in host memory: counted" in out
    # a block of width 2048 (12 x 2048^2 parameters), half of it a rank's, 14 B a parameter
    one, _ = host_optimizer(["1B", "--largest-unit", str(12 * 2048 ** 2),
                             "--units-in-flight", "1"])
    assert one == pytest.approx(14 * 6 * 2048 ** 2 / 1e9, abs=0.005)
    none, out = host_optimizer(["1B"])
    assert none == 0 and "not counted (give --largest-unit, or --model)" in out


def test_parse_count():
    assert [parse_count(t) for t in ("7e9", "7B", "1.3b", "350M", "125_000", "2k")] == \
        [7_000_000_000, 7_000_000_000, 1_300_000_000, 350_000_000, 125_000, 2_000]


CONFIGS = [(stage, dtype, offload, False) for stage in (1, 2, 3)
           for dtype in (torch.float32, torch.bfloat16) for offload in (None, "cpu", "nvme")] \
    + [(3, dtype, offload, True) for dtype in (torch.float32, torch.bfloat16)
       for offload in ("cpu", "nvme")]


def measure(rank, world, configs):
    """zf.model_state_bytes after one step (before zero_grad, as the job's banner), the
    estimate for the same settings, and the slack padding and per-tensor counters allow."""
    out = []
    for stage, dtype, offload, params in configs:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            model = GPT(PRESETS["tiny"])   # every dim even: no row padding at 2 ranks
            # (the module, not its count: NVMe's staging ring is sized by its largest unit)
            est = estimate_placement(model, world, stage, dtype, offload=offload,
                                     offload_params=params)
            if stage == 1:   # ZeRO-1's whole gradients (the estimate's, a peak) live only
                # until its backward ends: after a step it holds the reduced rows, as ZeRO-2
                est["device"]["grads"] = estimate_placement(
                    model, world, 2, dtype, offload=offload)["device"]["grads"]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ts = [zero(stage)]
            ts += [zf.mixed_precision(dtype)] if dtype != torch.float32 else []
            ts += [zf.offload(offload, params=params, path=tmp)] if offload else []
            model, opt = zf.compose(*ts)(model, opt)
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
            zf.scale_loss(model, model(x, x)).backward()
            opt.step()
            held = zf.model_state_bytes(model)
            units = len(zf.runtime.runtime.runtime_of(model).units)
            slack = 256 * len(list(model.parameters())) + 4096 * units   # counters, blocks
            out.append(((stage, str(dtype), offload, params), held, est, slack))
    return out


@pytest.mark.multirank
def test_estimate_placement_matches_what_zerofn_holds():
    for (config, held, est, slack) in run_ranks(2, measure, CONFIGS, timeout=300)[0]:
        measured = {("device" if place == "cpu" else place): roles for place, roles in
                    held.items()}
        for place in ("device", "host", "nvme"):
            for role in ("params", "grads", "optimizer"):
                got = measured.get(place, {}).get(role, 0)
                want = est[place][role]
                assert abs(got - want) <= slack, (config, place, role, got, want)


def device_grads_under_a_ratio(rank, world):
    """The device's gradient bytes zerofn holds and the estimate's, with half the
    optimizer state offloaded, after two steps."""
    out = []
    for stage in (2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = GPT(PRESETS["tiny"])
            est = estimate_placement(model, world, stage, dtype, offload="cpu", ratio=0.5)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ts = [zero(stage)] + ([zf.mixed_precision(dtype)] if dtype != torch.float32 else [])
            model, opt = zf.compose(*ts, zf.offload("cpu", ratio=0.5))(model, opt)
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
            for _ in range(2):
                opt.zero_grad()
                zf.scale_loss(model, model(x, x)).backward()
                opt.step()
            out.append(((stage, str(dtype)), zf.model_state_bytes(model)["cpu"]["grads"],
                        est["device"]["grads"]))
    return out


@pytest.mark.multirank
def test_estimate_counts_one_gradient_buffer_for_the_devices_share():
    """Under ``ratio < 1`` the device's share steps from the reduced gradient shards where
    they lie (runtime/homes/device.py): no second landing buffer, on the device or off."""
    for config, held, est in run_ranks(2, device_grads_under_a_ratio)[0]:
        assert held == est, (config, held, est)


# -- convert and consolidate ---------------------------------------------------------------
@pytest.mark.deepspeed
def test_convert_deepspeed_and_consolidate_are_reachable(tmp_path, capsys):
    source = os.path.join(HERE, "data", "deepspeed_checkpoints", "zero1_fp32_w1", "checkpoint")
    out = tmp_path / "converted"
    assert cli.main(["convert", "deepspeed", source, str(out)]) == 0
    assert (out / "latest").read_text().strip() == "step-00000003"
    full = tmp_path / "full.pt"
    assert cli.main(["consolidate", "to-full", str(out), str(full)]) == 0
    weights = torch.load(full, weights_only=True)
    assert weights and all(torch.is_tensor(v) for v in weights.values())
    assert cli.main(["convert", "megatron", source, str(out)]) == 2
    assert "zerofn converts from: deepspeed" in capsys.readouterr().err
