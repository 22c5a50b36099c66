"""zf.tensorboard: what the event files say equals what the run did; quiet steps never
synchronize; traces label every phase; the DeepSpeed config's monitoring maps onto it."""
from __future__ import annotations

import csv
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from support.plans import plan_of
from support.ranks import run_ranks
from support.tensorboard_runs import CONFIG, build, read, scalars, text, train_step
from zerofn.deepspeed.config import DeepSpeedConfigWarning


# -- what is written ------------------------------------------------------------------------
def logged_run(rank, world, root):
    """ZeRO-3, every=2, four steps: what the run did, to hold the event files to."""
    model, opt = build([zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                        zf.tensorboard(root, every=2, ranks="all", csv=True)])
    losses, comm, memory = {}, {}, {}
    for step in range(1, 5):
        loss = train_step(model, opt, rank, step)
        comm[step] = zf.comm_stats(model)
        if step % 2 == 0:       # as the logging step saw it (only then: it takes a while)
            memory[step] = zf.model_state_bytes(model)
        opt.zero_grad()
        zf.log(model, loss=loss, tokens=4 * CONFIG.context, samples=4)
        losses[step] = loss.item()
    zf.flush_logs(model)
    return losses, comm, memory


@pytest.mark.multirank
def test_event_files_hold_what_the_run_did(tmp_path):
    root = str(tmp_path)
    results = run_ranks(2, logged_run, root)
    runs = {r: read(os.path.join(root, f"rank{r}")) for r in range(2)}
    for rank, (losses, comm, memory) in enumerate(results):
        acc = runs[rank]
        # The loss equals what was logged, at every step.
        assert scalars(acc, "train/loss") == {s: torch.tensor(v).item() for s, v in
                                              losses.items()}
        assert set(scalars(acc, "train/grad_norm")) == {1, 2, 3, 4}
        assert scalars(acc, "train/lr/group0") == {s: pytest.approx(1e-3) for s in range(1, 5)}
        # Counts: cumulative samples and tokens per second of each step's time.
        assert scalars(acc, "train/samples") == {1: 4.0, 2: 8.0, 3: 12.0, 4: 16.0}
        assert set(scalars(acc, "train/tokens_per_s")) == {1, 2, 3, 4}
        for step in (2, 4):
            # Communication bytes per step equal zf.comm_stats, one count per unit gathered.
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                want = sum(comm[s][f"{kind}_bytes"] for s in (step - 1, step)) / 2
                assert scalars(acc, f"comm/{kind}/bytes")[step] == want, kind
                assert scalars(acc, f"comm/{kind}/busbw_gbps")[step] > 0
            # one: the vote on which parameters got a gradient carries the clip's norm
            # (runtime/step_grads.py's [Note: one collective for the verdicts])
            assert scalars(acc, "comm/all_reduce/count")[step] == 1
            assert scalars(acc, "comm/reduce_scatter/count")[step] == CONFIG.layers + 1
            # Memory equals zf.model_state_bytes.
            for place, roles in memory[step].items():
                for role, nbytes in roles.items():
                    assert scalars(acc, f"memory/model_state/{place}/{role}")[step] == nbytes
            assert scalars(acc, "memory/host/rss")[step] > 0
        # The phases add up to the step (the last interval: the first warms up).
        parts = sum(scalars(acc, f"time/{p}")[4]
                    for p in ("forward", "backward", "optimizer", "logging"))
        step_ms = scalars(acc, "time/step")[4]
        assert abs(parts - step_ms) <= 0.1 * step_ms, (parts, step_ms)
        assert 0 < scalars(acc, "time/gather_wait")[4] < step_ms
        assert "| stage | `3` |" in text(acc, "plan")
        assert "| world | 2 |" in text(acc, "environment")
        # The same series as CSV, in DeepSpeed's csv_monitor layout.
        with open(os.path.join(root, f"rank{rank}", "train_loss.csv")) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", "loss"]
        assert {int(s): float(v) for s, v in rows[1:]} == scalars(acc, "train/loss")
    # The slowest and fastest rank's step time, from both ranks' own.
    for step in (2, 4):
        own = [scalars(runs[r], "time/step")[step] for r in range(2)]
        for r in range(2):
            assert scalars(runs[r], "time/step_max")[step] == pytest.approx(max(own))
            assert scalars(runs[r], "time/step_min")[step] == pytest.approx(min(own))


