"""An optimizer container built as torchtitan builds its optimizers after parallelizing
the model: one optimizer per model part over its trainable parameters, the container an
``Optimizer`` itself over all of them (so hooks registered on it fire), whose ``step`` and
``zero_grad`` call each part's; and its LR schedulers, a warm-up then a linear decay each."""
from __future__ import annotations

import torch


class PartsOptimizer(torch.optim.Optimizer):
    """One ``torch.optim.AdamW`` per part in ``parts`` (modules), held as ``optimizers``."""

    def __init__(self, parts, **kwargs):
        self.optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad],
                                             **kwargs) for m in parts]
        every = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, every, {})

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def schedulers(container: PartsOptimizer, warmup: int, steps: int) -> list:
    """A warm-up of ``warmup`` steps, then a linear decay to 0 at ``steps``, per part."""
    def factor(s):
        return (s + 1) / (warmup + 1) if s < warmup else max(0.0, (steps - s) / (steps - warmup))
    return [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in container.optimizers]
