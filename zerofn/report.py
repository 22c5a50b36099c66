"""``zerofn report LOGDIR``: PNG plots of what ``zf.tensorboard`` wrote, per rank.

    zerofn report runs/zero3                 # writes runs/zero3/report/*.png
    python -m zerofn.report runs/zero3 --out plots

- ``step_time.png``: where a step's time goes, as stacked bars per rank (forward,
  backward, optimizer, logging, the rest), beside the waits and copies inside them;
- ``comm.png``: bytes per step and bus bandwidth per collective and rank;
- ``memory.png``: model-state bytes by role and place per rank, beside peaks and host
  memory;
- ``training.png``: loss, loss scale, gradient norm and learning rate over steps.

Interval series are averaged over the run's intervals, leaving out the first (its steps
warm up) where there are more. matplotlib is needed here only (``pip install
matplotlib``); the rest of zerofn never imports it.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass

PHASES = ("forward", "backward", "optimizer", "logging")
INSIDE = ("reduce_wait", "gather_wait", "d2h", "h2d", "cpu_adam", "nvme_read", "nvme_write")
ROLES = ("params", "grads", "optimizer", "buffers")
COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
          "logging": "#8172B3", "other": "#BBBBBB", "params": "#4C72B0", "grads": "#DD8452",
          "buffers": "#BBBBBB"}
MIB = 2 ** 20


@dataclass
class Run:
    """One rank's scalars: ``{tag: [(step, value), ...]}``."""
    name: str
    scalars: dict

    def series(self, tag: str) -> list[tuple[int, float]]:
        return self.scalars.get(tag, [])

    def mean(self, tag: str) -> float:
        """The mean over intervals, without the first where there are more."""
        points = self.series(tag)
        values = [v for _, v in (points[1:] if len(points) > 1 else points)]
        return sum(values) / len(values) if values else 0.0

    def tags(self, prefix: str) -> list[str]:
        return sorted(t for t in self.scalars if t.startswith(prefix))


