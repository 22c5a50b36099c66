"""What reading a DeepSpeed config returns: ``DeepSpeedSettings``, its two factories, and
the warning category for keys zerofn does not act on."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ... import api as zt


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed config key zerofn does not act on: ignored, unknown, or not wired yet."""


@dataclass(frozen=True)
class OptimizerFactory:
    """``factory(params)`` builds ``cls(params, **kwargs)``."""
    cls: type
    kwargs: dict

    def __call__(self, params) -> torch.optim.Optimizer:
        with _refused_as("optimizer", self.cls, self.kwargs):
            return self.cls(params, **self.kwargs)


@dataclass(frozen=True)
class SchedulerFactory:
    """``factory(optimizer)`` builds ``cls(optimizer, **kwargs)``."""
    cls: type
    kwargs: dict

    def __call__(self, optimizer):
        with _refused_as("scheduler", self.cls, self.kwargs):
            return self.cls(optimizer, **self.kwargs)


@contextlib.contextmanager
def _refused_as(section: str, cls: type, kwargs: dict):
    """What torch's constructor refuses (a missing parameter, a value of the wrong type or
    range: TypeError or ValueError naming no key) as the config's error, naming the section."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise ValueError(f"DeepSpeed config: {section}.params {kwargs} do not make a "
                         f"{cls.__name__}: {e}. Fix {section}.params.") from e


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config asks of a training loop, in zerofn's terms.

    Fields:
        transform: the zerofn transform: ``model, opt = settings.transform(model, opt)``.
        transforms: the same as ``{transform name: its options}``, for reading.
        stage: ZeRO stage as written (0 runs as ZeRO-1: same training, less memory).
        param_dtype: compute dtype (torch.float16 / torch.bfloat16) or None for fp32.
        train_batch_size, micro_batch_size, gradient_accumulation_steps: DeepSpeed's
            batch triple, resolved (``train = micro * accumulation * world_size``).
        gradient_clipping: max global gradient norm; 0.0 means no clipping.
        optimizer: ``OptimizerFactory`` from the "optimizer" section, or None.
        scheduler: ``SchedulerFactory`` from the "scheduler" section, or None.
        fp16_auto_cast: cast floating inputs to fp16 in forward ("fp16.auto_cast").
        activation_checkpointing: the section with DeepSpeed's defaults filled in.
        steps_per_print: print progress every this many optimizer steps (None: never).
        dataloader_drop_last: drop the last incomplete micro-batch.
        monitoring: the parsed monitoring sections (tensorboard, csv_monitor, wandb,
            comet, comms_logger, flops_profiler, wall_clock_breakdown, memory_breakdown);
            tensorboard and csv_monitor become ``zf.tensorboard`` in ``transform``.
        ignored: "key: reason" for each key zerofn does not act on (also warned).
        config: the config with every "auto" resolved.
        world_size: the data-parallel world size the batch sizes were resolved for.
    """
    transform: zt.Transform
    transforms: dict
    stage: int
    param_dtype: torch.dtype | None
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    optimizer: OptimizerFactory | None
    scheduler: SchedulerFactory | None
    fp16_auto_cast: bool
    activation_checkpointing: dict
    steps_per_print: int | None
    dataloader_drop_last: bool
    monitoring: dict = field(default_factory=dict)
    ignored: tuple = ()
    config: dict = field(default_factory=dict)
    world_size: int = 1
