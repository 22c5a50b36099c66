"""The results file: what each part recorded, where it ran (device, torch, commit), and
which parts are still pending."""
from __future__ import annotations

import datetime
import json
import os

from .catalog import PART_NAMES
from .commands import run
from .paths import ROOT

# What each part records of where it ran: results gather over sessions, machines and commits.
RUN_KEYS = {"device": "on", "torch": "torch", "commit": "at"}


def load_results(path: str, fresh: bool) -> dict:
    if fresh or not os.path.exists(path):
        return {"parts": {}}
    with open(path) as f:
        return json.load(f)


def expand_pending(names: list[str], done: dict) -> list[str]:
    """``names`` with 'pending' replaced by the parts ``done`` does not hold as passed (not
    run, failed or skipped: a fix or a carried wheel may have changed that since), in the
    parts' order, each part once."""
    pending = [p for p in PART_NAMES if done.get(p, {}).get("status") != "ok"]
    out = []
    for name in names:
        for n in (pending if name == "pending" else [name]):
            if n not in out:
                out.append(n)
    return out


def commit(root: str = ROOT) -> str:
    """ZEROFN_COMMIT where it is set (a tree copied to a lent device machine), else the
    checked-out commit of a git repository whose top level is ``root``: a copy of the tree
    inside another repository would report that one's."""
    if os.environ.get("ZEROFN_COMMIT"):   # said outright: a copied tree may carry a stale .git
        return os.environ["ZEROFN_COMMIT"]
    rc, top = run(["git", "rev-parse", "--show-toplevel"], 30, cwd=root)
    if rc == 0 and os.path.realpath(top.strip()) == os.path.realpath(root):
        rc, out = run(["git", "rev-parse", "--short", "HEAD"], 30, cwd=root)
        if rc == 0:
            return out.strip()
    return "unknown"


def environment() -> dict:
    import platform

    import torch
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               cpus=os.cpu_count(), host_gb=_host_gb(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               commit=commit())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_gb=props.total_memory / 2**30)
    else:
        env.update(device="no CUDA device", device_gb=0.0)
    return env


def _host_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) / 2**20
