"""zerofn report: PNG plots of a zf.tensorboard log directory, drawn from its series."""
from __future__ import annotations

import os

import pytest
import torch

import zerofn as zf
from support.ranks import run_ranks
from support.tensorboard_runs import CONFIG, build, train_step
from zerofn import cli, report

matplotlib = pytest.importorskip("matplotlib")   # an optional dependency, as in the docs
matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402


def fp16_offload_run(rank, world, root):
    """Six fp16 steps (loss scale, skipped steps) with CPU offload, every rank writing."""
    model, opt = build([zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                        zf.mixed_precision(torch.float16), zf.offload("cpu"),
                        zf.tensorboard(root, every=2, ranks="all")])
    for step in range(1, 7):
        loss = train_step(model, opt, rank, step, fp16=True)
        opt.zero_grad()
        zf.log(model, loss=loss, tokens=4 * CONFIG.context)
    zf.flush_logs(model)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("report"))
    run_ranks(2, fp16_offload_run, root)
    return root


@pytest.mark.multirank
def test_report_writes_readable_pngs(logdir, capsys):
    assert cli.main(["report", logdir]) == 0
    printed = capsys.readouterr().out.split()
    names = ["step_time", "comm", "memory", "training"]
    assert printed == [os.path.join(logdir, "report", f"{n}.png") for n in names]
    for path in printed:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 800, image.shape
        assert image.std() > 0.05          # drawn on, not blank


@pytest.mark.multirank
def test_plots_show_the_logged_series(logdir):
    runs = report.load(logdir)
    assert [r.name for r in runs] == ["rank0", "rank1"]
    # Step time: each rank's stack of phases and "other" reaches its mean step time.
    fig = report.plot_step_time(plt, runs)
    bars = fig.axes[0].patches
    for i, run in enumerate(runs):
        top = max(b.get_y() + b.get_height() for b in bars if round(b.get_x() + b.get_width() / 2) == i)
        assert top == pytest.approx(run.mean("time/step"), rel=1e-6)
    plt.close(fig)
    # Memory: one stack per rank and place, the roles' bytes in MiB.
    fig = report.plot_memory(plt, runs)
    heights = [b.get_height() for b in fig.axes[0].patches]
    want = [r.mean(f"memory/model_state/{p}/params") / report.MIB for r in runs
            for p in ("cpu", "host")]
    assert heights[:4] == pytest.approx(want)
    plt.close(fig)
    # Loss and loss scale: every step's value, as logged.
    fig = report.plot_training(plt, runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:2] == ["loss", "loss scale"]
    for line, run in zip(fig.axes[0].get_lines(), runs):
        assert list(line.get_ydata()) == [v for _, v in run.series("train/loss")]
    plt.close(fig)


def test_report_on_a_directory_without_logs(tmp_path, capsys):
    assert report.main([str(tmp_path)], prog="zerofn report") == 2
    assert "holds no TensorBoard event files" in capsys.readouterr().err
