"""The main job, run for real: ``python -m zerofn train --nproc 2`` starts two gloo ranks
under torchrun on a tiny model. Few jobs, each exercising several flags at once:

- a DeepSpeed config (ZeRO-3, bf16, optimizer and parameters offloaded to the host, its
  optimizer and scheduler) with flags overriding it and ``--offload-ratio 0.5`` keeping a
  share of the optimizer state on the device;
- ZeRO-1 with NVMe offload and fp16 loss scaling on the CPU;
- ZeRO-2 with gradient accumulation and activation checkpointing, interrupted by
  ``--stop-at`` and resumed, against the same run uninterrupted: the same losses and the
  same final weights, bit for bit (compared through ``zerofn consolidate``); then resumed
  on one rank, and started again once finished. That uninterrupted run is also the
  compiled job's reference and the tensor-parallel jobs';
- ZeRO-2 with the host's optimizer state placed by ``--offload-ratio auto``, logging to
  TensorBoard: also the reference of the host step during backward.

A launch costs seconds whatever its steps (the launcher and each rank import torch and
zerofn), so a run one test makes serves the others (module-scoped fixtures), and a job
that ends before its first step (the before-tp refusal, a finished run started again) runs
as the job's own ``train`` on ``run_ranks``'s ranks; one refusal still launches (a --tp 1
resume of a --tp 2 checkpoint), to show how the job says it and exits.

Settings that cannot run are refused on every rank before any collective (cheaper to
check through ``resolve`` on spawned ranks than through torchrun). ``load_checkpoint`` on
a first run is here too: the job's ``--resume`` relies on it.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import zerofn as zf
from support import slow_variant
from support.ranks import run_ranks
from support.tensorboard_runs import read, scalars, text
from zerofn import cli, train
from zerofn.deepspeed.schedulers import SCHEDULERS
from zerofn.nanogpt import GPT, PRESETS

TINY = ["--model", "tiny", "--context", "32", "--batch", "8", "--eval-batches", "2",
        "--log-every", "1"]
STEP = re.compile(r"^step +(\d+)/(\d+) +loss (\S+) +lr (\S+) +gnorm (\S+)(.*)$", re.M)


def run_job(*args: str, steps: int = 12, nproc: int = 2) -> str:
    cmd = [sys.executable, "-m", "zerofn", "train", "--nproc", str(nproc), *TINY, "--steps",
           str(steps), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def steps_of(out: str) -> dict[int, tuple[str, str, str, str]]:
    """{step: (loss, lr, gnorm, rest of the line)} as printed."""
    return {int(m.group(1)): m.group(3, 4, 5, 6) for m in STEP.finditer(out)}


def curve(out: str) -> dict[int, tuple[str, str, str]]:
    """{step: (loss, lr, gnorm)}: what must not depend on timing or interruption."""
    return {step: values[:3] for step, values in steps_of(out).items()}


def assert_learns(out: str, steps: int) -> dict:
    logged = steps_of(out)
    assert sorted(logged) == list(range(1, steps + 1)), out
    losses = [float(logged[s][0]) for s in sorted(logged)]
    # An untrained byte-level model guesses uniformly over 256 bytes.
    assert abs(losses[0] - math.log(256)) < 0.2, out
    assert losses[-1] < losses[0] - 0.5, out
    val = re.search(r"validation loss (\S+)", out)
    assert val and float(val.group(1)) < losses[0], out
    final = re.search(rf"^final loss (\S+) after {steps} steps \(ZeRO-\d, 2 ranks", out, re.M)
    assert final and final.group(1) == logged[steps][0], out
    return logged


RESUMED = ["--stage", "2", "--grad-accum", "2", "--activation-checkpointing"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """(save dir, output) of the ZeRO-2 job of RESUMED run through its 8 steps under
    --resume, saving at its end: the reference of the interrupted and resumed runs, of the
    compiled job, and of the tensor-parallel ones (one launch serving the three)."""
    root = tmp_path_factory.mktemp("whole")
    return root, run_job(*RESUMED, "--save-dir", str(root), "--resume", steps=8)


CONFIG = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,   # accumulation 2 at 2 ranks
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                  "warmup_num_steps": 4,
                                                  "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}, "overlap_comm": True},
}


@pytest.fixture(scope="module")
def config_job(tmp_path_factory):
    """The output of a job under CONFIG with flags over it: the config test's job, and with
    its --offload-ratio 0.5 the ratio test's."""
    config = tmp_path_factory.mktemp("config") / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    return run_job("--config", str(config), "--clip", "0.7", "--lr", "0.003",
                   "--offload-ratio", "0.5")


