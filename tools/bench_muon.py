"""torch.optim.Muon (the blocks' matrices) beside AdamW (the rest) under zerofn, on gloo ranks
of this machine, against peers measured in the same run:

- ``parity``: weights after ``--steps`` steps against single-process PyTorch on the same
  global batches, at ZeRO-1/2/3, ZeRO-3 + offload("cpu") and ZeRO-2 + offload("nvme"),
  and ZeRO-3 with ``reduce_to_owner`` (alone and + offload("cpu")),
  against DDP's own distance in the same harness over three bucket layouts (Muon's
  Newton-Schulz runs in bf16, so the reduction order shows);
- ``traffic``: ``zf.comm_stats`` per step against ZeRO's own for AdamW over every
  parameter of the same model, the difference in units of the owned matrices' bytes, and
  the largest rank's share of the Newton-Schulz work over the mean (each stage, and ZeRO-3
  with ``shard_params(reduce_to_owner=True)``, "ZeRO-3 to owner", as ``time`` too);
- ``time``: the optimizer step (Muon's and AdamW's ``step()`` together, median of the
  steps after the first two) against FSDP2 running the same optimizers on its Shard(0)
  DTensors, and against zerofn's step with AdamW alone;
- ``offload``: one rank on ``--device``, a GPT of ``--size`` (``WxL``, as bench_offload.py
  sizes them: 2048x24 is 1.31B) under ZeRO-3 + bf16 + offload("cpu"), Muon + AdamW's step
  against AdamW's alone (median of the steps after the first): the owned matrices'
  masters and momentum on the host, Newton-Schulz on the device (tools/gpu_check's
  ``muon`` part runs it on a GPU).

    python3 tools/bench_muon.py --mode parity|traffic|time [--worlds 1 2 4] [--steps 20]
    python3 tools/bench_muon.py --mode offload --device cuda --size 2048x24 --steps 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime import runtime_of

STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}
# What traffic and time compare: each stage, and ZeRO-3 with the owned gradients reduced
# to their owners (shard_params(reduce_to_owner=True): +1x where the default is +2x).
CONFIGS = [(f"ZeRO-{s}", s, {}) for s in STAGES] + \
    [("ZeRO-3 to owner", 3, {"reduce_to_owner": True})]
ROWS = 8          # global batch rows, the same at every world size


def config(args) -> GPTConfig:
    return GPTConfig(vocab=97, width=args.width, heads=3, ffn=4 * args.width,
                     layers=args.layers, context=16)


def optimizers(model, kind: str) -> tuple:
    """("muon": Muon over the blocks' matrices, AdamW over the rest; "adamw": AdamW alone)."""
    if kind == "adamw":
        return (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return (torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1))


def data(cfg: GPTConfig, steps: int, accum: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randint(0, cfg.vocab, (ROWS, cfg.context), generator=g),
              torch.randint(0, cfg.vocab, (ROWS, cfg.context), generator=g))
             for _ in range(accum)] for _ in range(steps)]


