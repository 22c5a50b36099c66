"""What the non-finite guard costs a step: ZeRO-1 on one process, ``on_nonfinite="skip"``
(the default: every gradient checked, the vote read back) against ``"ignore"`` (nothing
checked), in fp32 and in bf16 (fp32 gradients for the step), each the median of
``--steps`` steps after two warm-up steps, the two rules alternating run by run.

    OMP_NUM_THREADS=1 python tools/bench_nonfinite.py --width 512 --layers 8 --steps 6

Prints, per precision, the parameters, each rule's step and the check alone (the guard's
own read of the gradients, ``any_nonfinite``, timed apart on the same gradients).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime.step_grads import any_nonfinite, by_device_and_dtype


def step_ms(cfg, precision, rule: str, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    extra = [zf.mixed_precision(precision)] if precision else []
    model, opt = zf.compose(zf.shard_optimizer(on_nonfinite=rule), *extra)(model, opt)
    x = torch.randint(0, cfg.vocab, (4, cfg.context))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def check_ms(cfg, repeats: int = 5) -> tuple[int, float]:
    """The check alone, on gradients shaped as the model's parameters (fp32)."""
    grads = [torch.randn_like(p) for p in GPT(cfg).parameters()]
    groups = list(by_device_and_dtype(grads).values())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for group in groups:
            any_nonfinite(group).item()
        times.append(time.perf_counter() - start)
    return sum(g.numel() for g in grads), statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = GPTConfig(vocab=4096, width=args.width, heads=8, ffn=4 * args.width,
                    layers=args.layers, context=128)
    n, check = check_ms(cfg)
    print(f"{n / 1e6:.1f}M parameters; the check alone: {check:.1f} ms")
    for name, precision in (("fp32", None), ("bf16", torch.bfloat16)):
        runs = {"skip": [], "ignore": []}
        for _ in range(2):
            for rule in runs:
                runs[rule].append(step_ms(cfg, precision, rule, args.steps))
        skip, ignore = (min(runs[r]) for r in ("skip", "ignore"))
        print(f"{name}: step {ignore:.1f} ms with 'ignore', {skip:.1f} ms with 'skip' "
              f"({skip - ignore:+.1f} ms, {100 * (skip - ignore) / ignore:+.1f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