@pytest.mark.deepspeed
@pytest.mark.multirank
def test_config_file_with_offload_and_bf16_and_flags_over_it(config_job):
    out = config_job
    assert "plan: ZeRO-3, bf16 compute, fp32 masters, offload cpu (params too)" in out, out
    # The config's batch rule; the flag's clip and lr over the config's; its scheduler.
    assert "8 sequences of 32 bytes per step (2 x 2 on each of 2 ranks); clip 0.7; " \
           "AdamW lr 0.003, WarmupLR" in out, out
    logged = assert_learns(out, 12)
    # The config's WarmupLR (DeepSpeed's formula), stepping once per optimizer step.
    opt = torch.optim.AdamW([torch.zeros(1)], lr=3e-3)
    sched = SCHEDULERS["WarmupLR"](opt, **CONFIG["scheduler"]["params"])
    want = []
    for _ in range(12):
        want.append(f"{opt.param_groups[0]['lr']:.3e}")
        sched.step()
    assert [logged[s][1] for s in sorted(logged)] == want, out
    measured = re.search(r"^model state per rank, measured.*$", out, re.M).group(0)
    # Parameter shards, masters and Adam state on the host; on the device gradients and
    # the Adam state that --offload-ratio keeps there, no parameters.
    host = re.search(r"host (\S+) MiB \(params (\S+) MiB, grads (\S+) MiB, optimizer (\S+)",
                     measured)
    assert host and min(float(v) for v in host.groups()) > 0, measured
    assert re.search(r"device \(cpu\) \S+ MiB \(params 0.0 MiB", measured), measured


@pytest.mark.multirank
def test_low_precision_host_state_from_the_command_line():
    out = run_job("--stage", "2", "--precision", "bf16", "--offload", "cpu",
                  "--state-dtype", "int8", "--master-dtype", "bf16")
    assert "plan: ZeRO-2, bf16 compute, bf16 masters, int8 Adam state, offload cpu" in out, out
    assert_learns(out, 12)
    # The estimate and the measurement agree on the host's optimizer bytes (to the
    # layout's padding): bf16 masters, 8-bit moments and their scales.
    host = [float(x) for x in re.findall(r"host \S+ MiB \(params \S+ MiB, grads \S+ MiB, "
                                         r"optimizer (\S+) MiB", out)]
    assert len(host) == 2 and abs(host[0] - host[1]) < 0.05 * host[0], out


@pytest.mark.multirank
def test_a_share_of_the_state_on_the_device_from_the_command_line(config_job):
    """--offload-ratio 0.5 (over the config's ZeRO-3, parameters offloaded too)."""
    out = config_job
    assert re.search(r"offload cpu \(params too\), ratio 0.5 \(0\.\d\d in whole units\): \d "
                     r"of \d units keep their state on the device \(<root>", out), out
    assert_learns(out, 12)
    # The estimate follows the placement: the same optimizer bytes on each side.
    est, measured = (re.search(rf"^model state per rank, {w}.*$", out, re.M).group(0)
                     for w in ("estimated", "measured"))
    for place in (r"device", r"host"):
        opt = [re.search(place + r"[^|]*optimizer (\S+) MiB", line).group(1)
               for line in (est, measured)]
        assert opt[0] == opt[1], (place, est, measured)


HOST_STEP = ["--stage", "2", "--offload", "cpu", "--clip", "0", "--grad-accum", "2"]


@pytest.fixture(scope="module")
def auto_placed(tmp_path_factory):
    """(TensorBoard directory, output) of HOST_STEP's job under --offload-ratio auto: the
    auto placement test's job, and the host step test's reference (it steps after
    backward). (On the CPU the budget is in bytes; this one holds every unit, so after step 1
    only the step counters stay on the host.)"""
    logs = tmp_path_factory.mktemp("auto") / "tb"
    return logs, run_job(*HOST_STEP, "--offload-ratio", "auto", "--device-budget",
                         str(10**13), "--tensorboard", str(logs))


