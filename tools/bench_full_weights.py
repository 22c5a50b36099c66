"""zf.full_weights against a per-parameter ``full_tensor()`` loop, at world 2 (gloo, CPU).

    OMP_NUM_THREADS=1 python tools/bench_full_weights.py --width 128 --layers 32

A GPT of ``--layers`` blocks of width ``--width`` under ZeRO-3 on two gloo ranks. Each
way of getting every full weight onto every rank runs ``--repeats`` times, the two
alternating; printed: the median of each, their ratio, the parameters and collectives,
and the rise of the peak resident memory (VmHWM) while ``full_weights`` runs (its
tensors dropped as they come) against one bucket plus the largest tensor.

The loop is what RL stacks wrote to sync weights into an inference engine:
``{n: p.full_tensor() for n, p in model.named_parameters()}``, one collective per
parameter.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig

MiB = 1 << 20


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))


def rank_main(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, width=args.width, heads=max(1, args.width // 64),
                    ffn=4 * args.width, layers=args.layers, context=64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = zf.shard_params()(model, opt)
    params = sum(1 for _ in model.parameters())
    bucket = args.bucket_mib * MiB

    def loop():
        return sum(p.full_tensor().numel() for _, p in model.named_parameters())

    def buckets():
        return sum(t.numel() for _, t in zf.full_weights(model, bucket_bytes=bucket))

    times = {"loop": [], "full_weights": []}
    for _ in range(args.repeats):
        for name, fn in (("loop", loop), ("full_weights", buckets)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    calls = []
    all_gather = dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or all_gather(*a, **k)
    largest = 0
    for _, t in zf.full_weights(model, bucket_bytes=bucket):
        largest = max(largest, t.numel() * t.element_size())
    dist.all_gather = all_gather
    rise = status("VmHWM") - before
    out.put((rank, {k: statistics.median(v) for k, v in times.items()}, params, len(calls),
             rise, largest))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Queue()
    mp.start_processes(rank_main, args=(2, port, args, out), nprocs=2, join=True,
                       start_method="spawn")
    results = sorted(out.get() for _ in range(2))
    rank, times, params, calls, rise, largest = results[0]
    slowest = {k: max(r[1][k] for r in results) for k in times}
    print(f"width {args.width}, {args.layers} layers: {params} parameters, world 2, "
          f"bucket {args.bucket_mib} MiB")
    print(f"per-parameter full_tensor() loop: {slowest['loop'] * 1e3:8.1f} ms "
          f"({params} collectives)")
    print(f"zf.full_weights:                  {slowest['full_weights'] * 1e3:8.1f} ms "
          f"({calls} collectives)")
    print(f"ratio: {slowest['loop'] / slowest['full_weights']:.1f}x")
    print(f"peak RSS rise during full_weights (rank 0): {rise / MiB:.1f} MiB; bucket + "
          f"largest tensor: {(args.bucket_mib * MiB + largest) / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
