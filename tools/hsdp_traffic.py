"""Traffic per rank and step of each ZeRO stage on a nanoGPT, 1-D over four gloo ranks against
HSDP on a 2 x 2 (replicate, shard) mesh: what ``zf.comm_stats`` counts (full buffers) per
mesh dimension, and what each rank sends on the wire by the ring formulas of
docs/design.md (reduce-scatter and all-gather (n-1)/n of the buffer, all-reduce 2(n-1)/n).

    python3 tools/hsdp_traffic.py [--layers 4] [--width 256]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig

WORLD = 4
STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}


def wire_bytes(stats: dict, shard: int, replicate: int) -> float:
    """Bytes one rank sends in the step, by the ring formulas."""
    out = (stats.get("reduce_scatter_bytes", 0) + stats.get("all_gather_bytes", 0)) \
        * (shard - 1) / shard
    return out + stats.get("replicate.all_reduce_bytes", 0) * 2 * (replicate - 1) / replicate


def one_step(cfg: GPTConfig, stage: int, group, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zf.compose(*(getattr(zf, n)() for n in STAGES[stage][:-1]),
                            getattr(zf, STAGES[stage][-1])(group=group))(model, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (2, cfg.context), generator=g)
    for _ in range(2):      # the second step is the steady one
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return zf.comm_stats(model)


def worker(rank: int, init: str, cfg: GPTConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if rank == 0:
        print(f"nanoGPT {cfg.params() / 1e6:.2f}M params, fp32, {WORLD} ranks; MiB per rank "
              "and step")
        print("stage layout  reduce_scatter all_gather replicate.all_reduce  wire(sent)")
    for stage in STAGES:
        for name, group, (shard, replicate) in (("1-D x4", None, (WORLD, 1)),
                                                ("2 x 2", mesh, (2, 2))):
            stats = one_step(cfg, stage, group, rank)
            if rank == 0:
                mb = lambda k: stats.get(k, 0) / 2 ** 20   # noqa: E731
                print(f"ZeRO-{stage} {name:7s} {mb('reduce_scatter_bytes'):14.2f} "
                      f"{mb('all_gather_bytes'):10.2f} {mb('replicate.all_reduce_bytes'):20.2f} "
                      f"{wire_bytes(stats, shard, replicate) / 2 ** 20:11.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    cfg = GPTConfig(layers=args.layers, width=args.width, ffn=4 * args.width)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=("file://" + os.path.join(tmp, "store"), cfg), nprocs=WORLD)


if __name__ == "__main__":
    main()
