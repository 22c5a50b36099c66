"""Writes this directory's checkpoint as zerofn wrote it at commit fa23d28, before
checkpoints carried checksums and were read by the safe readers.

    PYTHONPATH=. python tests/data/zerofn_checkpoint_fa23d28/make.py

Two gloo ranks train a tiny model under ZeRO-3 for two steps and save it with an LR
scheduler, a torchdata StatefulDataLoader part way through its epoch, each rank's RNG
state and two plain extras; ``reference.pt`` holds what a load must give back (the full
model and optimizer state, and every extra). ``tests/test_checkpoint_safety.py`` loads it.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import zerofn as zf

HERE = os.path.dirname(os.path.abspath(__file__))


def build():
    """The model, optimizer, scheduler and loader the checkpoint holds (and a load needs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.register_buffer("seen", torch.zeros(2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params())(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = TensorDataset(torch.arange(8.0).view(8, 1))
    loader = StatefulDataLoader(data, batch_size=2, shuffle=True,
                                generator=torch.Generator().manual_seed(1))
    return model, opt, sched, loader


def rank_main(rank, world, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model, opt, sched, loader = build()
    torch.manual_seed(10 + rank)
    for step in range(2):
        x = torch.randn(4, 3) + rank
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    batches = iter(loader)
    next(batches)
    notes = {"tokens": [1, 2.5, "x"], "mask": torch.arange(3)}
    rng = zf.RNGState()
    cpu_rng = rng.obj.state_dict()["cpu"].clone()
    zf.save_checkpoint(os.path.join(HERE, "checkpoint"), model, opt, step=2, sched=sched,
                       loader=loader, rng=rng, epoch=3, notes=notes)
    full = zf.get_state_dict(model, opt, full=True)
    rngs = [None] * world
    dist.all_gather_object(rngs, cpu_rng)
    if rank == 0:
        torch.save({"model": full[0], "optim": full[1], "sched": sched.state_dict(),
                    "loader": loader.state_dict(), "rng_cpu": rngs, "epoch": 3,
                    "notes": notes, "step": 2}, os.path.join(HERE, "reference.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(2, f"file://{tmp}/store"), nprocs=2)
    sys.exit(0)