# -- no waiting on quiet steps --------------------------------------------------------------
SYNCS = [(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__int__",
                                           "__bool__", "cpu", "numpy")] + \
    [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
     (torch.cuda.Event, "elapsed_time")] + \
    [(dist, name) for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast",
                               "barrier", "all_gather_into_tensor")]


def counted_syncs(rank, world, root):
    """Calls that synchronize with the device (on a GPU) or with other ranks, per step, for
    the same loop with and without zf.tensorboard."""
    calls = [0]

    def counting(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)
        return counted

    base = [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
            zf.mixed_precision(torch.float16), zf.offload("cpu")]
    per_step = {}
    for name, extra in (("off", []), ("on", [zf.tensorboard(root, every=3)])):
        model, opt = build(base + extra)
        originals = [(owner, attr, getattr(owner, attr)) for owner, attr in SYNCS]
        for owner, attr, fn in originals:
            setattr(owner, attr, counting(fn))
        try:
            per_step[name] = []
            for step in range(1, 7):
                calls[0] = 0
                loss = train_step(model, opt, rank, step, fp16=True)
                opt.zero_grad()
                zf.log(model, loss=loss, tokens=4 * CONFIG.context, samples=torch.tensor(4))
                per_step[name].append(calls[0])
        finally:
            for owner, attr, fn in originals:
                setattr(owner, attr, fn)
        zf.flush_logs(model)
    return per_step


@pytest.mark.multirank
def test_steps_that_do_not_log_add_no_synchronization(tmp_path):
    for per_step in run_ranks(2, counted_syncs, str(tmp_path)):
        off, on = per_step["off"], per_step["on"]
        for step in (1, 2, 4, 5):
            assert on[step - 1] == off[step - 1], (step, off, on)
        for step in (3, 6):     # logging steps read the values and run one collective
            assert on[step - 1] > off[step - 1], (step, off, on)


# -- traces ----------------------------------------------------------------------------------
def traced_run(rank, world, root, swap):
    """ZeRO-3 with fp16, clipping and parameters offloaded to NVMe: every phase occurs."""
    model, opt = build([zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                        zf.mixed_precision(torch.float16),
                        zf.offload("nvme", params=True, path=swap),
                        zf.tensorboard(root, every=2, ranks="all",
                                       profile=dict(wait=1, warmup=1, active=2))])
    units = [u.name for u in model._zerofn.units if u.slots and not u.replicated]
    for step in range(1, 6):
        train_step(model, opt, rank, step, fp16=True)
        opt.zero_grad()
    zf.flush_logs(model)
    return units


PHASES = ["forward", "backward", "optimizer", "overflow_check", "clip_grad_norm"]
PER_UNIT = ["gather[forward]", "gather[backward]", "gather_wait", "reduce", "reduce_wait",
            "cpu_adam", "d2h", "h2d", "nvme_read", "nvme_write"]


