"""Peak host memory of offload("cpu")'s low-precision state, per combination of stored dtypes.

    python tools/lowp_memory.py                 # the five combinations, ~110M-param GPT
    python tools/lowp_memory.py --layers 2      # a smaller model (quicker)

For each combination of ``master_dtype`` and ``state_dtype`` (fp32/fp32, bf16 moments,
int8 moments, bf16 masters + bf16 moments, bf16 masters + int8 moments) a fresh process
builds a zerofn.nanogpt GPT (width 768, 12 heads, FFN 3072, vocabulary 50304, 10 blocks:
109.5M parameters) in fp32, wraps it in ZeRO-2 + mixed_precision(bf16) + offload("cpu",
state_dtype=..., master_dtype=...) on one rank (gloo, CPU device), trains 2 steps of one
sequence of 64 tokens (so activations stay small) and reports:

  peak RSS         VmHWM from /proc/self/status at the end (the process's high-water mark:
                   it includes building the fp32 model, and torch's own libraries)
  before model     VmRSS once torch is imported and the process group is up, before the
                   model exists: what the peak holds that is not the model's
  RSS after        VmRSS after the 2 steps
  (peak - before)  the peak less what the process held before the model, per parameter
  host B/param     zf.model_state_bytes' "host" place, all roles, per parameter
  estimate         zerofn.core.estimate.estimate_placement's host bytes per parameter
  device B/param   zf.model_state_bytes' device place ("cpu" here) per parameter: on a CPU
                   device that is host memory too (the bf16 compute params, the gradient
                   shard, the pool's buffers), so RSS holds it as well

Each combination runs in its own process: the high-water mark and glibc's kept heap of
one would otherwise hide the next's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

# (label of masters, of moments, offload's master_dtype, state_dtype)
COMBINATIONS = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"), ("bf16", "bf16"),
                ("bf16", "int8")]
DTYPE = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=64, help="tokens of the one sequence a step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)   # "masters:moments", internal
    return p.parse_args(argv)


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zerofn as zf
    from zerofn.core.estimate import estimate_placement
    from zerofn.nanogpt import GPT, GPTConfig
    masters, moments = args.worker.split(":")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    before = status_bytes("VmRSS")
    cfg = GPTConfig(vocab=args.vocab, width=args.width, heads=args.width // 64,
                    ffn=4 * args.width, layers=args.layers, context=args.tokens)
    torch.manual_seed(0)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    master_dtype, state_dtype = (getattr(torch, DTYPE[v]) for v in (masters, moments))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                            zf.mixed_precision(torch.bfloat16),
                            zf.offload("cpu", state_dtype=state_dtype,
                                       master_dtype=master_dtype))(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(cfg.vocab, (1, args.tokens + 1), generator=g)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    measured = zf.model_state_bytes(model)
    with torch.device("meta"):     # the model's shape, for the largest unit (the host ring)
        shape = GPT(cfg)
    placed = estimate_placement(shape, 1, 2, torch.bfloat16, offload="cpu",
                                master_dtype=master_dtype, state_dtype=state_dtype)
    print("RESULT " + json.dumps(dict(
        masters=masters, moments=moments, params=n, before=before, peak=status_bytes("VmHWM"),
        after=status_bytes("VmRSS"), host=sum(measured.get("host", {}).values()),
        device=sum(sum(roles.values()) for where, roles in measured.items()
                   if where not in ("host", "nvme")), estimate=placed["host"]["total"],
        losses=losses)), flush=True)
    dist.destroy_process_group()


def launch(masters: str, moments: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{masters}:{moments}",
           "--width", str(args.width), "--layers", str(args.layers), "--vocab",
           str(args.vocab), "--tokens", str(args.tokens), "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{masters}/{moments} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(results: list[dict]) -> str:
    gb = 2**30
    out = ["| masters | moments | peak RSS GiB | before model GiB | RSS after GiB | "
           "(peak − before) B/param | "
           "host B/param (model_state_bytes) | host B/param (estimate) | "
           "device B/param (model_state_bytes, host memory here) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n = r["params"]
        out.append(f"| {r['masters']} | {r['moments']} | {r['peak'] / gb:.2f} | "
                   f"{r['before'] / gb:.2f} | {r['after'] / gb:.2f} | "
                   f"{(r['peak'] - r['before']) / n:.1f} | {r['host'] / n:.2f} | "
                   f"{r['estimate'] / n:.2f} | {r['device'] / n:.2f} |")
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    results = []
    for masters, moments in COMBINATIONS:
        results.append(launch(masters, moments, args))
        print(f"# {masters}/{moments}: done", file=sys.stderr, flush=True)
    r = results[0]
    print(f"GPT {args.width}x{args.layers}, vocabulary {args.vocab}: {r['params'] / 1e6:.1f}M "
          f"parameters; 1 rank (gloo, CPU device), ZeRO-2 + mixed_precision(bf16) + "
          f"offload('cpu', state_dtype=..., master_dtype=...); {args.steps} steps of 1x"
          f"{args.tokens} tokens; each combination in its own process\n")
    print(table(results))


if __name__ == "__main__":
    main()
