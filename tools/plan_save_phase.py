"""The plan's save phase against a save's measured host memory, on tools/bench_save_memory.py's
configurations: a GPT of ``--layers`` blocks of width ``--width`` under ZeRO-3, its rows
(``none``, ``cpu``, ``nvme``, ``lowp``) at ``--worlds`` gloo ranks, saved synchronously or
in the background.

    OMP_NUM_THREADS=1 python tools/plan_save_phase.py --layers 4 --rows none,cpu,nvme,lowp \\
        --worlds 1,2 --modes sync,async,async-train

Per row: the save's peak above the step's, measured by bench_save_memory.py (its largest
rank; run here, with ``zf.return_large_frees()`` as the planner assumes on a CPU, or read
from that tool's printed table with ``--from``), and predicted: the plan's save phase
above its largest other phase (``zf.plan`` for that one candidate, with ``--probe``'s
machine). The plan counts a background save's copies made before a change beside the
steps that follow the call, so ``async-train`` (steps taken right after the call) is the
mode it describes; plain ``async`` (no step until the save is written) makes none.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_save_memory as bench  # noqa: E402

MiB = 1 << 20
SAVES = {"sync": "sync", "async": "async", "async-train": "async"}


def candidate(row: str):
    from zerofn.planner import Candidate
    if row == "lowp":
        return Candidate(stage=3, precision="bf16", offload="cpu", state_dtype="int8",
                         master_dtype="bf16")
    return Candidate(stage=3, offload={"none": None, "cpu": "cpu", "nvme": "nvme"}[row])


def predicted_above(args, row: str, world: int, mode: str) -> int:
    """The plan's save phase above its largest other phase (host bytes, the busiest rank)."""
    import torch

    from zerofn.nanogpt import GPT, GPTConfig
    from zerofn.planner import plan
    from zerofn.planner.memory import PHASES
    from zerofn.planner.probe import Machine, load_or_probe
    cfg = GPTConfig(vocab=256, width=args.width, heads=args.width // 64, ffn=4 * args.width,
                    layers=args.layers, context=64)
    with torch.device("meta"):
        model = GPT(cfg)
    if args.probe:
        with open(args.probe) as f:
            machine = Machine.from_json(json.load(f))
    else:
        machine = load_or_probe()
    x = torch.zeros(2, 64, dtype=torch.long)
    r = plan(model, (x, x), world=world, only=[candidate(row)], on_gpu=False,
             machine=machine, saves=SAVES[mode]).rows[0]
    steps = max(r.phases[ph]["host"] for ph in PHASES if ph != "save")
    return r.phases["save"]["host"] - steps


def measured_from(path: str) -> dict:
    """``{(row, world, mode): save above step, bytes}`` from bench_save_memory.py's table."""
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[1].isdigit():
                out[(parts[0], int(parts[1]), parts[2])] = int(parts[4]) * MiB
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rows", default="none,cpu,nvme,lowp")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--modes", default="sync,async,async-train")
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--from", dest="source",
                   help="bench_save_memory.py's printed table (run with --large-frees) "
                        "instead of measuring here")
    p.add_argument("--probe", help="a `zerofn probe` JSON (default this machine's)")
    p.add_argument("--dir", default=None, help="where the swap files and checkpoints go")
    args = p.parse_args(argv)
    args.large_frees = True          # the planner's premise on a CPU
    stored = measured_from(args.source) if args.source else None
    print("| row | world | mode | save above step measured MiB | predicted MiB | "
          "predicted - measured MiB |")
    print("|---|---:|---|---:|---:|---:|")
    for row in args.rows.split(","):
        for world in map(int, args.worlds.split(",")):
            for mode in args.modes.split(","):
                key = (row, world, mode)
                if stored is not None and key not in stored:
                    continue
                got = stored[key] if stored is not None else bench.measure(args, *key)[0]
                predicted = predicted_above(args, *key)
                print(f"| {row} | {world} | {mode} | {got / MiB:+,.0f} | "
                      f"{predicted / MiB:+,.0f} | {(predicted - got) / MiB:+,.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
