"""``zerofn probe``: the machine's rates and memory, measured in seconds and cached per
machine and torch version, as the plan's models take them.

What it measures (each a short timed loop, best of a few, so load from other work on the
machine makes a rate low rather than noisy):

- ``matmul``: FLOP/s of a transformer block's matmuls (width 1024, 4× FFN) per compute
  dtype on the training device (one thread per rank on a CPU, as zerofn's ranks run);
- ``memory_bw``: host memory bandwidth (bytes/s read plus written by a large copy);
- ``cpu_adam``: zerofn's C++ Adam, parameters per second per state dtype, one thread;
  ``cpu_adam_all``: the same with every core (a GPU's rank has the cores its machine's
  ranks share: ``zerofn train`` gives each ``cores // ranks``);
- ``h2d``/``d2h``: pinned copies to and from the GPU, where there is one;
- ``disk_read``/``disk_write``: the NVMe offload path's file bandwidth (direct to the
  file, synced);
- ``collectives``: all-reduce latency (4 KiB) and bus bandwidth (16 MiB), and zerofn's own
  reduce-scatter and all-gather bandwidth, per group size on the backend training would
  use (gloo on CPUs, NCCL on GPUs), in real processes;
- ``process``: the resident memory of a process once torch, zerofn and a process group
  are up and a tiny step has run (``base``), and the allocator's overhead, measured by
  training a calibration model and comparing its peak with what it holds;
- ``free``: free bytes of host memory, the device and the disk.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from zerofn.runtime.memory import proc_bytes

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "zerofn")
BLOCK_WIDTH = 1024


@dataclass
class Machine:
    """The probe's measurements; every rate in units per second."""

    device: str
    matmul: dict[str, float]              # compute dtype -> FLOP/s
    memory_bw: float                      # bytes/s
    cpu_adam: dict[str, float]            # state dtype -> parameters/s, one thread
    disk_read: float
    disk_write: float
    collectives: dict[str, dict[str, float]]   # group size -> latency_s, bus_bw
    process: dict[str, float]             # base bytes, overhead per byte
    free: dict[str, int]
    h2d: float | None = None
    d2h: float | None = None
    cores: int = 0                        # CPU cores (0: not recorded)
    cpu_adam_all: dict[str, float] = field(default_factory=dict)   # ... every core
    torch: str = torch.__version__
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def collective(self, size: int, kind: str = "all_reduce") -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of ``kind`` ("all_reduce", zerofn's
        "reduce_scatter" or "all_gather") for a group of ``size``: the probed size nearest
        from below (a larger group's ring is no faster per byte). A probe that did not time
        zerofn's own gives the all-reduce's bus bandwidth."""
        sizes = sorted(int(k) for k in self.collectives)
        near = max([s for s in sizes if s <= size], default=sizes[0])
        got = self.collectives[str(near)]
        return got["latency_s"], got.get(f"{kind}_bw", got["bus_bw"])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Machine":
        return cls(**data)


def cache_path(path: str | None = None) -> str:
    name = f"probe-{socket.gethostname()}-torch{torch.__version__}.json"
    return path or os.path.join(CACHE, name)


def load_or_probe(path: str | None = None, refresh: bool = False, **kw) -> Machine:
    """The cached probe of this machine, probing (and caching) where there is none."""
    path = cache_path(path)
    if not refresh and os.path.exists(path):
        with open(path) as f:
            return Machine.from_json(json.load(f))
    machine = probe(**kw)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine.to_json(), f, indent=1)
    return machine


def probe(nvme_path: str | None = None, group_sizes: tuple[int, ...] | None = None) -> Machine:
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul = {name: matmul_rate(dtype, device) for name, dtype in
                  (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        memory_bw = copy_rate(torch.device("cpu"))
        adam = cpu_adam_rates()
    finally:
        torch.set_num_threads(threads)
    adam_all = cpu_adam_rates(16 << 20)     # (more work: every core starts and joins)
    h2d, d2h = transfer_rates() if cuda else (None, None)
    read, write = disk_rates(nvme_path or tempfile.gettempdir())
    sizes = group_sizes or default_group_sizes(cuda)
    collectives = {str(n): collective_rates(n, cuda) for n in sizes}
    process = process_memory()
    return Machine(device=_device_name(cuda), matmul=matmul, memory_bw=memory_bw,
                   cpu_adam=adam, disk_read=read, disk_write=write, collectives=collectives,
                   process=process, free=free_bytes(nvme_path), h2d=h2d, d2h=d2h,
                   cores=os.cpu_count() or 0, cpu_adam_all=adam_all,
                   seconds=time.perf_counter() - start,
                   extra={"cuda": rates_from_cuda(torch.cuda.get_device_properties(0),
                                                  torch.cuda.mem_get_info()),
                          "gpus": torch.cuda.device_count()} if cuda else {})


def _best(fn, repeats: int = 5) -> float:
    """The shortest of ``repeats`` timed calls (after one untimed), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_rate(dtype: torch.dtype, device: torch.device, tokens: int = 256) -> float:
    """FLOP/s of a block's four matmul shapes (q/k/v/out, up, down) for ``tokens`` rows."""
    w = BLOCK_WIDTH
    shapes = [(w, 3 * w), (w, w), (w, 4 * w), (4 * w, w)]
    x = {k: torch.randn(tokens, k, dtype=dtype, device=device) for k, _ in shapes}
    ws = [torch.randn(k, n, dtype=dtype, device=device) for k, n in shapes]

    def run():
        for (k, _), wt in zip(shapes, ws):
            x[k] @ wt
    flops = sum(2 * tokens * k * n for k, n in shapes)
    return flops / _best(run)


def copy_rate(device: torch.device, numel: int = 16 << 20) -> float:
    """Bytes/s read plus written copying ``numel`` fp32 elements."""
    a = torch.ones(numel, device=device)
    b = torch.empty_like(a)
    return 2 * a.nbytes / _best(lambda: b.copy_(a))


def cpu_adam_rates(numel: int = 4 << 20) -> dict[str, float]:
    """zerofn's C++ Adam, parameters per second on torch's threads: fp32 masters and moments
    (bf16 and int8 moments step through the same kernel with a conversion, measured the
    same way where the kernel is built for them)."""
    from zerofn.optim import adam_step
    p = torch.zeros(numel)
    g = torch.full((numel,), 1e-3)
    m, v = torch.zeros(numel), torch.zeros(numel)
    seconds = _best(lambda: adam_step(p, g, m, v, step=1, lr=1e-3), 3)
    return {"fp32": numel / seconds}


def transfer_rates(numel: int = 64 << 20) -> tuple[float, float]:
    """Pinned host to device and device to host bytes/s."""
    host = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(numel, dtype=torch.uint8, device="cuda")
    return (numel / _best(lambda: dev.copy_(host, non_blocking=True)),
            numel / _best(lambda: host.copy_(dev, non_blocking=True)))


def disk_rates(directory: str, nbytes: int = 64 << 20) -> tuple[float, float]:
    """(read, write) bytes/s of a file in ``directory``, written and synced, then read
    back after dropping it from the page cache where the OS allows."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".zerofn-probe-")
    try:
        def write():
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, data)
            os.fsync(fd)

        def read():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.lseek(fd, 0, os.SEEK_SET)
            while os.read(fd, 8 << 20):
                pass
        written = nbytes / _best(write, 3)     # (first: the read needs the file)
        return nbytes / _best(read, 3), written
    finally:
        os.close(fd)
        os.remove(path)


def default_group_sizes(cuda: bool) -> tuple[int, ...]:
    """Group sizes the machine can run: up to its GPUs, or 2 on a CPU (a larger gloo
    group on the same cores measures the cores' contention, not the network)."""
    if cuda:
        n = torch.cuda.device_count()
        return tuple(s for s in (2, 4, 8) if s <= n) or (1,)
    return (2,)


def collective_rates(size: int, cuda: bool) -> dict[str, float]:
    """All-reduce latency and bus bandwidth in ``size`` real processes."""
    if size == 1:
        return {"latency_s": 0.0, "bus_bw": float("inf")}
    out = _run_ranks(size, "collectives", {"cuda": cuda})
    return out


def process_memory(repeats: int = 3) -> dict[str, float]:
    """A fresh process's resident bytes with torch, zerofn and a process group up and a
    tiny step run, and the allocator's overhead on a calibration model's step: the median
    of ``repeats`` fresh processes (the overhead varies from one to the next: 38 to 48 %
    on this machine's 2 shared cores), the training rates from the first."""
    cuda = torch.cuda.is_available()
    runs = [_run_ranks(1, "process", {"rates": i == 0, "cuda": cuda}) for i in range(repeats)]
    out = dict(runs[0], zerofn_own=_run_ranks(1, "own", {"cuda": cuda}))
    for key in ("base", "overhead", "calibration_rise"):
        out[key] = sorted(r[key] for r in runs)[repeats // 2]
    out["overheads"] = [r["overhead"] for r in runs]
    return out


def free_bytes(nvme_path: str | None) -> dict[str, int]:
    out = {"host": proc_bytes("MemAvailable", "/proc/meminfo")}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.mem_get_info()[0]
    import shutil
    out["disk"] = shutil.disk_usage(nvme_path or tempfile.gettempdir()).free
    return out


def _device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _run_ranks(size: int, what: str, options: dict) -> dict:
    """Run ``probe_ranks.py``'s ``what`` in ``size`` fresh processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "zerofn.planner.probe_ranks", what, str(size),
               os.path.join(tmp, "store"), json.dumps(options)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(cmd + [str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(size)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the probe's {what} ranks failed: {outs}")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def rates_from_cuda(props, mem_info: tuple[int, int]) -> dict:
    """What the probe records of a CUDA device from torch's own answers (its properties
    and ``mem_get_info``), read apart so it can be checked without one."""
    return {"name": props.name, "total": int(props.total_memory), "free": int(mem_info[0]),
            "sms": int(props.multi_processor_count)}
