"""The numbers the monitor writes that are arithmetic on what it measured: communication
series and bus bandwidth, the run's environment, resident memory."""
from __future__ import annotations

import os
import platform
import resource
from collections import Counter, defaultdict

import torch
import torch.distributed as dist


def floats(values: list) -> list[float]:
    """Numbers and one-element tensors as floats: one read per device."""
    out = [float(v) if not torch.is_tensor(v) else None for v in values]
    by_device = defaultdict(list)
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            by_device[v.device].append(i)
    for idx in by_device.values():
        read = torch.stack([values[i].detach().reshape(()).double() for i in idx]).tolist()
        for i, x in zip(idx, read):
            out[i] = x
    return out


def bus_bandwidth(kind: str, nbytes: float, ms: float, world: int) -> float:
    """GB/s on the bus, DeepSpeed's formulas, with ``nbytes`` the full buffer
    (``zf.comm_stats``'s count): all-gather and reduce-scatter ``size / t * (n-1)/n``;
    all-reduce ``size / t * 2(n-1)/n`` (its algorithm bandwidth is ``2 size / t``)."""
    if ms <= 0 or world < 2:
        return 0.0
    factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    return nbytes / (ms / 1e3) * factor / 1e9


def comm_series(comm: Counter, calls: Counter, ms: dict, steps: int, world: int,
                replicas: int = 1) -> dict:
    """``comm/<kind>/{bytes,count,time_ms,busbw_gbps}``, means per step of the interval;
    HSDP's ``replicate.<kind>`` collectives run over the ``replicas`` ranks of the other
    mesh dimension."""
    out = {}
    kinds = {k for k in comm if not k.endswith("_bytes")} | set(calls)
    for kind in sorted(kinds):
        nbytes, t = comm[kind + "_bytes"], ms.get("comm/" + kind, 0.0)
        dim, _, base = kind.rpartition(".")
        out[f"comm/{kind}/bytes"] = nbytes / steps
        out[f"comm/{kind}/count"] = calls[kind] / steps
        out[f"comm/{kind}/time_ms"] = t / steps
        out[f"comm/{kind}/busbw_gbps"] = bus_bandwidth(
            base, nbytes, t, replicas if dim == "replicate" else world)
    return out


def environment(rt) -> dict[str, str]:
    """What the run ran on, for the ``environment`` text."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        zerofn_version = version("zerofn")
    except PackageNotFoundError:
        zerofn_version = "(not installed)"
    device = rt.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    env = {"zerofn": zerofn_version, "torch": torch.__version__,
           "python": platform.python_version(), "backend": rt.backend,
           "world": str(dist.get_world_size(rt.group)), "rank": str(dist.get_rank(rt.group)),
           "device": f"{device} {name}".strip(),
           "threads": str(torch.get_num_threads()), "host": platform.node()}
    if device.type == "cuda":
        env["cuda"] = str(torch.version.cuda)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def rss() -> int:
    """Resident bytes now (Linux), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