def load(logdir: str) -> list[Run]:
    """Every directory under ``logdir`` holding event files (``logdir`` itself, or its
    ``rank<r>/`` subdirectories), read whole."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    dirs = sorted({os.path.dirname(f) for f in glob.glob(
        os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)}, key=_rank_order)
    runs = []
    for d in dirs:
        acc = EventAccumulator(d, size_guidance={"scalars": 0}).Reload()
        scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
        name = os.path.relpath(d, logdir)
        runs.append(Run("rank" if name == "." else name, scalars))
    if not runs:
        raise ValueError(f"{logdir!r} holds no TensorBoard event files; point zerofn report at "
                         f"the directory given to zf.tensorboard (or zerofn train --tensorboard).")
    return runs


def _rank_order(path: str):
    base = os.path.basename(path)
    return (0, int(base[4:])) if base.startswith("rank") and base[4:].isdigit() else (1, path)


def write_report(logdir: str, out: str | None = None) -> list[str]:
    """Plot the run in ``logdir`` into ``out`` (default ``logdir/report``); returns the
    PNG paths written.

    Example:
        >>> write_report("runs/zero3")
        ['runs/zero3/report/step_time.png', ...]
    """
    plt = _pyplot()
    runs = load(logdir)
    out = out or os.path.join(logdir, "report")
    os.makedirs(out, exist_ok=True)
    written = []
    for name, plot in (("step_time", plot_step_time), ("comm", plot_comm),
                       ("memory", plot_memory), ("training", plot_training)):
        fig = plot(plt, runs)
        if fig is None:
            continue
        path = os.path.join(out, f"{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("zerofn report draws with matplotlib, which is not installed: "
                         "pip install matplotlib") from None
    matplotlib.use("Agg")      # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _names(runs: list[Run]) -> list[str]:
    return [r.name for r in runs]


def plot_step_time(plt, runs: list[Run]):
    if not any(r.series("time/step") for r in runs):
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5),
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    x = range(len(runs))
    bottom = [0.0] * len(runs)
    for phase in PHASES + ("other",):
        if phase == "other":
            heights = [max(0.0, r.mean("time/step") - b) for r, b in zip(runs, bottom)]
        else:
            heights = [r.mean(f"time/{phase}") for r in runs]
        left.bar(x, heights, bottom=bottom, color=COLORS[phase], label=phase, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, r in enumerate(runs):
        left.text(i, bottom[i], f"{r.mean('time/step'):.1f} ms", ha="center", va="bottom")
    left.set_xticks(list(x), _names(runs))
    left.set_ylabel("ms per step")
    left.set_ylim(0, max(bottom) * 1.35 or 1)
    left.legend(loc="upper center", ncol=5, fontsize=8, handlelength=1)
    title = "Step time by phase (other: the loop's own code)"
    slowest, fastest = runs[0].mean("time/step_max"), runs[0].mean("time/step_min")
    if slowest:
        left.axhline(slowest, color="black", lw=0.8, ls="--")
        title += f"\nslowest rank {slowest:.1f} ms (dashed), fastest {fastest:.1f} ms"
    left.set_title(title)
    inside = [s for s in INSIDE if any(r.series(f"time/{s}") for r in runs)]
    _grouped_bars(right, runs, inside, lambda r, s: r.mean(f"time/{s}"))
    right.set_ylabel("ms per step")
    right.set_title("Inside the phases: waits, copies, CPU Adam, NVMe I/O")
    fig.tight_layout()
    return fig


def _grouped_bars(ax, runs: list[Run], groups: list[str], value, scale: float = 1.0) -> None:
    """One group of bars per name in ``groups``, one bar per rank."""
    width = 0.8 / max(1, len(runs))
    for j, r in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [value(r, g) / scale for g in groups], width=width, label=r.name)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    if len(runs) > 1:
        ax.legend(fontsize=8)


def plot_comm(plt, runs: list[Run]):
    kinds = sorted({t.split("/")[1] for r in runs for t in r.tags("comm/")})
    if not kinds:
        return None
    fig, (size, speed) = plt.subplots(1, 2, figsize=(11, 4))
    _grouped_bars(size, runs, kinds, lambda r, k: r.mean(f"comm/{k}/bytes"), MIB)
    size.set_ylabel("MiB per step")
    size.set_title("Traffic per collective\n(full buffers, as zf.comm_stats counts them)")
    top = max(r.mean(f"comm/{k}/bytes") for r in runs for k in kinds) / MIB
    size.set_ylim(0, top * 1.2 or 1)
    for i, k in enumerate(kinds):
        mib = max(r.mean(f"comm/{k}/bytes") for r in runs) / MIB
        size.annotate(f"{mib:.3g} MiB, {runs[0].mean(f'comm/{k}/count'):g} calls",
                      (i, mib), xytext=(0, 3), textcoords="offset points", ha="center",
                      fontsize=8)
    _grouped_bars(speed, runs, kinds, lambda r, k: r.mean(f"comm/{k}/busbw_gbps"))
    speed.set_ylabel("GB/s")
    speed.set_title("Bus bandwidth\n(issue to completion seen: a lower bound)")
    fig.tight_layout()
    return fig


def plot_memory(plt, runs: list[Run]):
    places = sorted({t.split("/")[2] for r in runs for t in r.tags("memory/model_state/")})
    if not places:
        return None
    fig, (state, other) = plt.subplots(1, 2, figsize=(12, 4.5),
                                       gridspec_kw={"width_ratios": [1.3, 1]})
    bars = [(r, p) for r in runs for p in places]
    bottom = [0.0] * len(bars)
    for role in ROLES:
        heights = [r.mean(f"memory/model_state/{p}/{role}") / MIB for r, p in bars]
        state.bar(range(len(bars)), heights, bottom=bottom, label=role,
                  color=COLORS.get(role, "#55A868"), width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    labels = [p if len(runs) == 1 else f"{r.name}\n{p}" for r, p in bars]
    state.set_xticks(range(len(bars)), labels)
    state.set_ylabel("MiB")
    state.set_ylim(0, max(bottom) * 1.25 or 1)
    state.set_title("Model state by role and place (zf.model_state_bytes)")
    state.legend(loc="upper center", ncol=4, fontsize=8, handlelength=1)
    rest = sorted({t for r in runs for t in r.tags("memory/")
                   if not t.startswith("memory/model_state/")})
    _grouped_bars(other, runs, [t[len("memory/"):] for t in rest],
                  lambda r, t: r.mean(f"memory/{t}"), MIB)
    other.set_ylabel("MiB")
    other.set_title("Peaks and host memory")
    fig.tight_layout()
    return fig


def plot_training(plt, runs: list[Run]):
    panels = [("train/loss", "loss", False), ("train/loss_scale", "loss scale", True),
              ("train/grad_norm", "gradient norm", False), ("train/lr/group0", "learning rate",
                                                           False)]
    panels = [p for p in panels if any(r.series(p[0]) for r in runs)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (tag, title, log) in zip(axes[0], panels):
        for r in runs:
            points = r.series(tag)
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=r.name)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if log:
            ax.set_yscale("log", base=2)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None, prog: str = "python -m zerofn.report") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("logdir", help="the directory given to zf.tensorboard")
    p.add_argument("--out", help="where the PNGs go (default LOGDIR/report)")
    args = p.parse_args(argv)
    try:
        paths = write_report(args.logdir, args.out)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
