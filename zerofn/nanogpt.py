"""A small GPT used by the main training job, the benchmarks, the tutorials and the tests.

Plain PyTorch, nothing zerofn-specific: blocks sit in an ``nn.ModuleList`` (zerofn's
default unit policy makes each block a unit), the output head is tied to the token
embedding, and attention is ``scaled_dot_product_attention``. ``init_weights`` is the
initialization, usable as zerofn's ``init=`` for a GPT built on the meta device.
``PRESETS`` are the named shapes ``zerofn train --model`` trains and ``zerofn estimate
--model`` sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab: int = 256
    width: int = 256
    heads: int = 4
    ffn: int = 1024
    layers: int = 4
    context: int = 128
    checkpoint: bool = False   # non-reentrant activation checkpointing per block

    def params(self) -> int:
        block = 4 * self.width * self.width + 2 * self.width * self.ffn + self.ffn \
            + 5 * self.width
        return self.vocab * self.width + self.context * self.width + self.layers * block \
            + 2 * self.width


# Byte-level GPTs (vocabulary 256); the larger ones are sized to their names.
PRESETS = {
    "tiny": GPTConfig(vocab=256, width=64, heads=2, ffn=256, layers=2, context=64),
    "small": GPTConfig(vocab=256, width=192, heads=4, ffn=768, layers=4, context=128),
    "125m": GPTConfig(vocab=256, width=768, heads=12, ffn=3072, layers=18, context=512),
    "350m": GPTConfig(vocab=256, width=1024, heads=16, ffn=4096, layers=28, context=512),
    "1b": GPTConfig(vocab=256, width=2048, heads=16, ffn=8192, layers=20, context=512),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        # No bias on the qkv projection: a key bias has zero true gradient (softmax is
        # shift-invariant), which turns exact parity comparisons into noise.
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # The heads this rank holds: all of them, or under tensor parallelism (zerofn train
        # --tp) its share, whose q, k and v rows the split projection gives it in turn.
        q, k, v = self.qkv(x).view(b, t, 3, -1, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, cfg.ffn)
        self.out = nn.Linear(cfg.ffn, cfg.width)
        self.checkpoint = cfg.checkpoint

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(m: nn.Module) -> None:
    """GPT-2's scheme (normal, std 0.02; norms to one and zero), one module at a time, as
    ``model.apply`` and zerofn's meta-device ``init=`` call it."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.normal_(m.bias, std=0.02)
    if isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
