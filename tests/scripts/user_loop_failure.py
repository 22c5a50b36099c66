"""A job's own training loop under torchrun (not ``zerofn train``): ZeRO-2 on the tests'
GPT, rank 1 raising in the model's own backward code (a module backward hook, where
zerofn has no hook of its own) in step 2, with ``zf.name_uncaught_errors()`` (argument
``named``) or without it. For tests/test_failures.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/user_loop_failure.py named
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import zerofn as zf
from support.models import batches, make_models

FAULT_STEP = 2


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["named"]:
        zf.name_uncaught_errors()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _, model = make_models()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zf.compose(zf.shard_optimizer(timeout=30), zf.shard_grads())(model, opt)
    step = 0

    def backward_hook(*_):
        if rank == 1 and step == FAULT_STEP:
            raise ValueError("injected failure in backward")

    model.blocks[0].register_full_backward_hook(backward_hook)
    for micro in batches(4, 1, world):
        step += 1
        x, y = micro[0]
        model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
