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


def collectives(options: dict) -> dict:
    """All-reduce latency (4 KiB) and bus bandwidth (16 MiB; a ring moves 2(n-1)/n of the
    buffer per rank), best of five."""
    device = torch.device("cuda", dist.get_rank()) if options.get("cuda") else \
        torch.device("cpu")
    n = dist.get_world_size()
    out = {}
    for name, numel in (("latency_s", 1 << 10), ("bus_bw", 4 << 20)):
        t = torch.ones(numel, device=device)
        best = float("inf")
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out[name] = best if name == "latency_s" else 2 * (n - 1) / n * t.nbytes / best
    return out


def process(options: dict) -> dict:
    """``base``: resident bytes after a tiny ZeRO-2 step (imports, the group, code paths
    faulted in); ``overhead``: how much more than its live bytes (the memory model's
    prediction without overhead) a calibration model's step raises the peak by."""
    import zerofn as zf
    from zerofn.nanogpt import GPT, GPTConfig
    from . import activations, memory
    from .candidates import Candidate

    def train(cfg, steps):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads())(model, opt)
        x = torch.randint(cfg.vocab, (2, cfg.context))
        for _ in range(steps):
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    tiny = GPTConfig(vocab=256, width=64, heads=2, ffn=256, layers=1, context=64)
    model, opt = train(tiny, 2)
    del model, opt
    gc.collect()
    base = _kb("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    cfg = GPTConfig(vocab=4096, width=256, heads=4, ffn=1024, layers=4, context=64)
    model, opt = train(cfg, 3)
    rise = _kb("VmHWM") * 1024 - base
    with torch.device("meta"):
        meta = GPT(cfg)
    x = torch.zeros(2, cfg.context, dtype=torch.long)
    c = Candidate(stage=2)
    live = memory.peak(c, memory.shape_of(meta, 1),
                       activations.measure(meta, (x, x), torch.float32))["host"]
    return {"base": base, "overhead": max(0.0, rise / live - 1), "calibration_rise": rise,
            "calibration_live": live}


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main(argv) -> None:
    what, size, store, options, rank = argv[0], int(argv[1]), argv[2], json.loads(argv[3]), \
        int(argv[4])
    torch.set_num_threads(1)
    backend = "nccl" if options.get("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=size)
    try:
        result = {"collectives": collectives, "process": process}[what](options)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
