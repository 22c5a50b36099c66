"""The models tools/plan_accuracy.py measures the planner on: the grid's two GPT shapes
(zerofn.nanogpt, the family the probe's calibration model is from) and three families
outside it, which nothing in the planner was fitted on:

- ``lora``: a LoRA fine-tune of a Llama (transformers' ``LlamaForCausalLM``: RMSNorm,
  SwiGLU, rotary embeddings with their buffer, grouped-query attention, an untied head),
  every base weight frozen, rank-8 adapters on every projection: the units are mostly
  frozen and the root unit wholly so;
- ``tied``: a GPT-2 (transformers' ``GPT2LMHeadModel``: its embedding and head tied,
  dropout, a fused-QKV ``Conv1D``), every parameter trained;
- ``conv``: a residual convolutional classifier with batch norm (its running statistics
  are buffers) over 64 x 64 images, where activations outweigh the parameters.

Each model is called as ``model(*inputs)`` and returns its loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Family:
    """How to build a model (under the caller's default device) and one rank's inputs of
    ``rows`` samples: random from ``generator``, or zeros of the same shapes for the plan
    where it is None."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator | None], tuple]


def _tokens(vocab: int, context: int, targets: bool = True):
    """Token inputs: ``(tokens, targets)`` (the next tokens), or the tokens alone."""
    def inputs(rows: int, generator: torch.Generator | None) -> tuple:
        if generator is None:
            x = torch.zeros(rows, context + 1, dtype=torch.long)
        else:
            x = torch.randint(vocab, (rows, context + 1), generator=generator)
        return (x[:, :-1], x[:, 1:]) if targets else (x[:, :-1],)
    return inputs


def _gpt(**cfg) -> Family:
    from zerofn.nanogpt import GPT, GPTConfig
    return Family(lambda: GPT(GPTConfig(**cfg)), _tokens(cfg["vocab"], cfg["context"]))


class CausalLM(nn.Module):
    """A transformers causal LM called with its tokens, to the loss (its own: it predicts
    each token from those before)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config       # (what the plan reads the width and depth from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x, labels=x).loss


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B @ A`` (LoRA; ``B``
    starts at zero, so the model starts as the base)."""

    def __init__(self, base: nn.Linear, rank: int = 8):
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: nn.Module, names: tuple[str, ...], rank: int = 8) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each linear layer whose attribute name
    is in ``names`` in a ``LoRALinear``; the model, changed in place."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in names and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank))
    return model


def _llama_lora() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return add_lora(CausalLM(LlamaForCausalLM(cfg)),
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=8192, n_positions=64, n_embd=512, n_layer=8, n_head=8,
                     bos_token_id=0, eos_token_id=0)
    return CausalLM(GPT2LMHeadModel(cfg))


class Residual(nn.Module):
    """Two 3 x 3 convolutions with batch norm and a shortcut (a strided 1 x 1 where the
    block changes width or resolution)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential() if (cin, stride) == (cout, 1) else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ConvNet(nn.Module):
    """A ResNet-18-like classifier: a stem, residual blocks in a ModuleList (zerofn's
    units), global pooling and a linear head, to the cross-entropy loss."""

    def __init__(self, classes: int = 100, widths=(64, 128, 256, 512)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [Residual(cin, w, 1 if i == 0 else 2), Residual(w, w, 1)]
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


def _images(rows: int, generator: torch.Generator | None) -> tuple:
    if generator is None:
        return torch.zeros(rows, 3, 64, 64), torch.zeros(rows, dtype=torch.long)
    return (torch.randn(rows, 3, 64, 64, generator=generator),
            torch.randint(100, (rows,), generator=generator))


FAMILIES = {
    # many narrow units, and a few wide ones (the grid: the two shapes, scaled
    # to this machine)
    "narrow": _gpt(vocab=4096, width=256, heads=4, ffn=1024, layers=16, context=64),
    "wide": _gpt(vocab=4096, width=1024, heads=16, ffn=4096, layers=4, context=64),
    # outside the grid
    "lora": Family(_llama_lora, _tokens(8192, 64, targets=False)),
    "tied": Family(_gpt2, _tokens(8192, 64, targets=False)),
    "conv": Family(ConvNet, _images),
}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer is built over (a LoRA fine-tune's adapters)."""
    return [p for p in model.parameters() if p.requires_grad]
