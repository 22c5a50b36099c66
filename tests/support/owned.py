"""Whole-tensor optimizers as a Muon user builds them, the loops that step several
optimizers, and Newton-Schulz counted (or run in fp32, where a test holds a fine tolerance)."""
from __future__ import annotations

import contextlib

import torch
import torch.optim._muon as muon_impl

import zerofn as zf

MUON_LR, ADAMW_LR = 0.02, 1e-3


def muon_and_adamw(model) -> tuple:
    """torch.optim.Muon over the blocks' matrices, AdamW over the rest (what needs a
    gradient), as torch's Muon documentation pairs them."""
    blocks = [p for n, p in model.named_parameters()
              if p.requires_grad and ".blocks." in f".{n}" and p.ndim == 2]
    taken = {id(p) for p in blocks}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return (torch.optim.Muon(blocks, lr=MUON_LR, weight_decay=0.1, momentum=0.95),
            torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1))


def adafactor(model) -> tuple:
    """torch.optim.Adafactor over every trainable parameter (its 2-D ones factored)."""
    return (torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad],
                                  lr=1e-2),)


class NormalizedSGD(torch.optim.Optimizer):
    """SGD on each tensor's gradient divided by its norm: an optimizer torch does not know
    reads a whole tensor, which the user marks with ``zf.whole_tensors``."""

    def __init__(self, params, lr: float = 1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


def normalized(model) -> tuple:
    return (zf.whole_tensors(NormalizedSGD([p for p in model.parameters() if p.requires_grad])),)


OPTIMIZERS = {"muon": muon_and_adamw, "adafactor": adafactor, "normalized": normalized}


def step_all(opts, zero_grad: bool = True) -> None:
    for o in opts:
        o.step()
    if zero_grad:
        for o in opts:
            o.zero_grad()


def train_reference(ref, opts, data) -> None:
    """Plain single-process PyTorch on each whole global batch."""
    for micro in data:
        for x, y in micro:
            (ref(x, y) / len(micro)).backward()
        step_all(opts)


def train_sharded(model, opts, data, rank, world, clip=None) -> None:
    """This rank's rows of each global batch, micro-batches accumulated; every optimizer
    stepped, as plain PyTorch steps them."""
    for micro in data:
        for x, y in micro:
            (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
        if clip:
            zf.clip_grad_norm_(model, clip)
        step_all(opts)


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Newton-Schulz iteration, in fp32 instead of bf16: the reduction order's
    rounding then stays near fp32's, and a fine tolerance can tell a right step from a
    wrong one."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def counted_newton_schulz(fp32: bool = False):
    """Yields a list that each call of Muon's Newton-Schulz appends its input's shape to
    (``fp32``: the iteration in fp32)."""
    original = muon_impl._zeropower_via_newtonschulz
    inner = newton_schulz_fp32 if fp32 else original
    calls: list = []

    def counted(grad, *args):
        calls.append(tuple(grad.shape))
        return inner(grad, *args)

    muon_impl._zeropower_via_newtonschulz = counted
    try:
        yield calls
    finally:
        muon_impl._zeropower_via_newtonschulz = original
