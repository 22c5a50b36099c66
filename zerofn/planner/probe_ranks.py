"""The probe's parts that run in fresh processes: collectives between real ranks, and a
process's own memory (a fresh process, so nothing this one allocated counts).

    python -m zerofn.planner.probe_ranks WHAT SIZE STORE OPTIONS_JSON RANK
"""
from __future__ import annotations

import gc
import json
import sys
import time

import torch
import torch.distributed as dist

from zerofn.runtime.memory import proc_bytes


def collectives(options: dict) -> dict:
    """All-reduce latency (4 KiB) and bus bandwidth (16 MiB; a ring moves 2(n-1)/n of the
    buffer per rank), and zerofn's own reduce-scatter and all-gather (runtime/comm.py: on
    gloo not gloo's, which copy the whole buffer) at 16 MiB, each moving (n-1)/n of it per
    rank; best of five."""
    from zerofn.runtime.comm import Comm
    device = torch.device("cuda", dist.get_rank()) if options.get("cuda") else \
        torch.device("cpu")
    n = dist.get_world_size()
    comm = Comm(None, 1 << 22, device)
    full = torch.ones(4 << 20, device=device)
    shard = torch.empty(full.numel() // n, device=device)
    scratch = torch.empty(comm.scratch_numel(full.numel()), device=device)
    calls = {"latency_s": lambda t=torch.ones(1 << 10, device=device): dist.all_reduce(t),
             "bus_bw": lambda: dist.all_reduce(full),
             "reduce_scatter_bw": lambda: comm.reduce_scatter(shard, full,
                                                              scratch=scratch if scratch.numel()
                                                              else None),
             "all_gather_bw": lambda: comm.all_gather(full, shard)}
    out = {}
    for name, call in calls.items():
        best = float("inf")
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        moved = {"latency_s": None, "bus_bw": 2 * (n - 1) / n}.get(name, (n - 1) / n)
        out[name] = best if moved is None else moved * full.nbytes / best
    return out


def process(options: dict) -> dict:
    """``base``: resident bytes after a tiny ZeRO-2 step (imports, the group, code paths
    faulted in; on a GPU the CUDA context too); ``overhead``: how much more than the
    memory model's prediction of what a step makes and frees (activations, buffers,
    temporaries) a calibration model's step raises the peak by, beyond its model state:
    the process's high-water mark on a CPU, the caching allocator's peak allocated bytes
    on a GPU (what the runs it is checked against report)."""
    from zerofn.config import Config
    from zerofn.nanogpt import GPT, GPTConfig
    from . import calibration
    device = _device(options)

    def train(cfg, steps):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = Config(2).transform()(model, opt)
        x = torch.randint(cfg.vocab, (calibration.ROWS, cfg.context), device=device)
        for _ in range(steps):
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    tiny = GPTConfig(vocab=256, width=64, heads=2, ffn=256, layers=1, context=64)
    model, opt = train(tiny, 2)
    del model, opt
    gc.collect()
    base = proc_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    model, opt = train(calibration.MODEL, 3)
    rise = proc_bytes("VmHWM") - base if device.type == "cpu" else \
        torch.cuda.max_memory_allocated(device) - before
    del model, opt
    gc.collect()
    return {"base": base, "overhead": calibration.overhead(rise, device.type == "cpu"),
            "calibration_rise": rise,
            **(step_rates(calibration.MODEL, device) if options.get("rates", True) else {})}


def _device(options: dict) -> torch.device:
    if not options.get("cuda"):
        return torch.device("cpu")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# Widths the compute rate is measured at, and tokens a micro-batch: on a CPU the narrow
# calibration GPT and one of width 1024 at 2 x 64 tokens (what fits its seconds); on a
# GPU widths a billion-parameter model has, at 4 x 1024 tokens (smaller ones measure the
# kernels' launches, not their arithmetic).
RATE_SHAPES = {"cpu": ((256, 1024), 2, 64), "cuda": ((1024, 4096), 4, 1024)}


def step_rates(small, device: torch.device = torch.device("cpu")) -> dict:
    """``compute``: FLOP/s of a GPT's forward and backward (6 per parameter per token) per
    dtype and width (a wider matmul runs faster), in this (one-rank) process: the
    calibration GPT ``small`` and wider ones (RATE_SHAPES). zerofn's own work per step is
    ``own_work``'s, in a process of its own."""
    from zerofn.nanogpt import GPT, GPTConfig
    widths, rows, context = RATE_SHAPES[device.type]
    compute = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for width in widths:
            cfg = GPTConfig(vocab=4096, width=width, heads=width // 64, ffn=4 * width,
                            layers=2 if width > small.width else small.layers,
                            context=context)
            torch.manual_seed(0)
            model = GPT(cfg).to(device=device, dtype=dtype)
            x = torch.randint(cfg.vocab, (rows, cfg.context), device=device)
            seconds = _best(lambda: model(x, x).backward(), device=device)
            compute.setdefault(name, {})[str(cfg.width)] = \
                6 * sum(p.numel() for p in model.parameters()) * x.numel() / seconds
            del model
    return {"compute": compute}


def own_work(options: dict) -> dict:
    """Each stage's own work at one rank (packing, copies, hooks, the per-unit step,
    Python): seconds a step takes beyond plain PyTorch's, as ``{"per_unit", "per_param"}``
    solved from two calibration GPTs, a narrow one (many small units) and one of width
    1024 (few large ones). Run in a fresh process, plain PyTorch first, then zerofn's
    stages with glibc's mmap threshold fixed on a CPU, as ``zerofn train`` runs them
    (runtime/host_malloc.py): the setting is process-wide and changes a plain step's
    time too."""
    from zerofn.core.units import build_units
    from zerofn.nanogpt import GPT, GPTConfig
    from zerofn.config import Config
    device = _device(options)
    shapes = [GPTConfig(vocab=4096, width=w, heads=w // 64, ffn=4 * w, layers=layers,
                        context=64) for w, layers in ((256, 4), (1024, 2))]
    plain = []
    for cfg in shapes:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        plain.append((len(build_units(model, None, 1, 0)),
                      sum(p.numel() for p in model.parameters()),
                      _best(_stepper(model, opt, cfg, device), device=device)))
        del model, opt
    points = {}
    if device.type == "cpu":
        zf.return_large_frees()
    for cfg, (units, n, base) in zip(shapes, plain):
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, opt = Config(stage).transform()(model, opt)
            extra = max(0.0, _best(_stepper(model, opt, cfg, device), device=device) - base)
            points.setdefault(str(stage), []).append((units, n, extra))
            del model, opt
            gc.collect()
    return {stage: _per_unit_and_param(*pts) for stage, pts in points.items()}


def _stepper(model, opt, cfg, device):
    x = torch.randint(cfg.vocab, (2, cfg.context), device=device)

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return step


def _per_unit_and_param(a: tuple, b: tuple) -> dict:
    """Solve ``extra = per_unit * units + per_param * params`` through two points; where
    the timings' noise would make either negative, all of it per parameter."""
    (ua, na, ea), (ub, nb, eb) = a, b
    det = ua * nb - ub * na
    per_unit = (ea * nb - eb * na) / det if det else -1.0
    per_param = (ua * eb - ub * ea) / det if det else -1.0
    if per_unit < 0 or per_param < 0:
        return {"per_unit": 0.0, "per_param": (ea + eb) / (na + nb)}
    return {"per_unit": per_unit, "per_param": per_param}


def _best(fn, repeats: int = 4, device: torch.device = torch.device("cpu")) -> float:
    def timed():
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t
    timed()
    return min(timed() for _ in range(repeats))


def main(argv) -> None:
    what, size, store, options, rank = argv[0], int(argv[1]), argv[2], json.loads(argv[3]), \
        int(argv[4])
    torch.set_num_threads(1)
    backend = "nccl" if options.get("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=size)
    try:
        result = {"collectives": collectives, "process": process, "own": own_work}[what](options)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
