"""The GPT the TensorBoard and report tests train under zf.tensorboard, and reading the
event files such a run writes."""
from __future__ import annotations

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig

# Large enough that a step's phases dwarf the loop's own few lines between them.
CONFIG = GPTConfig(vocab=256, width=96, heads=4, ffn=384, layers=3, context=64)


def read(path: str) -> EventAccumulator:
    return EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0}).Reload()


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def text(acc: EventAccumulator, tag: str) -> str:
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def build(transforms, seed: int = 0):
    """The GPT of CONFIG from ``seed`` and its AdamW, under ``transforms``."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return zf.compose(*transforms)(model, opt)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, CONFIG.vocab, (4, CONFIG.context), generator=g)


def train_step(model, opt, rank: int, step: int, fp16: bool = False) -> torch.Tensor:
    """One step on this rank's own batch (its targets are its inputs), clipped at 1; the
    gradients are left for the caller to clear."""
    x = batch(rank, step)
    loss = model(x, x)
    (zf.scale_loss(model, loss) if fp16 else loss).backward()
    zf.clip_grad_norm_(model, 1.0)
    opt.step()
    return loss.detach()