@pytest.mark.multirank
def test_auto_placement_is_printed_and_logged(auto_placed):
    """--offload-ratio auto: after step 1 rank 0 prints the placement and its reason, and
    TensorBoard gets the reason as text and the placement as scalars."""
    logs, out = auto_placed
    assert "offload cpu, ratio auto (placed after the first step, within a device budget " \
           "of 9,313.23 GiB), 3 units" in out, out
    placed = re.search(r"^placement after step 1: (ratio auto: first step's device peak "
                       r"[\d,]+ MiB of a 9,536,743 MiB budget; 3 of 3 units moved their "
                       r"optimizer state to the device \(\d+ MiB\)); on the device: (.*)$",
                       out, re.M)
    assert placed and sorted(placed.group(2).split(", ")) == ["<root>", "blocks.0",
                                                              "blocks.1"], out
    acc = read(str(logs))
    assert text(acc, "placement") == placed.group(1)
    assert scalars(acc, "placement/units_on_device") == {1: 3.0}
    assert scalars(acc, "placement/units_on_host") == {1: 0.0}
    device, host = (scalars(acc, f"placement/optimizer_bytes/{p}")[1] for p in ("device", "host"))
    assert host < 1024, host
    # The same bytes as the measured line after step 1 prints for the device's optimizer.
    measured = re.search(r"^model state per rank, measured.*$", out, re.M).group(0)
    on_device = re.search(r"device \(cpu\)[^|]*optimizer (\S+) MiB", measured)
    assert on_device and on_device.group(1) == f"{device / 2**20:.1f}", (device, measured)


@pytest.mark.multirank
def test_the_host_step_during_backward_from_the_command_line(auto_placed):
    """--overlap-step accumulates under no_sync and steps the host's units in backward:
    the same curve as the job that reduces every micro-batch and steps after backward
    (``auto_placed``: its optimizer state on the host for step 1, on the device after it;
    sums of the same gradients in another order and AdamW on either side: equal to the
    printed digits or one)."""
    overlapped = run_job(*HOST_STEP, "--overlap-step")
    assert "offload cpu, host step during backward" in overlapped, overlapped
    after = curve(auto_placed[1])
    assert sorted(after) == sorted(curve(overlapped)) == list(range(1, 13)), overlapped
    for step, (loss, lr, gnorm) in curve(overlapped).items():
        assert gnorm == "-" and lr == after[step][1]
        assert abs(float(loss) - float(after[step][0])) <= 2e-4, (step, loss, after[step])


@pytest.mark.multirank
def test_compiled_job_prints_the_uncompiled_curve(whole):
    """--compile BACKEND: torch.compile over the sharded model (aot_eager here: inductor's
    kernels round differently), under accumulation and activation checkpointing: the same
    losses, rates and norms step for step as the uncompiled job of the same flags."""
    compiled = run_job(*RESUMED, "--compile", "aot_eager", steps=8)
    assert "activation checkpointing on, torch.compile (aot_eager)" in compiled, compiled
    assert sorted(curve(compiled)) == list(range(1, 9)), compiled
    assert curve(compiled) == curve(whole[1])


@pytest.mark.multirank
def test_nvme_offload_with_fp16_loss_scaling_on_cpu(tmp_path):
    out = run_job("--stage", "1", "--precision", "fp16", "--offload", "nvme",
                  "--nvme-path", str(tmp_path))
    assert "plan: ZeRO-1, fp16 compute, fp32 masters, offload nvme at" in out, out
    assert re.search(r"^model state per rank, measured.* nvme \S+ MiB", out, re.M), out
    logged = steps_of(out)
    # Dynamic scaling starts at 2**16: the first steps overflow and are skipped (their lr
    # is kept for the next), until the scale has come down; then it learns.
    skipped = [s for s, (_, _, _, rest) in logged.items() if "skipped" in rest]
    assert skipped and skipped == list(range(1, len(skipped) + 1)), out
    assert f"{len(skipped)} skipped (fp16 overflow)" in out, out
    losses = [float(logged[s][0]) for s in sorted(logged)]
    assert losses[-1] < losses[0] - 0.5, out


