"""Benchmarks zerofn's C++ CPU Adam against its peers, in one process, interleaved.

Contenders at each size N (one fp32 tensor of N params, fp32 grads):
  zerofn CPUAdam; torch AdamW fused / foreach / single-tensor; DeepSpeedCPUAdam when
  importable; zerofn's kernel on bf16 grads (26 B/param, informational); and the roofline kernel in zerofn._C (Adam's 28 B/param of traffic with
  trivial arithmetic). All step the same buffers (state injected), each round runs
  every contender in a rotated order, and the reported time is the median over rounds,
  so a noisy neighbour hits everyone alike.

Then the fused pipeline, loss-scaled fp32 grads -> global-norm clip -> AdamW -> bf16
copy of the params: zerofn (``CPUAdam.clip_and_step``: one norm read + one fused pass)
against its torch equivalent (``clip_grad_norm_`` + fused AdamW unscaling through its
``grad_scale`` + ``copy_`` into bf16).

With ``--lowp``: instead, zerofn's kernel on every low-precision combination (moments
fp32 / bf16 / int8 x masters fp32 / bf16; bf16 grads, bf16 copy-out) against the roofline
kernel, in bytes moved per parameter and the fraction of the roofline's GB/s they reach.

Usage: python3 tools/bench_cpu_adam.py [--sizes 10,50,100] [--rounds 7] [--markdown] [--lowp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed must not look for CUDA

import torch  # noqa: E402

import zerofn.optim as zo  # noqa: E402

ADAM_BYTES = 28  # read p, g, m, v; write p, m, v (fp32)
BYTES = {"zerofn, bf16 grads": 26}  # contenders whose traffic differs from ADAM_BYTES
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LOSS_SCALE, MAX_NORM = 1024.0, 1.0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(contenders: dict, rounds: int) -> dict:
    """Median seconds per call of each contender, running them round-robin."""
    for fn in contenders.values():
        fn()  # warm-up: first-touch page faults, thread pools, lazy state
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(contenders[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def with_state(opt, param, m, v, step) -> torch.optim.Optimizer:
    """Makes opt step the shared moment buffers instead of allocating its own."""
    opt.state[param] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    return opt


def deepspeed_adam(param, m, v):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its op failed to build
        print(f"# DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}".splitlines()[0])
        return None
    return with_state(DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER), param, m, v, 1)


def step_contenders(param, m, v) -> dict:
    """name -> zero-argument callable doing one optimizer step on the shared buffers."""
    torch_step = lambda: torch.tensor(1.0)  # noqa: E731  each torch optimizer counts alone
    out = {
        "zerofn CPUAdam": with_state(zo.CPUAdam([param], **HYPER), param, m, v, torch_step()),
        "roofline kernel": None,
        "torch AdamW fused": with_state(
            torch.optim.AdamW([param], fused=True, **HYPER), param, m, v, torch_step()),
        "torch AdamW foreach": with_state(
            torch.optim.AdamW([param], foreach=True, **HYPER), param, m, v, torch_step()),
        "torch AdamW single": with_state(
            torch.optim.AdamW([param], foreach=False, **HYPER), param, m, v, torch_step()),
        "DeepSpeedCPUAdam": deepspeed_adam(param, m, v),
    }  # fmt: skip
    calls = {name: opt.step for name, opt in out.items() if opt is not None}
    calls["roofline kernel"] = lambda: zo.adam_roofline(param.detach(), param.grad, m, v)
    g16 = param.grad.to(torch.bfloat16)  # what offload copies from a bf16 device: 26 B/param
    calls["zerofn, bf16 grads"] = lambda: zo.adam_step(
        param.detach(), g16, m, v, step=1, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    return calls


def pipeline_contenders(param, m, v) -> dict:
    """The whole host step after backward, zerofn fused against torch's separate passes."""
    low = torch.empty(param.shape, dtype=torch.bfloat16)
    ours = with_state(zo.CPUAdam([param], **HYPER), param, m, v, torch.tensor(1.0))
    ref = with_state(torch.optim.AdamW([param], fused=True, **HYPER), param, m, v,
                     torch.tensor(1.0))  # fmt: skip
    ref.grad_scale = torch.tensor(LOSS_SCALE)  # fused AdamW divides grads by it in-kernel

    def zerofn_pipeline():
        ours.clip_and_step(MAX_NORM, loss_scale=LOSS_SCALE, lowp_out={param: low})

    def torch_pipeline():
        # Clipping the scaled grads at MAX_NORM * LOSS_SCALE equals unscale-then-clip.
        norm = torch.nn.utils.clip_grad_norm_([param], MAX_NORM * LOSS_SCALE)
        if torch.isfinite(norm):
            ref.step()
            low.copy_(param.detach())

    return {"zerofn fused pipeline": zerofn_pipeline, "torch pipeline": torch_pipeline}


def bench_size(n: int, rounds: int) -> list[tuple]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    rows = []
    med = interleave(step_contenders(param, m, v), rounds)
    for name, s in med.items():
        rows.append((n, name, n / s / 1e6, n * BYTES.get(name, ADAM_BYTES) / s / 1e9, s * 1e3))
    param.grad.mul_(LOSS_SCALE * 1e3)  # a loss-scaled gradient that clipping must shrink
    med = interleave(pipeline_contenders(param, m, v), rounds)
    for name, s in med.items():
        rows.append((n, name, n / s / 1e6, float("nan"), s * 1e3))
    return rows


