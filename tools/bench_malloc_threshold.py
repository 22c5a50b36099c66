"""What ``zf.return_large_frees()`` saves and costs: per-rank peak memory (VmHWM) and step
time of the planner grid's wide GPT (110M parameters, tools/plan_models.py) at ZeRO-1 with
CPU offload on a CPU, under glibc's own moving mmap threshold (what a transform leaves)
and under each fixed threshold asked for, as ratios to the moving one.

    python tools/bench_malloc_threshold.py                      # 1, 4, 8, 16, 32 MiB
    python tools/bench_malloc_threshold.py --thresholds 8 --repeats 3 --world 2

Each configuration runs in a fresh set of processes (tools/plan_accuracy.py's worker, one
thread per rank: glibc keeps what a process freed, so one run would start from another's
high-water mark); the repeats interleave the thresholds, so drift on a shared machine
falls on all of them alike, and each figure is the median over the repeats.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from plan_accuracy import measure

MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--thresholds", default="1,4,8,16,32", help="MiB, fixed thresholds")
    p.add_argument("--shape", default="wide", help="a model of tools/plan_models.py")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", default="cpu", choices=("none", "cpu", "nvme"))
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 untimed)")
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def run(args) -> dict[int, list[dict]]:
    """``{threshold bytes (0: moving): [measured, per repeat]}``."""
    thresholds = [0] + [int(float(t) * MIB) for t in args.thresholds.split(",")]
    out = {t: [] for t in thresholds}
    settings = argparse.Namespace(batch=args.batch, steps=args.steps, save=False)
    for repeat in range(args.repeats):
        for t in thresholds:
            settings.malloc_threshold = t
            got = measure(args.shape, args.world, args.stage, args.offload, settings)
            out[t].append(got)
            print(f"repeat {repeat}: {name(t)}: peak {got['peak'] / MIB:.0f} MiB, "
                  f"step {got['step_s']:.3f} s", file=sys.stderr, flush=True)
    return out


def name(threshold: int) -> str:
    return "moving (glibc's own)" if threshold == 0 else f"fixed at {threshold / MIB:g} MiB"


def table(out: dict[int, list[dict]]) -> str:
    median = {t: {k: statistics.median(r[k] for r in runs) for k in ("peak", "step_s")}
              for t, runs in out.items()}
    base = median[0]
    lines = ["| mmap threshold | peak MiB | peak / moving | step s | step / moving |",
             "|---|---|---|---|---|"]
    for t, m in median.items():
        lines.append(f"| {name(t)} | {m['peak'] / MIB:.0f} | {m['peak'] / base['peak']:.3f} "
                     f"| {m['step_s']:.3f} | {m['step_s'] / base['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    print(f"{args.shape} GPT, ZeRO-{args.stage}, offload {args.offload}, world {args.world}, "
          f"batch {args.batch}, median of {args.repeats} runs x {args.steps} steps")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
