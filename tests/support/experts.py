"""Mixtures of experts in which, on some ranks, no token chose an expert: its unit gets no
gradient there while other ranks reduce theirs ([Note: a unit's backward is done]).
``expert_runs`` trains them on ranks (tests/test_reduction.py on the CPU, tests/test_cuda.py
on a GPU)."""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from zerofn.runtime.runtime import runtime_of

from .compare import max_errors
from .loops import zero
from .offload import offload_transform


class Experts(torch.nn.Module):
    """A top-1 mixture of experts with the expert given per sample (hash routing) and a
    learned gate; like Mixtral's loop it runs only the experts some sample chose, so on a
    rank whose samples chose none, an expert gets no gradient."""

    def __init__(self, n: int = 2):
        super().__init__()
        self.router = torch.nn.Linear(8, n, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x, choice):
        gate = self.router(x).softmax(-1).gather(1, choice[:, None])
        out = x
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, gate[rows] * torch.tanh(expert(x[rows])))
        return out


class ExpertNet(torch.nn.Module):
    """Three mixtures between an input and an output projection; ``checkpoint`` None, or
    "reentrant" / "non-reentrant" activation checkpointing of each mixture."""

    def __init__(self, checkpoint: str | None = None):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(Experts() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)
        self.checkpoint = checkpoint

    def forward(self, x, choices):
        x = self.inp(x)
        for block, choice in zip(self.blocks, choices.unbind(1)):
            x = block(x, choice) if self.checkpoint is None else torch.utils.checkpoint.checkpoint(
                block, x, choice, use_reentrant=self.checkpoint == "reentrant")
        return self.head(x).pow(2).mean()


# name -> (stage, offload options, checkpointing (ExpertNet's), micro-batches, how a rank's
# micro-batch runs: one forward; after a forward with gradients whose output is dropped
# (an evaluation without no_grad); as two forwards, each on half, and one backward; or
# under no_sync but the last, each micro-batch's experts sitting out on another rank).
EXPERT_CONFIGS = {"zero3": (3, {}, None, 1, "one"), "zero2": (2, {}, None, 1, "one"),
                  "zero3+checkpoint": (3, {}, "non-reentrant", 1, "one"),
                  "zero3+reentrant checkpoint": (3, {}, "reentrant", 1, "one"),
                  "zero3+accumulation": (3, {}, None, 2, "one"),
                  "zero3+offload(params)": (3, {"params": True}, None, 1, "one"),
                  "zero3+nvme(params)": (3, {"nvme": True, "params": True}, None, 1, "one"),
                  "zero3+dropped forward": (3, {}, None, 1, "dropped"),
                  "zero3+two forwards": (3, {}, None, 1, "halves"),
                  "zero3+no_sync": (3, {}, None, 2, "no_sync"),
                  "zero3+hsdp 2x2": (3, {}, None, 1, "one")}
HSDP = {"zero3+hsdp 2x2": (2, 2)}    # (replicas, shards): over a mesh, at world 4


def expert_choices(step: int, world: int) -> torch.Tensor:
    """(2 * world, blocks) experts: each rank's two samples choose both experts, except
    that in each step and block one rank's choose expert 0 only, a different rank for
    each block: expert 1 sits out there, with its unit complete on the other ranks."""
    choices = torch.tensor([0, 1]).repeat(world)[:, None].repeat(1, 3)
    for b in range(3):
        r = (step + b) % world
        choices[2 * r:2 * r + 2, b] = 0
    return choices


def expert_runs(rank, world, names, device="cpu", path=None):
    """Plain PyTorch on the global batch against each configuration on this rank's share,
    both on ``device`` (tests/test_cuda.py runs them on a GPU); NVMe swap files in
    ``path``."""
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for name in names:
        stage, offload, checkpoint, accum, how = EXPERT_CONFIGS[name]
        torch.manual_seed(0)
        ref, model = ExpertNet(checkpoint).to(device), ExpertNet(checkpoint).to(device)
        model.load_state_dict(ref.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mesh = None if name not in HSDP else init_device_mesh(
            device, HSDP[name], mesh_dim_names=("replicate", "shard"))
        edits = [zero(stage, group=mesh)]
        if offload:
            edits.append(offload_transform(dict(offload, path=path)))
        model, opt = zf.compose(*edits)(model, opt)
        reducer = runtime_of(model).reducer
        g = torch.Generator().manual_seed(1)
        sat_out = 0      # parameters without a gradient on this rank, over the steps
        for step in range(4):
            micro = [(torch.randn(2 * world, 8, generator=g).to(device),
                      expert_choices(step + i * (how == "no_sync"), world).to(device))
                     for i in range(accum)]
            sum(ref(x, c) for x, c in micro).div(accum).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            for i, (x, c) in enumerate(micro):
                x, c = x.chunk(world)[rank], c.chunk(world)[rank]
                if how == "dropped":
                    model(x, c)
                syncs = how != "no_sync" or i == accum - 1
                with contextlib.nullcontext() if syncs else model.no_sync():
                    if how == "halves":
                        loss = sum(model(*half) for half in zip(x.chunk(2), c.chunk(2))) / 2
                    else:
                        loss = model(x, c)
                    loss.div(accum).backward()
            sat_out += sum(s not in reducer.got for u in reducer.ctx.units for s in u.trainable)
            opt.step()
            opt.zero_grad()
        out[name] = (*max_errors(ref, ref_opt, model, opt), sat_out)
    return out