def ratios(rows: list[tuple]) -> list[str]:
    """The acceptance ratios of docs/cpu_adam.md, per size."""
    lines = []
    for n in sorted({r[0] for r in rows}):
        rate = {name: mps for size, name, mps, _, _ in rows if size == n}
        peers = [rate[k] for k in ("torch AdamW fused", "DeepSpeedCPUAdam") if k in rate]
        lines.append(
            f"N={n / 1e6:.0f}M: zerofn / best(torch fused, DeepSpeed) = "
            f"{rate['zerofn CPUAdam'] / max(peers):.2f}x; zerofn / roofline = "
            f"{rate['zerofn CPUAdam'] / rate['roofline kernel'] * 100:.0f}%; "
            f"fused pipeline / torch pipeline = "
            f"{rate['zerofn fused pipeline'] / rate['torch pipeline']:.2f}x"
        )
    return lines


def print_table(rows: list[tuple], markdown: bool) -> None:
    head = ("N", "contender", "M params/s", "GB/s of Adam traffic", "ms/step")
    if markdown:
        print("| " + " | ".join(head) + " |\n|---|---|---:|---:|---:|")
    else:
        print(f"{head[0]:>5}  {head[1]:<22} {head[2]:>11} {head[3]:>18} {head[4]:>9}")
    for n, name, mps, gbs, ms in rows:
        cells = (f"{n / 1e6:.0f}M", name, f"{mps:.0f}", "-" if gbs != gbs else f"{gbs:.1f}",
                 f"{ms:.1f}")  # fmt: skip
        if markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print(f"{cells[0]:>5}  {cells[1]:<22} {cells[2]:>11} {cells[3]:>18} {cells[4]:>9}")


STATE_BYTES = {"fp32": 8, "bf16": 4, "int8": 2}  # per moment: read + write


def lowp_bytes(state: str, master: str) -> float:
    """Bytes per param of one step: params, both moments (and 8-bit scales, 4 B read +
    4 B written per 256 elements each) read and written, bf16 grads read, bf16 out
    written (streamed: no read-for-ownership)."""
    scales = 2 * 8 / zo.QUANT_BLOCK if state == "int8" else 0.0
    return (8 if master == "fp32" else 4) + 2 * STATE_BYTES[state] + scales + 2 + 2


def lowp_contenders(n: int) -> dict:
    torch.manual_seed(0)
    g16 = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    master32 = torch.randn(n)
    calls = {}
    for master in ("fp32", "bf16"):
        for state in ("fp32", "bf16", "int8"):
            p = master32.clone() if master == "fp32" else master32.to(torch.bfloat16)
            kw = dict(lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], out=out)
            if state == "int8":
                m, ms = zo.quantize_blockwise(torch.randn(n) * 1e-4, True)
                v, vs = zo.quantize_blockwise(torch.rand(n) * 1e-8, False)
                kw.update(exp_avg_scale=ms, exp_avg_sq_scale=vs)
            else:
                dt = torch.float32 if state == "fp32" else torch.bfloat16
                m, v = (torch.randn(n) * 1e-4).to(dt), (torch.rand(n) * 1e-8).to(dt)
            calls[(state, master)] = (lambda p=p, m=m, v=v, kw=kw:
                                      zo.adam_step(p, g16, m, v, step=2, **kw))  # fmt: skip
    bufs = [torch.randn(n) for _ in range(4)]
    calls["roofline"] = lambda: zo.adam_roofline(*bufs)
    return calls


def bench_lowp(sizes: list[int], rounds: int, markdown: bool) -> None:
    head = ("N", "moments", "masters", "G params/s", "B/param", "GB/s", "% roofline",
            "x fp32 state")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|---|---|---|---:|---:|---:|---:|---:|" if markdown
          else "  ".join(f"{h:>12}" for h in head))  # fmt: skip
    for n in sizes:
        med = interleave(lowp_contenders(n), rounds)
        roof_gbs = n * ADAM_BYTES / med.pop("roofline") / 1e9
        base = {master: n / med[("fp32", master)] for master in ("fp32", "bf16")}
        fp32_rate = base["fp32"]
        for (state, master), s in med.items():
            rate, nbytes = n / s, lowp_bytes(state, master)
            cells = (f"{n / 1e6:.0f}M", state, master, f"{rate / 1e9:.3f}", f"{nbytes:.2f}",
                     f"{rate * nbytes / 1e9:.1f}", f"{rate * nbytes / 1e9 / roof_gbs * 100:.0f}%",
                     f"{rate / fp32_rate:.2f}x")  # fmt: skip
            print("| " + " | ".join(cells) + " |" if markdown
                  else "  ".join(f"{c:>12}" for c in cells))  # fmt: skip
        print(f"roofline kernel at N={n / 1e6:.0f}M: {roof_gbs:.1f} GB/s "
              f"({roof_gbs / ADAM_BYTES:.3f} G params/s at {ADAM_BYTES} B/param)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,50,100", help="millions of params, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--markdown", action="store_true", help="print a table for docs/")
    ap.add_argument("--lowp", action="store_true",
                    help="low-precision state and masters (bf16 grads and copy-out)")
    args = ap.parse_args()
    info = zo.kernel_info()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; zerofn._C isa="
          f"{info['isa']} threads={info['threads']}; median of {args.rounds} interleaved rounds")
    if args.lowp:
        sizes = [int(float(size) * 1e6) for size in args.sizes.split(",")]
        return bench_lowp(sizes, args.rounds, args.markdown)
    rows = []
    for size in args.sizes.split(","):
        rows += bench_size(int(float(size) * 1e6), args.rounds)
    print_table(rows, args.markdown)
    for line in ratios(rows):
        print(line)


if __name__ == "__main__":
    main()
