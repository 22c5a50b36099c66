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
    faulted in); ``overhead``: how much more than the memory model's prediction of what a
    step makes and frees (activations, buffers, temporaries) a calibration model's step
    raises the peak by, beyond its model state."""
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
    shape = memory.shape_of(meta, 1)
    live = memory.peak(c, shape, activations.measure(meta, (x, x), torch.float32))["host"]
    state = sum(sum(roles.values()) for roles in memory.model_state(c, shape).values())
    del model, opt
    gc.collect()
    # the model state is made once and kept: the overhead is on the rest
    return {"base": base, "overhead": max(0.0, (rise - state) / (live - state) - 1),
            "calibration_rise": rise,
            "calibration_live": live,
            **(step_rates(train, cfg) if options.get("rates", True) else {})}


def step_rates(train, small) -> dict:
    """Training rates the step-time model reads, in this (one-rank) process:
    ``compute``: FLOP/s of a GPT's forward and backward (6 per parameter per token) per
    dtype and width (the narrow calibration GPT and one of width 1024: a wider matmul runs
    faster); ``zerofn_s_per_param``: each stage's own work at one rank (packing, copies,
    hooks, the per-unit step), seconds per parameter of a step beyond plain PyTorch's."""
    from zerofn.nanogpt import GPT, GPTConfig
    import zerofn as zf
    wide = GPTConfig(vocab=4096, width=1024, heads=16, ffn=4096, layers=2, context=64)
    compute = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for cfg in (small, wide):
            torch.manual_seed(0)
            model = GPT(cfg).to(dtype)
            x = torch.randint(cfg.vocab, (2, cfg.context))
            seconds = _best(lambda: model(x, x).backward())
            compute.setdefault(name, {})[str(cfg.width)] = \
                6 * sum(p.numel() for p in model.parameters()) * x.numel() / seconds
            del model
    torch.manual_seed(0)
    plain = GPT(small)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    x = torch.randint(small.vocab, (2, small.context))
    n = sum(p.numel() for p in plain.parameters())

    def step(model, opt):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    base = _best(lambda: step(plain, opt))
    per_param = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(small)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ts = [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params()][:stage]
        model, opt = zf.compose(*ts)(model, opt)
        per_param[str(stage)] = max(0.0, _best(lambda: step(model, opt)) - base) / n
        del model, opt
        gc.collect()
    return {"compute": compute, "zerofn_s_per_param": per_param}


def _best(fn, repeats: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


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