@pytest.mark.multirank
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(whole, tmp_path, capsys):
    (whole, out_whole), parts = whole, tmp_path / "parts"
    # --resume on an empty save dir starts afresh (load_checkpoint returns None).
    assert f"no checkpoint in {whole} yet: starting at step 0" in out_whole, out_whole
    assert "(2 x 2 on each of 2 ranks)" in out_whole and "ZeRO-2" in out_whole
    assert "activation checkpointing on" in out_whole
    assert_learns(out_whole, 8)
    first = run_job(*RESUMED, "--save-dir", str(parts), "--save-every", "2", "--stop-at", "4",
                    steps=8)
    assert sorted(steps_of(first)) == [1, 2, 3, 4], first
    assert sorted(os.listdir(parts)) == ["latest", "step-00000002", "step-00000004"]
    second = run_job(*RESUMED, "--save-dir", str(parts), "--resume", steps=8)
    assert f"resumed from {parts} at step 4" in second, second
    # Losses, learning rates and gradient norms as printed: the same curve.
    assert {**curve(first), **curve(second)} == curve(out_whole), (first, second)
    assert re.search(r"validation loss \S+", second).group(0) == \
        re.search(r"validation loss \S+", out_whole).group(0)
    # The final weights, bit for bit, through the consolidate subcommand (in this process:
    # test_checkpoint.py runs it as a process of its own).
    files = []
    for root in (whole, parts):
        files.append(tmp_path / f"{root.name}.safetensors")
        assert cli.main(["consolidate", "to-full", str(root), str(files[-1])]) == 0
        assert "wrote" in capsys.readouterr().out
    from safetensors.torch import load_file
    a, b = (load_file(f) for f in files)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a.keys() == GPT(PRESETS["tiny"]).state_dict().keys()
    # One rank goes on from the two ranks' checkpoint (the data position and the schedule
    # too; per-rank generator states cannot move, and this job draws from none).
    on_one = [*TINY, *RESUMED, "--steps", "10", "--save-dir", str(parts), "--resume"]
    out = subprocess.run([sys.executable, "-m", "zerofn", "train", "--nproc", "1", *on_one],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "random generator states are not restored" in out.stdout, out.stdout
    assert sorted(curve(out.stdout)) == [9, 10] and "1 rank on gloo" in out.stdout, out.stdout
    # Started again once finished (a job scheduler's retry): nothing to do, and says so;
    # the job's own run on a rank, returning as a finished run does (exit status 0).
    again, error = run_ranks(1, job_on_ranks, on_one)[0]
    assert error is None and not curve(again), (again, error)
    assert f"the checkpoint in {parts} is at step 10: nothing left to train" in again


# --tp 2 on 2 ranks (data parallel 1, ZeRO-1) and on 4 (data parallel 2, ZeRO-3 with the
# optimizer state on the host and 2 accumulated micro-batches): the 4-rank job runs the
# same command-line path with data parallelism beside it, so it runs every time.
TP_JOBS = {     # flags, ranks, what the job says of its layout
    "dp1": (["--tp", "2", "--stage", "1"], 2, ["tensor parallel 2 x data parallel 1",
                                               "ZeRO-1"]),
    "dp2": (["--tp", "2", "--grad-accum", "2", "--offload", "cpu"], 4,
            ["tensor parallel 2 x data parallel 2", "(2 x 2 on each of 2 data-parallel ranks)",
             "offload cpu"]),
}


@pytest.mark.multirank
@pytest.mark.parametrize("grid", [
    slow_variant("dp1", covered_by="test_train.py::test_tensor_parallel_job_follows_the_"
                                   "unsplit_curve[dp2] (the same --tp 2 job and its "
                                   "checkpoint, beside data parallelism)"), "dp2"])
def test_tensor_parallel_job_follows_the_unsplit_curve(grid, whole, tmp_path):
    """--tp 2: the GPT split over two tensor-parallel ranks, ZeRO over the rest (TP_JOBS);
    its losses and norms are those of the job without tensor parallelism (``whole``: 2
    data-parallel ranks, ZeRO-2, 2 accumulated micro-batches), at the same global batch.
    The tensor-parallel tests hold zerofn + TP to FSDP2 + TP within 1e-6, both summing in
    TP's order; against no TP at all the row-parallel layers sum their partial products in
    another order (fp32 rounding, about 1e-7 of a value), far below the printed 4 decimals
    of the loss and 3 of the norm: so within one unit of the last printed digit. Its
    checkpoint keeps the q/k/v rows in --tp 2's head groups, and a --tp 1 resume of it is
    refused."""
    flags, nproc, said = TP_JOBS[grid]
    unsplit = curve(whole[1])
    ckpt = tmp_path / "tp2"
    out = run_job(*flags, "--save-dir", str(ckpt), steps=8, nproc=nproc)
    assert all(words in out for words in said), out
    split = curve(out)
    assert sorted(split) == sorted(unsplit) == list(range(1, 9)), out
    for step, (loss, lr, gnorm) in split.items():
        assert abs(float(loss) - float(unsplit[step][0])) < 1.5e-4, (step, out)
        assert abs(float(gnorm) - float(unsplit[step][2])) < 1.5e-3, (step, out)
        assert lr == unsplit[step][1], (step, out)
    resumed = subprocess.run([sys.executable, "-m", "zerofn", "train", "--nproc", "1", *TINY,
                              "--steps", "10", "--save-dir", str(ckpt), "--resume"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode != 0, resumed.stdout
    assert "error: the checkpoint was saved by a --tp 2 run, whose fused q/k/v rows lie in 2 " \
           "head groups (now --tp 1); resume it with --tp 2." in resumed.stderr, resumed.stderr


def job_on_ranks(rank, world, argv):
    """(what this rank printed, the error it raised for the user or None) of zerofn
    train's run on ``run_ranks``'s process group: for the jobs that end before their first
    step, where a launch would cost seconds and show nothing more."""
    import contextlib
    import io
    from zerofn.train.loop import train as train_job
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            train_job(train.parse_args(argv), torch.device("cpu"))
        except ValueError as e:
            return printed.getvalue(), str(e)
    return printed.getvalue(), None


def checkpoint_before_tp(rank, world, root):
    """A checkpoint as the job saved it before --tp existed: without its q/k/v order."""
    from zerofn.data import load_corpus, split
    from zerofn.data.batches import Batches
    from zerofn.train.job import build
    job = train.resolve(train.parse_args(TINY), torch.device("cpu"))
    model, opt, sched = build(job, 0)
    data = Batches(split(load_corpus())[0], 0, job.batch, job.cfg.context)
    zf.save_checkpoint(root, model, opt, step=2, sched=sched, data=data, rng=zf.RNGState())


@pytest.mark.multirank
def test_a_checkpoint_from_before_tp_resumes_in_the_usual_order(tmp_path):
    """--tp 2 refuses it; --tp 1 resumes it in the usual order, and its --tensorboard
    series go on from the checkpoint's step."""
    root, logs = str(tmp_path / "ckpt"), tmp_path / "tb"
    run_ranks(1, checkpoint_before_tp, root)
    # The refusal on each rank (how the job says a refusal and exits: the --tp 1 resume of a
    # --tp 2 checkpoint in test_tensor_parallel_job_follows_the_unsplit_curve).
    argv = ["--tp", "2", *TINY, "--steps", "4", "--save-dir", root, "--resume"]
    for printed, error in run_ranks(2, job_on_ranks, argv):
        assert error == f"the checkpoint in {root} was saved without --tp (its q/k/v rows in " \
            "the usual order); resume it with --tp 1.", (printed, error)
    out = run_job("--save-dir", root, "--resume", "--log-every", "2", "--tensorboard",
                  str(logs), steps=4, nproc=1)
    assert f"resumed from {root} at step 2" in out and sorted(curve(out)) == [3, 4], out
    # The resumed run's series go on from its step: each step's loss as printed (one
    # rank: its own loss is the mean), the step time on --log-every's steps only.
    acc = read(str(logs))
    loss = scalars(acc, "train/loss")
    assert sorted(loss) == [3, 4], loss
    for step, (printed, _, _) in curve(out).items():
        assert loss[step] == pytest.approx(float(printed), abs=1e-4), (step, out)
    assert set(scalars(acc, "time/step")) == {4}


# -- settings that cannot run: the same error on every rank --------------------------------
def refusals(rank, world, argvs):
    out = []
    for argv in argvs:
        try:
            train.resolve(train.parse_args(argv), torch.device("cpu"))
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


REFUSED = {
    "--offload nvme needs --nvme-path DIR": ["--offload", "nvme"],
    "--offload-params needs --stage 3 and --offload cpu or nvme": ["--offload-params"],
    "(here stage 2, offload cpu)": ["--stage", "2", "--offload", "cpu", "--offload-params"],
    "must split evenly into 2 micro-batches on each of 2 ranks": ["--batch", "6",
                                                                  "--grad-accum", "2"],
    "--save-every needs --save-dir": ["--save-every", "5"],
    "--resume continues from --save-dir's latest checkpoint": ["--resume"],
    "--stop-at between 1 and --steps": ["--stop-at", "300"],
    "--width 100 must be a multiple of --heads 3": ["--width", "100", "--heads", "3"],
    "low-precision state is stored off the device; add --offload cpu or nvme": [
        "--state-dtype", "int8"],
    "--master-dtype bf16 needs --precision bf16": ["--offload", "cpu", "--master-dtype",
                                                   "bf16"],
    "--offload-ratio 0.5 is the share --offload keeps off the device": ["--offload-ratio",
                                                                         "0.5"],
    "--offload-ratio auto moves --offload cpu's fp32 state to the device: it needs "
    "--offload cpu without --offload-params, --state-dtype or --master-dtype (here --offload "
    "none)": ["--offload-ratio", "auto"],
    "(here --offload nvme --state-dtype bf16)": ["--offload", "nvme", "--nvme-path", "/tmp",
                                                 "--offload-ratio", "auto", "--state-dtype",
                                                 "bf16"],
    "--device-budget 1000 is what --offload-ratio auto places optimizer state within: add "
    "--offload-ratio auto.": ["--offload", "cpu", "--offload-ratio", "0.5", "--device-budget",
                              "1000"],
    "--offload-ratio auto on a CPU device needs --device-budget in bytes": [
        "--offload", "cpu", "--offload-ratio", "auto", "--device-budget", "0.5"],
    "--overlap-step steps the host's units during backward: it needs --offload cpu, "
    "--stage 2 or 3, --clip 0": ["--offload", "cpu", "--overlap-step"],
    "--tp 3 must divide the 2 ranks (--nproc)": ["--tp", "3"],
    "--tp 2 must divide --heads 3: each tensor-parallel rank computes whole attention heads": [
        "--tp", "2", "--width", "96", "--heads", "3"],
    "must split evenly into 2 micro-batches on each of 1 data-parallel rank;": [
        "--tp", "2", "--batch", "5", "--grad-accum", "2"],
    "--plan auto with --tp 2: the planner does not model activations under tensor "
    "parallelism": ["--tp", "2", "--plan", "auto"],
    "--compile with --tp 2 is not supported yet": ["--tp", "2", "--compile"],
}


@pytest.mark.multirank
def test_unrunnable_settings_are_refused_on_every_rank():
    for messages in run_ranks(2, refusals, list(REFUSED.values())):
        for expected, message in zip(REFUSED, messages):
            assert message is not None and expected in message, (expected, message)


def test_the_launcher_refuses_each_unrunnable_setting_before_any_rank_starts(monkeypatch,
                                                                             capsys):
    """``zerofn train`` checks as the ranks would (for the two ranks it would start) and
    exits 2 with one line: torchrun is never started."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    launched = []
    monkeypatch.setattr("zerofn.train.entry.launch", lambda *a: launched.append(a))
    for expected, argv in REFUSED.items():
        with pytest.raises(SystemExit) as done:
            train.main(argv + ["--nproc", "2"])
        out, err = capsys.readouterr()
        assert done.value.code == 2 and not out, (argv, out)
        assert err.count("\n") == 1 and err.startswith("zerofn train: error: "), err
        assert expected in err and "(zerofn train --help lists the flags)" in err, err
    assert not launched


# The bad flag and combinations the closing note of issue 46 shows, as a user runs them.
BAD_LINES = {
    "--stage 9": "argument --stage: invalid choice: 9 (choose from 1, 2, 3)",
    "--stage 2 --offload cpu --offload-params": "--offload-params needs --stage 3 and "
    "--offload cpu or nvme (here stage 2, offload cpu): only ZeRO-3 shards the parameters.",
    "--offload nvme": "--offload nvme needs --nvme-path DIR (a directory on the drive) or the "
    "config's zero_optimization.offload_optimizer.nvme_path.",
    "--batch 6 --grad-accum 4": "the global batch (6 sequences) must split evenly into 4 "
    "micro-batches on each of 2 ranks; change --batch or --grad-accum.",
    "--tp 4": "--tp 4 must divide the 2 ranks (--nproc): the ranks form a (data-parallel, 4) "
    "grid.",
    "--tp 2 --model 125m --heads 9 --width 900": "--tp 2 must divide --heads 9: each "
    "tensor-parallel rank computes whole attention heads.",
}


def said_and_exited(flags: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """``zerofn train --nproc 2 FLAGS``'s (exit code, stdout, stderr), as a user's shell sees
    them: the first of BAD_LINES in a process of its own (``python -m zerofn``), the others
    through the same ``cli.main`` in this one (a launch each would cost seconds and show
    nothing more), with torchrun replaced by a recorder that must stay empty."""
    argv = ["train", "--nproc", "2", *flags.split()]
    if flags == next(iter(BAD_LINES)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        done = subprocess.run([sys.executable, "-m", "zerofn", *argv], capture_output=True,
                              text=True, env=env, timeout=120)
        return done.returncode, done.stdout, done.stderr
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    launched = []
    monkeypatch.setattr("zerofn.train.entry.launch", lambda *a: launched.append(a))
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert not launched, flags
    return ended.value.code, out, err


@pytest.mark.parametrize("flags", list(BAD_LINES))
def test_zerofn_train_says_one_line_and_exits_2_for_a_bad_flag(flags, monkeypatch, capsys):
    assert said_and_exited(flags, monkeypatch, capsys) == (
        2, "", f"zerofn train: error: {BAD_LINES[flags]} (zerofn train --help lists the "
        f"flags)\n")


@pytest.mark.deepspeed
@pytest.mark.multirank
def test_config_values_yield_to_explicit_flags(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    base = ["--config", str(config)]
    # The optimizer's share offloaded, as DeepSpeed's Twin-Flow ratio; --offload-ratio over it.
    shared = tmp_path / "ratio.json"
    shared.write_text(json.dumps(dict(CONFIG, zero_optimization={
        "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.25}})))
    ratio = ["--config", str(shared)]
    job_config, job_flags, job_ratio, job_auto = run_ranks(1, resolve_jobs, [
        base, base + ["--stage", "2", "--precision", "fp32", "--offload", "none",
                      "--grad-accum", "4", "--batch", "16", "--clip", "0"],
        ratio, ratio + ["--offload-ratio", "auto", "--device-budget", "1000"]])[0]
    assert (job_ratio.offload, job_ratio.offload_ratio, job_ratio.device_budget) == \
        ("cpu", 0.25, None)
    assert (job_auto.offload_ratio, job_auto.device_budget) == ("auto", 1000)
    assert (job_config.stage, job_config.precision, job_config.offload,
            job_config.offload_params, job_config.grad_accum, job_config.batch,
            job_config.clip) == (3, "bf16", "cpu", True, 4, 8, 0.5)
    assert (job_flags.stage, job_flags.precision, job_flags.offload, job_flags.offload_params,
            job_flags.grad_accum, job_flags.batch, job_flags.clip) == \
        (2, "fp32", None, False, 4, 16, 0)


def resolve_jobs(rank, world, argvs):
    jobs = [train.resolve(train.parse_args(argv), torch.device("cpu")) for argv in argvs]
    for job in jobs:       # what is left is plain data, comparable in the parent
        job.options = job.optimizer = job.scheduler = None
    return jobs


def test_missing_fp16_kernels_get_a_clear_message():
    error = RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
    message = train.fp16_kernels_missing(error, "fp16")
    assert "addmm_impl_cpu_" in message and "Use --precision bf16 or fp32" in message
    assert train.fp16_kernels_missing(error, "bf16") is None
    assert train.fp16_kernels_missing(RuntimeError("shape mismatch"), "fp16") is None


# -- load_checkpoint on a first run ----------------------------------------------------------
def first_run(rank, world, root):
    from zerofn.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads())(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results = {}
    for case in ("missing", "empty", "unfinished"):
        path = os.path.join(root, case)
        if case != "missing" and rank == 0:
            os.makedirs(os.path.join(path, ".tmp-step-00000003") if case == "unfinished"
                        else path, exist_ok=True)
        torch.distributed.barrier()
        results[case] = load_checkpoint(path, model, opt)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    broken = os.path.join(root, "broken")
    save_checkpoint(broken, model, opt, step=1)
    torch.distributed.barrier()
    if rank == 0:     # a checkpoint whose data went missing: there, but partial
        os.remove(os.path.join(broken, "step-00000001", ".metadata"))
    torch.distributed.barrier()
    try:
        load_checkpoint(broken, model, opt)
        error = None
    except ValueError as e:
        error = str(e)
    return results, unchanged, error


@pytest.mark.multirank
def test_load_checkpoint_returns_none_where_there_is_no_checkpoint_yet(tmp_path):
    for results, unchanged, error in run_ranks(2, first_run, str(tmp_path)):
        assert results == {"missing": None, "empty": None, "unfinished": None}
        assert unchanged
        assert error is not None and "not a complete checkpoint" in error, error
