"""DeepSpeed's warm-up learning-rate schedules, with its exact formulas and call pattern.

Like DeepSpeed's, these are plain objects (not ``torch.optim.lr_scheduler.LRScheduler``):
``step()`` once per optimizer step, ``get_lr()`` / ``get_last_lr()``, and a state dict
holding only ``last_batch_iteration``. Constructing one sets every param group's ``lr`` to
the value at iteration -1: ``warmup_min_lr`` for WarmupLR and WarmupDecayLR, 0 for
WarmupCosineLR, as DeepSpeed does, so the first optimizer step runs at that rate.

With ``n = last_batch_iteration`` and ``W = max(2, warmup_num_steps)``, the warm-up factor
is ``log(n + 1) / log(W)`` ("log", the default) or ``n / W`` ("linear") while ``n < W``:

- WarmupLR: ``min_lr + (max_lr - min_lr) * factor``, then ``max_lr``.
- WarmupDecayLR: the same warm-up, then ``max_lr`` scaled by
  ``max(0, (T - n) / max(1, T - W))`` towards ``min_lr`` (``T = total_num_steps``).
- WarmupCosineLR: ``lr * ratio`` with ``ratio = min_ratio + (1 - min_ratio) * factor``
  during warm-up, then ``max(0, cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2)`` with
  ``p = min(1, (n - W + 1) / max(1, T - W))``.
"""
from __future__ import annotations

import logging
import math

import torch

LOG, LINEAR = "log", "linear"
_log = logging.getLogger(__name__)


def _per_group(optimizer, value, name: str) -> list:
    """A scalar for every param group, or a per-group list checked for length."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: got {len(value)} values for "
                             f"{len(optimizer.param_groups)} param groups.")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _set_lrs(optimizer, lrs: list) -> list:
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _check_warmup(warmup_num_steps, warmup_type: str) -> str:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) \
            or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}.")
    if warmup_type not in (LOG, LINEAR):
        _log.warning("warmup_type %r is neither 'log' nor 'linear'; using 'log' as DeepSpeed "
                     "does.", warmup_type)
        return LOG
    return warmup_type


class _Warmup:
    """Shared by the three: iteration counting, the warm-up factor, the state dict."""

    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int):
        self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration

    def _start(self) -> None:
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def _warmup_factor(self) -> float:
        n = self.last_batch_iteration
        if self.warmup_type == LOG:
            return self.inverse_log_warm_up * math.log(n + 1)
        return n / self.warmup_num_steps

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Warmup):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr), then hold.

    Example:
        >>> sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=100)
        >>> opt.step(); sched.step()
    """

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_factor()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warm-up, then a linear decay to ``warmup_min_lr`` at ``total_num_steps``.

    DeepSpeed's default ``warmup_max_lr`` here is 0.001, not the group's lr.
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0,
                 warmup_max_lr=0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = LOG, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s",
                         total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_factor()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Warmup):
    """Scale each group's lr by a ratio warming up from ``warmup_min_ratio`` to 1, then
    following a cosine down to ``cos_min_ratio`` at ``total_num_steps`` (and staying there).
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = LOG, last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        if total_num_steps < self.warmup_num_steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s",
                         total_num_steps, warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"]
                        for g in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        n = self.last_batch_iteration
        if n < 0:
            return 0.0
        if n < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_factor() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (n - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR}
