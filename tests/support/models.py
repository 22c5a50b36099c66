"""The parity model: small, uneven and awkward on purpose.

vocab 97, width 48, 3 heads, ffn 130 (none divisible by 4), a tied embedding, a frozen
parameter, a buffer, and a 3-element parameter smaller than the largest world size.
"""
from __future__ import annotations

import torch
from torch import nn

from zerofn.nanogpt import GPT, GPTConfig

CONFIG = dict(vocab=97, width=48, heads=3, ffn=130, layers=2, context=12)


class ParityGPT(GPT):
    def __init__(self, checkpoint: bool = False, frozen: bool = True, layers: int = 2):
        super().__init__(GPTConfig(**dict(CONFIG, layers=layers), checkpoint=checkpoint))
        self.gain = nn.Parameter(torch.tensor([1.0, 0.9, 1.1]))
        self.register_buffer("temperature", torch.tensor([1.25]))
        if frozen:
            self.pos.weight.requires_grad_(False)

    def forward(self, idx, targets):
        return super().forward(idx, targets) * self.gain.mean() / self.temperature


def make_models(seed: int = 0, **kw):
    """Two identical models: the reference and the one to shard."""
    torch.manual_seed(seed)
    ref = ParityGPT(**kw)
    torch.manual_seed(seed)
    return ref, ParityGPT(**kw)


def batches(steps: int, accum: int, world: int, per_rank: int = 2, seed: int = 1):
    """Global batches as lists of ``accum`` micro-batches, each ``world * per_rank`` rows."""
    g = torch.Generator().manual_seed(seed)
    v, t = CONFIG["vocab"], CONFIG["context"]
    return [[(torch.randint(0, v, (world * per_rank, t), generator=g),
              torch.randint(0, v, (world * per_rank, t), generator=g)) for _ in range(accum)]
            for _ in range(steps)]


def make_optimizer(kind: str, params, groups: bool = False, *, frozen: bool = False,
                   sgd_lr: float = 0.1):
    """``kind`` ("adamw", "adam" or "sgd") over the ``params`` that require a gradient
    (``frozen``: over all of them; torch.optim holds the others and never steps them);
    ``groups``: in two groups with different lr and weight decay.

    Adam's lr is 1e-3: Adam divides each gradient by its own magnitude, so at 1e-2 the
    rounding difference between one batch and the same batch split across ranks alone
    moves this model's params by up to 5e-5 in plain PyTorch; at 1e-3 it stays below 6e-6,
    leaving the 1e-5 parity tolerance meaningful."""
    params = [p for p in params if p.requires_grad or frozen]
    if groups:
        params = [{"params": params[::2]}, {"params": params[1::2], "lr": 3e-4, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=sgd_lr, momentum=0.9, weight_decay=0.01)
    raise ValueError(kind)

