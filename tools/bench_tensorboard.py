"""What zf.tensorboard costs a step: off, every=10, and inside a trace window.

    python3 tools/bench_tensorboard.py                   # 2 gloo ranks, ZeRO-3, 60 pairs
    python3 tools/bench_tensorboard.py --stage 2 --pairs 100 --nproc 2

The benchmark model of tools/bench_zero.py (a GPT of ~23M parameters, fp32 AdamW, 1 thread
per rank). Both configurations are built in the same processes from the same seed and
stepped in pairs, the order alternating (off first, then on first). Each step is timed
between barriers, so it is the slower rank's. Noise from other work on shared cores hits
both steps of a pair alike. Reported:

- every=10 against off: the ratio of mean step times over whole logging intervals
  (logging steps included: the cost a run pays), and the median of per-pair ratios (the
  cost of a step that does not log);
- a trace window (torch.profiler, wait=--warmup + 3, warmup=1, active=2): the mean step
  time inside the active window, and of the step after it (which writes the trace), over
  the same monitor's steps outside the window;
- the labels-only hot path without a monitor: calls per step into runtime/timing.py's
  ``UNTIMED`` times the measured cost of one call, as a share of the step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--pairs", type=int, default=60,
                   help="timed pairs of steps (a multiple of --every)")
    p.add_argument("--every", type=int, default=10, help="zf.tensorboard's interval")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs first")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--logdir", help="where the monitored runs write (default: a temp dir)")
    return p.parse_args(argv)


def build(args, logdir: str | None, **tensorboard):
    import torch

    import zerofn as zf
    from zerofn.nanogpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, width=args.width, heads=args.width // 64,
                          ffn=4 * args.width, layers=args.layers, context=args.context))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    transforms = [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params()][:args.stage]
    if logdir is not None:
        transforms.append(zf.tensorboard(logdir, **tensorboard))
    return zf.compose(*transforms)(model, opt)


def batch(args):
    import torch
    import torch.distributed as dist
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(args.vocab, (args.batch, args.context + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def step(model, opt, x, y) -> float:
    """Seconds of one training step, between barriers (the slower rank's)."""
    import torch.distributed as dist

    import zerofn as zf
    dist.barrier()
    start = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    zf.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    zf.log(model, loss=loss.detach(), tokens=x.numel())
    dist.barrier()
    return time.perf_counter() - start


def paired(args, off, on, x, y) -> tuple[list[float], list[float]]:
    """Step times of ``off`` and ``on`` in alternating order; warm-up pairs dropped."""
    t_off, t_on = [], []
    for i in range(args.warmup + args.pairs):
        if i % 2:
            b, a = step(*on, x, y), step(*off, x, y)
        else:
            a, b = step(*off, x, y), step(*on, x, y)
        if i >= args.warmup:
            t_off.append(a)
            t_on.append(b)
    return t_off, t_on


def trace_window(args, logdir: str, x, y) -> tuple[float, float, float]:
    """Mean step time outside a trace window, inside its active steps, and of the step
    that writes the trace (the one after the window)."""
    wait = args.warmup + 3
    model = build(args, logdir, every=args.every,
                  profile=dict(wait=wait, warmup=1, active=2))
    times = [step(*model, x, y) for _ in range(wait + 1 + 2 + 1 + args.every)]
    window = times[wait + 1:wait + 3]
    writes = times[wait + 3]
    outside = times[args.warmup:wait] + times[wait + 4:]
    return statistics.mean(outside), statistics.mean(window), writes


def untimed_share(args, model, x, y) -> tuple[int, float]:
    """Calls into the labels-only timing in one unmonitored step, and seconds per call."""
    from zerofn.runtime import timing
    calls = [0]
    methods = ("span", "collective", "issue", "waited", "begin", "end")
    originals = {m: getattr(timing.Untimed, m) for m in methods}

    def counting(fn):
        def counted(*a, **k):
            calls[0] += 1
            return fn(*a, **k)
        return counted
    for m, fn in originals.items():
        setattr(timing.Untimed, m, counting(fn))
    try:
        step(*model, x, y)
    finally:
        for m, fn in originals.items():
            setattr(timing.Untimed, m, fn)
    u, n = timing.UNTIMED, 20000
    start = time.perf_counter()
    for _ in range(n):
        with u.span("d2h", "d2h", "blocks.0"):
            pass
        u.begin("forward")
    return calls[0], (time.perf_counter() - start) / (2 * n)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    root = args.logdir
    x, y = batch(args)
    off = build(args, None)
    on = build(args, os.path.join(root, "every10"), every=args.every)
    t_off, t_on = paired(args, off, on, x, y)
    calls, per_call = untimed_share(args, off, x, y)
    del off, on
    outside, window, writes = trace_window(args, os.path.join(root, "traced"), x, y)
    if dist.get_rank() != 0:
        return
    ratios = [b / a for a, b in zip(t_off, t_on)]
    quiet = [r for i, r in enumerate(ratios) if (i + args.warmup + 1) % args.every]
    mean_off, mean_on = statistics.mean(t_off), statistics.mean(t_on)
    print(f"ZeRO-{args.stage}, {dist.get_world_size()} gloo ranks, GPT {args.layers}x{args.width}"
          f" vocab {args.vocab} context {args.context}, batch {args.batch} per rank, "
          f"{args.pairs} pairs")
    print(f"off:       mean step {mean_off * 1e3:8.1f} ms (median {statistics.median(t_off) * 1e3:.1f})")
    print(f"every={args.every}:  mean step {mean_on * 1e3:8.1f} ms (median "
          f"{statistics.median(t_on) * 1e3:.1f}); mean/mean {mean_on / mean_off:.4f}, median "
          f"per-pair ratio {statistics.median(ratios):.4f}, on steps that do not log "
          f"{statistics.median(quiet):.4f}")
    print(f"trace:     outside the window {outside * 1e3:.1f} ms, inside {window * 1e3:.1f} ms "
          f"({window / outside:.2f}x), the step writing the trace {writes * 1e3:.1f} ms")
    print(f"untimed:   {calls} calls per step x {per_call * 1e6:.2f} us = "
          f"{calls * per_call * 1e3:.3f} ms, {calls * per_call / mean_off:.2e} of a step")
    print(f"logs in {root}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.pairs % args.every:
        raise SystemExit("--pairs must be a multiple of --every (whole logging intervals).")
    if "RANK" in os.environ:
        worker(args)
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    if args.logdir is None:   # one directory for every rank: the ranks' plans must agree
        argv += ["--logdir", tempfile.mkdtemp(prefix="bench_tensorboard-")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), os.path.abspath(__file__), *argv]
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main()