@pytest.mark.multirank
def test_traces_label_every_phase_per_unit(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    root = str(tmp_path / "logs")
    results = run_ranks(2, traced_run, root, str(swap))
    for rank, units in enumerate(results):
        files = glob.glob(os.path.join(root, "traces", f"rank{rank}.*.pt.trace.json.gz"))
        assert len(files) == 1, files
        with gzip.open(files[0]) as f:
            trace = json.load(f)
        assert trace["distributedInfo"]["rank"] == rank        # what HTA reads
        labels = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        steps = {n for n in labels if n.startswith("ProfilerStep#")}
        assert len(steps) == 2, steps                          # the active window
        for phase in PHASES:
            assert f"zerofn::{phase}" in labels, phase
        for what in PER_UNIT:
            for unit in units:
                assert f"zerofn::{what} {unit}" in labels, (what, unit, sorted(labels))


# -- set-up, input and the DeepSpeed config ----------------------------------------------------
def refusals(rank, world, root):
    out = []
    for transform in (zf.tensorboard(root, ranks="3"), zf.tensorboard(root, memory_snapshot=8)):
        try:
            build([zf.shard_optimizer(), transform])
        except ValueError as e:
            out.append(str(e))
    model, _ = build([zf.shard_grads(), zf.tensorboard(root)])
    for bad in ({"loss": torch.ones(2)}, {"loss": "low"}, {"lr": 0.1}):
        try:
            zf.log(model, **bad)
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.multirank
def test_bad_options_and_values_are_refused(tmp_path):
    ranks, snapshot, shape, kind, builtin = run_ranks(1, refusals, str(tmp_path))[0]
    assert "there are only 1 ranks" in ranks
    assert "records the CUDA caching allocator" in snapshot and "computes on cpu" in snapshot
    assert shape.startswith("TypeError") and "shape (2,)" in shape
    assert kind.startswith("TypeError") and "got str" in kind
    assert builtin.startswith("ValueError") and "train/lr" in builtin
    for bad in (dict(every=0), dict(ranks="first"), dict(ranks=[-1]),
                dict(profile=dict(active=0)), dict(profile=dict(wait=1, steps=2)),
                dict(memory_snapshot=-1)):
        with pytest.raises(ValueError, match=r"tensorboard\("):
            zf.tensorboard("logs", **bad)
    with pytest.raises(ValueError, match="shards nothing by itself"):
        build([zf.tensorboard("logs")])


@pytest.mark.deepspeed
def test_deepspeed_monitoring_sections_become_tensorboard():
    batch_size = {"train_batch_size": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        s = zf.from_deepspeed_config({**batch_size, "steps_per_print": 5,
                                      "tensorboard": {"enabled": True, "output_path": "tb",
                                                      "job_name": "run"},
                                      "csv_monitor": {"enabled": True, "output_path": "csv"},
                                      "wall_clock_breakdown": True,
                                      "comms_logger": {"enabled": True}}, world_size=1)
    plan = plan_of(s.transform)
    assert plan.monitor.log_dir == os.path.join("tb", "run")
    assert plan.monitor.csv == os.path.join("csv", "DeepSpeedJobName")
    assert plan.monitor.every == 5 and plan.monitor.ranks == (0,)
    # csv_monitor alone: event files and CSV in its directory; no writer: nothing to map.
    alone = zf.from_deepspeed_config({**batch_size, "csv_monitor": {"enabled": True,
                                                                    "job_name": "j"}},
                                     world_size=1)
    assert plan_of(alone.transform).monitor.log_dir == "j"
    assert plan_of(alone.transform).monitor.every == 10   # DeepSpeed's default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = zf.from_deepspeed_config({**batch_size, "wall_clock_breakdown": True,
                                      "tensorboard": {"enabled": False, "output_dir": "x"}},
                                     world_size=1)
    messages = [str(w.message) for w in caught]
    assert "tensorboard" not in s.transforms
    assert any("'wall_clock_breakdown'" in m and "enable one of those" in m for m in messages)
    assert any("tensorboard.'output_dir'" in m and "output_path" in m for m in messages)


# -- the main job ------------------------------------------------------------------------------
@pytest.mark.slow(reason="covered in every run by test_train.py::"
                  "test_a_checkpoint_from_before_tp_resumes_in_the_usual_order (a zerofn train "
                  "job with --tensorboard: its loss as printed, its step time on --log-every's "
                  "steps)")
@pytest.mark.multirank
def test_train_job_logs_its_loss(tmp_path):
    logs = tmp_path / "tb"
    cmd = [sys.executable, "-m", "zerofn", "train", "--nproc", "1", "--model", "tiny",
           "--context", "32", "--batch", "4", "--eval-batches", "1", "--steps", "4",
           "--log-every", "2", "--stage", "2", "--tensorboard", str(logs)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = {int(s): float(v) for s, v in re.findall(r"^step +(\d+)/4 +loss (\S+)",
                                                        done.stdout, re.M)}
    acc = read(str(logs))
    loss = scalars(acc, "train/loss")
    assert sorted(loss) == [1, 2, 3, 4]
    for step, value in printed.items():
        assert loss[step] == pytest.approx(value, abs=1e-4)
    assert scalars(acc, "train/samples") == {1: 4.0, 2: 8.0, 3: 12.0, 4: 16.0}
    assert set(scalars(acc, "time/step")) == {2, 4}
