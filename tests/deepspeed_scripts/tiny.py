"""The model and data every DeepSpeed-style script here trains: small, plain, seeded.

Both sides of a comparison (real DeepSpeed and ``zerofn.deepspeed``) build them from the
same seeds, so they start from the same weights and see the same samples.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn

WIDTH = 32


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))


class TinyNet(nn.Module):
    """A residual MLP. ``config.hidden_size`` is there for the "auto" keys that Hugging
    Face's integration derives from a model's config."""

    def __init__(self, inputs: int = 12, width: int = WIDTH, outputs: int = 5, layers: int = 2):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=width)
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def make_dataset(samples: int = 256, seed: int = 1) -> torch.utils.data.TensorDataset:
    """Inputs and regression targets from a fixed random teacher, seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 12, generator=g)
    teacher = torch.randn(12, 5, generator=g)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(samples, 5, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def script_arguments(parser):
    """The scripts' own flags (DeepSpeed's are added by ``deepspeed.add_config_arguments``)."""
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps to train")
    parser.add_argument("--losses", type=str, default=None,
                        help="write every micro-step's loss to LOSSES.rank<N>.json")
    return parser


def write_record(prefix, engine, losses) -> None:
    """This rank's losses and the engine's counters, for the reference comparison."""
    if prefix:
        with open(f"{prefix}.rank{engine.global_rank}.json", "w") as f:
            json.dump({"losses": losses, "lr": engine.get_lr(), "global_steps": engine.global_steps,
                       "global_samples": engine.global_samples}, f)