def train(model, opts, batches, rank, world, timer=None, sync=lambda: None) -> None:
    """``sync``: waits for the device's queued work, before and after a timed step."""
    for micro in batches:
        for x, y in micro:
            (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
        sync()
        start = time.perf_counter()
        for o in opts:
            o.step()
        sync()
        if timer is not None:
            timer.append(time.perf_counter() - start)
        for o in opts:
            o.zero_grad()


def transformed(cfg, kind: str, stage: int, where: str | None = None, **options):
    """``where``: "cpu" offloads to the host; any other string is the directory of an
    offload("nvme") swap file. ``options`` go to the stage's own transform."""
    torch.manual_seed(0)
    model = GPT(cfg)
    extra = () if where is None else (zf.offload("cpu"),) if where == "cpu" \
        else (zf.offload("nvme", path=where),)
    *first, last = STAGES[stage]
    return zf.compose(*(getattr(zf, n)() for n in first), getattr(zf, last)(**options),
                      *extra)(model, optimizers(model, kind))


def full_weights(model) -> dict:
    from zerofn.state.state_dict import get_model_state_dict
    return get_model_state_dict(model, full=True)


def distance(weights: dict, ref: dict) -> float:
    return max((weights[k].float() - v.float()).abs().max().item() for k, v in ref.items())


def reference(cfg, batches) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    train(model, optimizers(model, "muon"), batches, 0, 1)
    return model.state_dict()


# DDP's buckets (MiB): each layout sums the ranks' gradients in another order per element
# (gloo's ring splits each bucket in its own chunks), so DDP's distance from PyTorch is a
# range, of which zerofn's is held to the largest.
DDP_BUCKETS = (25.0, 1.0, 0.05)


def ddp_weights(cfg, batches, rank, world, bucket_mb: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(cfg), bucket_cap_mb=bucket_mb)
    train(model, optimizers(model.module, "muon"), batches, rank, world)
    return model.module.state_dict()


def parity(cfg, args, rank, world) -> list:
    rows = []
    for accum in (1, 4):
        batches = data(cfg, args.steps, accum)
        ref = reference(cfg, batches)
        ddp = [distance(ddp_weights(cfg, batches, rank, world, mb), ref) if world > 1 else 0.0
               for mb in DDP_BUCKETS]
        with tempfile.TemporaryDirectory(prefix="bench_muon_swap") as swap:
            to_owner = {"reduce_to_owner": True}
            for name, stage, where, options in (
                    ("ZeRO-1", 1, None, {}), ("ZeRO-2", 2, None, {}), ("ZeRO-3", 3, None, {}),
                    ("ZeRO-3 + cpu", 3, "cpu", {}), ("ZeRO-2 + nvme", 2, swap, {}),
                    ("ZeRO-3 to owner", 3, None, to_owner),
                    ("ZeRO-3 to own+cpu", 3, "cpu", to_owner)):
                model, opts = transformed(cfg, "muon", stage, where, **options)
                train(model, opts, batches, rank, world)
                rows.append((world, accum, name, distance(full_weights(model), ref), ddp))
    return rows


def traffic(cfg, args, rank, world) -> list:
    batches = data(cfg, 2, 1)
    torch.manual_seed(0)
    owned = sum(p.numel() * p.element_size() for n, p in GPT(cfg).named_parameters()
                if n.startswith("blocks.") and p.ndim == 2)
    rows = []
    for name, stage, options in CONFIGS:
        counted = {}
        for kind in ("adamw", "muon"):
            model, opts = transformed(cfg, kind, stage, **options)
            train(model, opts, batches, rank, world)
            stats = zf.comm_stats(model)
            counted[kind] = sum(v for k, v in stats.items() if k.endswith("_bytes"))
        load = runtime_of(model).owned_load()      # (the Muon run's: each rank's share)
        rows.append((world, name, counted["adamw"], counted["muon"], owned,
                     max(load) * len(load) / sum(load)))
    return rows


def fsdp2_step_times(cfg, batches, rank, world) -> list:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    timer: list = []
    train(model, optimizers(model, "muon"), batches, rank, world, timer)
    return timer


def step_times(cfg, args, rank, world) -> list:
    batches = data(cfg, args.steps, 1)
    rows = []
    for name, stage, options in CONFIGS:
        times = {}
        for kind in ("muon", "adamw"):
            model, opts = transformed(cfg, kind, stage, **options)
            timer: list = []
            train(model, opts, batches, rank, world, timer)
            times[kind] = statistics.median(timer[2:])
        rows.append((world, name, times["muon"], times["adamw"]))
    fsdp2 = statistics.median(fsdp2_step_times(cfg, batches, rank, world)[2:])
    return [row + (fsdp2,) for row in rows]


def offload_step_times(args) -> dict:
    """The step's median seconds, "muon" (Muon + AdamW) and "adamw" (AdamW alone), on one
    rank of ``args.device`` under ZeRO-3 + bf16 + offload("cpu"), and the model's size."""
    from bench_offload import init_world_1, model_config
    init_world_1(args.device)
    cfg = model_config(args.size, args)
    cuda = args.device == "cuda"
    out = {}
    try:
        for kind in ("adamw", "muon"):
            torch.manual_seed(0)
            with torch.device(args.device):
                model = GPT(cfg)
            out["params"] = sum(p.numel() for p in model.parameters())
            model, opts = zf.compose(*(getattr(zf, n)() for n in STAGES[3]),
                                     zf.mixed_precision(torch.bfloat16), zf.offload("cpu"))(
                model, optimizers(model, kind))
            batches = [[tuple(t.to(args.device) for t in micro) for micro in step]
                       for step in data(cfg, args.steps, 1)]
            timer: list = []
            train(model, opts, batches, 0, 1, timer,
                  sync=torch.cuda.synchronize if cuda else lambda: None)
            out[kind] = statistics.median(timer[1:])
            del model, opts
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def report_offload(args, out: dict) -> None:
    print(f"muon offload: {args.size} ({out['params'] / 1e9:.3g}B params) on {args.device}, "
          f"ZeRO-3 + bf16 + offload('cpu'): Muon + AdamW step {out['muon']:.4f} s, AdamW step "
          f"{out['adamw']:.4f} s, Muon/AdamW {out['muon'] / out['adamw']:.2f}x")


MODES = {"parity": parity, "traffic": traffic, "time": step_times}


def worker(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        rows = MODES[args.mode](config(args), args, rank, world)
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def run(world: int, args) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, world, init, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = out.get(timeout=1800)
        for p in procs:
            p.join()
    return rows


def report(mode: str, rows: list) -> None:
    if mode == "parity":
        print("world accum config          zerofn-vs-PyTorch  DDP-vs-PyTorch (orders)  "
              "zerofn/max(DDP)")
        for world, accum, name, err, ddp in rows:
            ratio = f"{err / max(ddp):.2f}" if max(ddp) else "-"
            print(f"{world:5d} {accum:5d} {name:17s} {err:17.2e}  {min(ddp):.2e}-{max(ddp):.2e}"
                  f"  {ratio}")
    elif mode == "traffic":
        print("world stage           AdamW-bytes  Muon+AdamW-bytes  extra/owned-matrix-bytes  "
              "Newton-Schulz-share max/mean")
        for world, name, adamw, muon, owned, share in rows:
            print(f"{world:5d} {name:15s} {adamw:11d} {muon:17d}  {(muon - adamw) / owned:24.2f}"
                  f"  {share:.2f}")
    else:
        print("world stage           Muon-step(s) AdamW-step(s) FSDP2-Muon-step(s)  FSDP2/zerofn  "
              "Muon/AdamW")
        for world, name, muon, adamw, fsdp2 in rows:
            print(f"{world:5d} {name:15s} {muon:12.4f} {adamw:13.4f} {fsdp2:18.4f}  "
                  f"{fsdp2 / muon:12.1f}  {muon / adamw:10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES) + ["offload"], required=True)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--layers", type=int, default=3)
    offload = parser.add_argument_group("--mode offload")
    offload.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    offload.add_argument("--size", default="64x2", help="WxL: width and layers")
    offload.add_argument("--vocab", type=int, default=97)
    offload.add_argument("--context", type=int, default=16)
    args = parser.parse_args()
    if args.mode == "offload":
        args.checkpoint = "off"     # (what bench_offload's model_config reads)
        report_offload(args, offload_step_times(args))
        return
    rows = []
    for world in args.worlds:
        rows += run(world, args)
    report(args.mode, rows)


if __name__ == "__main__":
    main()
