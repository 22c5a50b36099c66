"""What the gradient-edit detector costs a step: ZeRO-2 + offload("nvme") on one process
(every unit's rows land in NVMe's staging during backward, so each is fingerprinted at
backward's end and again at the step: visible.py's [Note: gradients as a loop sees them]), the
fingerprint's time summed over each step against the step's, and against a sum of the
rows' bits (the detector it replaced, which missed permutations) over the same rows.

    OMP_NUM_THREADS=1 python tools/bench_edit_detector.py              # 109.5M-param GPT
    OMP_NUM_THREADS=1 python tools/bench_edit_detector.py --layers 2   # quicker

The GPT is lowp_memory.py's (width 768, 12 heads, FFN 3072, vocabulary 50304, 10 blocks)
in fp32, one sequence of 64 tokens a step. Prints, per round, the median step, the
fingerprints' share of it, and the bit sum's time over the same rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime import visible


class TimedFingerprint:
    """visible.fingerprint, timed, and the rows it saw (to time the bit sum over them)."""

    def __init__(self):
        self.real, self.seconds, self.rows = visible.fingerprint, 0.0, []

    def __call__(self, rows):
        start = time.perf_counter()
        out = self.real(rows)
        self.seconds += time.perf_counter() - start
        self.rows.append(rows)
        return out


def bit_sum_seconds(rows: list[torch.Tensor]) -> float:
    """The replaced detector, chunked as it was, over the same rows."""
    start = time.perf_counter()
    for r in rows:
        bits = r.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[r.element_size()])
        torch.stack([c.sum(dtype=torch.int64) for c in bits.reshape(-1).split(1 << 16)]).sum()
    return time.perf_counter() - start


def round_of_steps(cfg: GPTConfig, steps: int, path: str) -> tuple[float, float, float, int]:
    """Median step, median fingerprint time a step, median bit-sum time a step (seconds),
    and the elements fingerprinted a step."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.offload("nvme", path=path))(
        model, opt)
    x = torch.randint(0, cfg.vocab, (1, cfg.context))
    step, prints, sums, numel = [], [], [], 0
    for i in range(steps + 1):               # the first step warms up
        timed = visible.fingerprint = TimedFingerprint()
        start = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - start
        visible.fingerprint = timed.real
        if i:
            step.append(took)
            prints.append(timed.seconds)
            sums.append(bit_sum_seconds(timed.rows))
            numel = sum(r.numel() for r in timed.rows)
    return statistics.median(step), statistics.median(prints), statistics.median(sums), numel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--path", default=None, help="the swap files' directory (a temporary one)")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = GPTConfig(vocab=args.vocab, width=args.width, heads=args.width // 64,
                    ffn=4 * args.width, layers=args.layers, context=64)
    print(f"{sum(q.numel() for q in GPT(cfg).parameters()) / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} thread(s)")
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.path) as path:
            step, prints, sums, numel = round_of_steps(cfg, args.steps, path)
        print(f"round {r}: step {step * 1e3:.0f} ms; fingerprints {prints * 1e3:.1f} ms "
              f"({100 * prints / step:.1f}% of the step, {numel / 1e6:.1f}M elements); "
              f"the bit sum over the same rows {sums * 1e3:.1f} ms "
              f"(fingerprint / bit sum {prints / sums:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
