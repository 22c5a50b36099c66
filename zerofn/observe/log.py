"""``zf.log``, ``zf.flush_logs`` and ``zf.set_log_step``: what a training loop tells the
TensorBoard monitor (tensorboard.py), or nothing where the plan has none."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime import runtime_of
from .tensorboard import BUILT_IN, Monitor


def log(model: nn.Module, **values) -> None:
    """Record values for TensorBoard (``train/<name>``), read only on logging steps.

    Tensors are kept as they are (no device synchronization) and read at the next logging
    step of ``zf.tensorboard``; without one, values are checked and dropped. Several values
    of one name in one step are averaged. ``tokens`` and ``samples`` are counts, summed:
    they give ``train/tokens_per_s`` and ``train/samples``.

    Args:
        model: a model transformed by zerofn.
        **values: numbers or one-element tensors.

    Example:
        >>> loss = model(x, y); zf.scale_loss(model, loss).backward(); opt.step()
        >>> zf.log(model, loss=loss.detach(), tokens=x.numel(), samples=len(x))
    """
    monitor = runtime_of(model).observer(Monitor)
    for name, value in values.items():
        if name in BUILT_IN:
            raise ValueError(f"zf.log(): {name!r} is a series zf.tensorboard writes itself "
                             f"(train/{name}); log your value under another name.")
        if torch.is_tensor(value) and value.numel() != 1 or \
                not torch.is_tensor(value) and not isinstance(value, (int, float)):
            raise TypeError(f"zf.log(): {name}= must be a number or a one-element tensor, "
                            f"got {_describe(value)}.")
    if monitor is not None:
        monitor.log(values)


def flush_logs(model: nn.Module) -> None:
    """Write what is outstanding and flush the files: values logged since the last logging
    step, and the series of the steps since then (without ``time/step_max`` and
    ``step_min``, which need every rank: no collective here). Also runs at exit.

    Example:
        >>> for step in range(steps): ...
        >>> zf.flush_logs(model)
    """
    monitor = runtime_of(model).observer(Monitor)
    if monitor is not None:
        monitor.flush()


def set_log_step(model: nn.Module, step: int) -> None:
    """Number the logs' steps from ``step``: a run resumed from a checkpoint saved after
    optimizer step ``step`` continues the interrupted run's series (TensorBoard would drop
    a series' points from a step that comes again). Call before the first step; nothing
    happens without ``zf.tensorboard``.

    Example:
        >>> start = (zf.load_checkpoint("ckpt", model, opt) or {"step": 0})["step"]
        >>> zf.set_log_step(model, start)
    """
    monitor = runtime_of(model).observer(Monitor)
    if monitor is not None:
        if monitor.step:
            raise ValueError(f"zf.set_log_step(): {monitor.step} steps were logged already; "
                             f"call it before the first optimizer step.")
        monitor.step = monitor._written = int(step)


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
