"""How often a DeepSpeed-style script on zerofn aborts at exit on gloo ("terminate called
without an active exception"), with zerofn's end of the process group it made
(zerofn/deepspeed/engine.py's ``_end_group``) and without it (the handler unregistered
by the script: the interpreter's finalization tears the group down), runs alternating.

    python tools/teardown_aborts.py --runs 20 --ranks 2

Each run is a fresh job: ``zerofn.deepspeed.initialize`` with no process group (a gloo
group of --ranks processes under torchrun, or one process without it), a few steps of
ZeRO-3, then the script ends without ``destroy_process_group``, as DeepSpeed's examples
do. Prints, per arm, the runs, their exit codes and how many printed the abort.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile

SCRIPT = """
import atexit, os, sys, torch
import zerofn.deepspeed as deepspeed
engine_ranks = lambda: int(os.environ.get("WORLD_SIZE", 1))
from zerofn.deepspeed import engine as zerofn_engine
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
engine, _, _, _ = deepspeed.initialize(model=model, config={
    "train_batch_size": 4 * engine_ranks(), "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
for _ in range(3):
    engine.backward(engine(torch.randn(4, 16)).square().mean())
    engine.step()
if sys.argv[1] == "without":
    atexit.unregister(zerofn_engine._end_group)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per arm")
    p.add_argument("--ranks", type=int, default=2, help="processes a run starts")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = "cpu"
    codes = {arm: collections.Counter() for arm in ("with", "without")}
    aborts = dict.fromkeys(codes, 0)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "ds_script.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for _ in range(args.runs):
            for arm in codes:
                run_once(script, arm, args.ranks, env, codes, aborts)
    for arm in codes:
        print(f"{arm} zerofn's end of the group: {args.runs} runs of {args.ranks} rank(s), "
              f"exit codes {dict(codes[arm])}, {aborts[arm]} aborted")


def run_once(script: str, arm: str, ranks: int, env: dict, codes: dict, aborts: dict) -> None:
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(ranks)]
    done = subprocess.run([*launcher, script, arm], env=env, capture_output=True, text=True,
                          timeout=300)
    codes[arm][done.returncode] += 1
    aborts[arm] += "terminate called without an active exception" in done.stderr


if __name__ == "__main__":
    main()
