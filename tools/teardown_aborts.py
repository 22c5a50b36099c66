"""How often a process that trained with zerofn on gloo aborts at exit ("terminate called
without an active exception"), with ``zf.finish_collectives_at_exit()`` called and without,
runs alternating ([Note: the exit abort] in zerofn/runtime/process_exit.py).

    python tools/teardown_aborts.py --runs 20

A run is a pair of processes started from this script: a gloo group of two, three ZeRO-3
steps, then 100 all_reduces of temporary tensors, as a loop syncing its metrics ends (or
Lightning's ``reduce_boolean_decision``), and the end of the script without
``destroy_process_group``, through the interpreter's own exit. A process killed by SIGABRT
aborted. Prints, per arm, the runs and how many processes
aborted or failed otherwise; exits 1 when an arm named by --fail-on had any.
"""
from __future__ import annotations

import argparse
import collections
import signal
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

import zerofn as zf

METRICS = 100     # all_reduces of a temporary that end a run, as a loop syncing its metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs (pairs of processes) per arm")
    p.add_argument("--arms", default="with,without", help="with: the run calls "
                   "zf.finish_collectives_at_exit(); without: it does not")
    p.add_argument("--fail-on", default="", help="arms whose aborts or failures exit 1")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)   # (a run's own process)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        train_and_end(args.port, args.rank, args.arms)
        return
    arms = args.arms.split(",")
    ends = {arm: collections.Counter() for arm in arms}
    for _ in range(args.runs):
        for arm in arms:
            for code in run_pair(arm):
                ends[arm][end_of(code)] += 1
    for arm in arms:
        print(f"{arm} finish_collectives_at_exit: {args.runs} runs of 2 processes, "
              f"{ends[arm]['aborted']} aborted, {ends[arm]['failed']} failed otherwise")
    bad = [arm for arm in args.fail_on.split(",") if arm
           and ends[arm]["aborted"] + ends[arm]["failed"]]
    sys.exit(1 if bad else 0)


def end_of(code: int) -> str:
    return {0: "ok", -signal.SIGABRT: "aborted"}.get(code, "failed")


def run_pair(arm: str) -> list[int]:
    """Start the two ranks of one run; their exit codes (-6: aborted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port",
                               str(port), "--arms", arm], stderr=subprocess.DEVNULL)
             for rank in (0, 1)]
    return [rank.wait() for rank in ranks]


def train_and_end(port: int, rank: int, arm: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if arm == "with":
        zf.finish_collectives_at_exit()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero3 = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params())
    model, opt = zero3(model, opt)
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(METRICS):
        dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    main()
