"""The muon part: ``tools/bench_muon.py --mode offload`` on the GPU: torch.optim.Muon over a
1.31B GPT's block matrices beside AdamW over the rest, ZeRO-3 + bf16 + offload("cpu") on
one rank (the owned matrices' masters and momentum on the host, Newton-Schulz on the
device), its step against AdamW's alone over every parameter. The same code runs at a tiny
size on the CPU (tests/test_gpu_check.py)."""
from __future__ import annotations

import os
import re
import sys

from .catalog import COMPARE_SIZE, LIMIT, MUON_FLAGS
from .commands import run, tail
from .paths import TOOLS

LINE = re.compile(r"Muon \+ AdamW step ([\d.]+) s, AdamW step ([\d.]+) s, Muon/AdamW ([\d.]+)x")


def muon_run(device: str, size: str, flags: list[str], seconds: float) -> dict:
    """bench_muon's offload mode at ``size`` on ``device``: the part's result, its figures
    the two steps' median seconds and their ratio."""
    command = ["--mode", "offload", "--device", device, "--size", size, *flags]
    rc, out = run([sys.executable, os.path.join(TOOLS, "bench_muon.py"), *command], seconds)
    line = next((ln for ln in out.splitlines() if ln.startswith("muon offload:")), "")
    m = LINE.search(line)
    if rc or m is None:
        return dict(status="failed", lines=[f"`bench_muon.py {' '.join(command)}` exited {rc}"],
                    detail=tail(out))
    return dict(status="ok", lines=[f"`bench_muon.py {' '.join(command)}`: {line}"],
                figures=dict(muon_step_s=float(m[1]), adamw_step_s=float(m[2]),
                             muon_vs_adamw=float(m[3])))


def part_muon(args) -> dict:
    return muon_run("cuda", COMPARE_SIZE, MUON_FLAGS.split(), LIMIT["muon"])
