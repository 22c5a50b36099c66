"""Host memory of a checkpoint save against the training step's own, under offload.

    OMP_NUM_THREADS=1 python tools/bench_save_memory.py --layers 8 --rows lowp,cpu,nvme --worlds 1,2

A GPT of ``--layers`` blocks of width ``--width`` (``--layers 8``: 110M parameters) under
ZeRO-3 takes two AdamW steps on each of ``--worlds`` gloo ranks (CPU), then, per rank:
the peak resident memory (VmHWM, reset just before) of one more step, and of one
``save_checkpoint``, synchronous (``sync``) or background (``async_save=True``, up to
``wait_for_checkpoint()``: ``async``), or a background save with ``--train-steps`` steps
taken right after the call, before the wait (``async-train``: the steps change the state
the save is writing, so it copies units aside before they change, or the step waits).
Printed per row: the save's peak above the step's, the largest over the ranks (one rank's
state shrinks with the world, one data file does not); for ``async-train`` also the
steps after the call against as many steps alone (their time over the steps' own, in
the same run) and the steps that waited for the save (``checkpoint_waits``).

Rows: ``nvme`` ``offload("nvme")``; ``cpu`` ``offload("cpu")``; ``lowp``
``offload("cpu", state_dtype=torch.int8, master_dtype=torch.bfloat16)`` under bf16
compute (``mixed_precision``); ``none`` ZeRO-3 without offload.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime import runtime_of

MiB = 1 << 20


def transforms(row: str, swap: str):
    if row == "nvme":
        return [zf.shard_params(), zf.offload("nvme", path=swap)]
    if row == "cpu":
        return [zf.shard_params(), zf.offload("cpu")]
    if row == "none":
        return [zf.shard_params()]
    if row == "lowp":
        return [zf.shard_params(), zf.mixed_precision(torch.bfloat16),
                zf.offload("cpu", state_dtype=torch.int8, master_dtype=torch.bfloat16)]
    raise SystemExit(f"--rows: unknown row {row!r} (nvme, cpu, lowp, none)")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))


def peak_of(fn) -> int:
    """VmHWM while ``fn`` runs, the peak reset to the current use first."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return status("VmHWM")


def rank_main(rank, world, port, args, row, mode, root, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.large_frees:
        zf.return_large_frees()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, width=args.width, heads=args.width // 64, ffn=4 * args.width,
                    layers=args.layers, context=64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    model, opt = zf.compose(*transforms(row, swap))(model, opt)
    x = torch.randint(0, 256, (2, 64))

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()

    step(), step()
    step_peak = peak_of(step)
    steps_s = _timed(step, args.train_steps)      # as many steps alone, for the ratio
    after_s = 0.0

    def save():
        nonlocal after_s
        zf.save_checkpoint(os.path.join(root, "ckpt"), model, opt, step=3,
                           async_save=mode != "sync")
        if mode == "async-train":
            after_s = _timed(step, args.train_steps)
        zf.wait_for_checkpoint()

    save_peak = peak_of(save)
    # (-1 where zerofn does not count them: a checkout from before they were, for "before")
    counted = getattr(runtime_of(model), "checkpoint_waits", None)
    waits = counted()[0] if counted is not None else -1
    out.put((rank, step_peak, save_peak, after_s / steps_s, waits))
    dist.barrier()
    dist.destroy_process_group()


def _timed(step, times: int) -> float:
    start = time.perf_counter()
    for _ in range(times):
        step()
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, row: str, world: int, mode: str) -> tuple[int, int, float, int]:
    """The largest rank's save peak above its step peak and its step peak (bytes), the
    slowest rank's steps after the call over its steps alone, and the most waits."""
    root = tempfile.mkdtemp(prefix="bench_save_", dir=args.dir)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        mp.start_processes(rank_main, args=(world, _free_port(), args, row, mode, root, out),
                           nprocs=world, join=True, start_method="spawn")
        results = [out.get() for _ in range(world)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rank, step_peak, save_peak, _, _ = max(results, key=lambda r: r[2] - r[1])
    return (save_peak - step_peak, step_peak, max(r[3] for r in results),
            max(r[4] for r in results))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rows", default="nvme,lowp,cpu")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--modes", default="sync,async,async-train")
    p.add_argument("--train-steps", type=int, default=3,
                   help="async-train: the steps taken right after the call")
    p.add_argument("--large-frees", action="store_true",
                   help="zf.return_large_frees() first, as zerofn train does on a CPU")
    p.add_argument("--dir", default=None, help="where the swap files and checkpoints go")
    args = p.parse_args(argv)
    print(f"{'row':6} {'world':>5} {'mode':11} {'step peak MiB':>14} "
          f"{'save above step MiB':>20} {'steps after/alone':>18} {'waits':>5}")
    for row in args.rows.split(","):
        for world in map(int, args.worlds.split(",")):
            for mode in args.modes.split(","):
                above, step_peak, ratio, waits = measure(args, row, world, mode)
                timing = f"{ratio:18.2f} {waits:5d}" if mode == "async-train" else ""
                print(f"{row:6} {world:5d} {mode:11} {step_peak / MiB:14.0f} "
                      f"{above / MiB:+20.0f} {timing}", flush=True)


if __name__ == "__main__":
    main()
