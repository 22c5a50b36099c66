"""The ZeRO stages as transforms, and the training loops the tests compare: plain PyTorch on
each global batch, and a rank's share of it under zerofn (or FSDP2)."""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

import zerofn as zf

from .models import batches, make_models, make_optimizer

STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}


def zero(stage: int, **options) -> zf.Transform:
    """ZeRO-``stage`` as one transform; ``options`` go to its last transform (the options
    of a composition merge into one plan, so the shared ones may go there as well)."""
    *first, last = STAGES[stage]
    return zf.compose(*(getattr(zf, name)() for name in first), getattr(zf, last)(**options))


def build_parity(stage: int, kind: str = "adamw", *extra, seed: int = 0,
                 checkpoint: bool = False, frozen: bool = True, **options):
    """The parity model (the second of ``make_models(seed)``) and its ``kind`` optimizer
    under ``zero(stage, **options)`` composed with the ``extra`` transforms."""
    _, model = make_models(seed=seed, checkpoint=checkpoint, frozen=frozen)
    opt = make_optimizer(kind, model.parameters())
    return zf.compose(zero(stage, **options), *extra)(model, opt)


def train_reference(ref, opt, data, clip=None):
    """Plain single-process PyTorch: each global batch of ``data`` (a list of micro-batches)
    in one forward. Called on every rank of a process group, rank 0 trains and the others
    take its parameters, buffers, optimizer state and random state: the same result as
    each training it, for 1/world of the work (the reference is the global batch, so on
    every rank it was most of a multi-rank test's compute)."""
    shared = dist.is_initialized() and dist.get_world_size() > 1
    if not shared or dist.get_rank() == 0:
        _train_whole(ref, opt, data, clip)
    if shared:
        _take_rank_0s(ref, opt)


def _take_rank_0s(ref, opt) -> None:
    for t in itertools.chain(ref.parameters(), ref.buffers()):
        dist.broadcast(t.data, src=0)
    box = [opt.state_dict(), torch.get_rng_state()]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank():
        opt.load_state_dict(box[0])
        torch.set_rng_state(box[1])


def _train_whole(ref, opt, data, clip):
    for micro in data:
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        ref(x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()


def train_sharded(model, opt, data, rank, world, clip=None, *, scale=False, no_sync=False,
                  inf_on=None, zero_grad="opt") -> list[torch.Tensor]:
    """This rank's rows of each global batch of ``data``, its micro-batches accumulated, as
    ``train_reference`` steps on the whole of it. Returns the norms clipping measured.

    clip: ``zf.clip_grad_norm_``'s max_norm before each step; scale: backward through
    ``opt.scale`` (mixed_precision's loss scaling); no_sync: each step's micro-batches but
    the last under ``model.no_sync()``; inf_on: (step, rank) whose loss is multiplied by
    inf; zero_grad: what clears the gradients after each step, "opt", "model" (which must
    clear the reduced gradient shards as opt.zero_grad() does) or None (they stay, to be
    measured).
    """
    norms = []
    for step, micro in enumerate(data):
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with model.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)
                if inf_on == (step, rank):
                    loss = loss * float("inf")
                (zf.scale_loss(model, loss) if scale else loss).backward()
        if clip:
            norms.append(zf.clip_grad_norm_(model, clip))
        opt.step()
        if zero_grad:
            (model if zero_grad == "model" else opt).zero_grad()
    return norms


def step_once(model, opt, rank, world) -> None:
    """One step on this rank's rows of the first parity batch; its gradients stay."""
    train_sharded(model, opt, batches(1, 1, world), rank, world, zero_grad=None)
