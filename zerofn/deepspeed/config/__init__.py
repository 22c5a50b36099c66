"""A DeepSpeed config read into zerofn: ``from_deepspeed_config``.

The config (a dict or a JSON file, as DeepSpeed reads it) becomes one zerofn transform plus
what else it asks for: optimizer and scheduler factories, batch sizes, clipping. Every key
is accounted for (``docs/deepspeed.md`` has the full table): keys zerofn acts on are mapped
to the transform option nearest in meaning; keys that mean nothing to zerofn get one
``DeepSpeedConfigWarning`` listing them with the reason; unknown keys (typos, which
DeepSpeed ignores silently) get a warning naming the closest known key; contradictions
raise ``ValueError`` naming both keys. ``"auto"`` values are filled as Hugging Face's
DeepSpeed integration fills them.

One step of that reading per module: ``load`` (the file and its keys), ``auto``,
``mapping`` (sections to transform options), ``factories`` (optimizer, scheduler),
``ignored`` (what is reported), ``settings`` (what is returned).
"""
from __future__ import annotations

import torch

from .auto import hidden_size_of, resolve_auto
from .factories import optimizer_factory, scheduler_factory
from .ignored import ignored_keys, warn_about_keys
from .load import check_sections, check_values, load_config, reject_removed, warn_unknown
from .mapping import (activation_checkpointing, batch_sizes, compose_transforms,
                      monitoring_sections, precision_of, resolve_world_size, stage_of,
                      transform_options, zero3_leaf_units, zero_section)
from .settings import DeepSpeedConfigWarning, DeepSpeedSettings, OptimizerFactory, SchedulerFactory

__all__ = ["from_deepspeed_config", "read_config", "DeepSpeedSettings", "DeepSpeedConfigWarning",
           "OptimizerFactory", "SchedulerFactory", "load_config", "resolve_auto", "hidden_size_of",
           "batch_sizes", "optimizer_factory", "scheduler_factory", "activation_checkpointing"]

GRADIENT_CLIPPING_DEFAULT = 1.0         # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise


def from_deepspeed_config(config_or_path, *, model=None, world_size: int | None = None
                          ) -> DeepSpeedSettings:
    """Read a DeepSpeed config into a zerofn transform and the rest of what it asks for.

    Args:
        config_or_path: a config dict, or the path of a JSON config file.
        model: the model, needed only to resolve the "auto" values Hugging Face derives
            from ``model.config.hidden_size`` (bucket sizes, persistence threshold).
        world_size: the data-parallel world size for the batch rule (default: the
            initialized process group's, else ``$WORLD_SIZE``, else 1).

    Returns:
        A frozen ``DeepSpeedSettings``.

    Example:
        >>> s = zerofn.from_deepspeed_config("ds_config.json", model=model)
        >>> opt = s.optimizer(model.parameters())
        >>> model, opt = s.transform(model, opt)
        >>> sched = s.scheduler(opt) if s.scheduler else None
    """
    return read_config(config_or_path, model=model, world_size=world_size)


def read_config(config_or_path, *, model=None, world_size: int | None = None,
                group=None) -> DeepSpeedSettings:
    """``from_deepspeed_config`` with the process group to shard over (for ``initialize``)."""
    raw = load_config(config_or_path)
    check_sections(raw)
    reject_removed(raw)
    warn_unknown(raw)
    world = resolve_world_size(world_size)
    stage = stage_of(raw)
    config, filled = resolve_auto(raw, model, stage)
    check_values(config)
    batch = batch_sizes(config, world)
    param_dtype, precision_opts = precision_of(config)
    transforms = transform_options(config, stage, param_dtype, precision_opts, group,
                                   zero3_leaf_units(zero_section(config), stage, model))
    monitoring = monitoring_sections(config)
    ignored = tuple(ignored_keys(config, stage))
    warn_about_keys(filled, ignored, monitoring)
    return DeepSpeedSettings(
        transform=compose_transforms(transforms, stage), transforms=transforms, stage=stage,
        param_dtype=param_dtype, **batch,
        gradient_clipping=float(config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)),
        optimizer=optimizer_factory(config.get("optimizer")),
        scheduler=scheduler_factory(config.get("scheduler")),
        fp16_auto_cast=bool(param_dtype == torch.float16
                            and config.get("fp16", {}).get("auto_cast", False)),
        activation_checkpointing=activation_checkpointing(config),
        steps_per_print=config.get("steps_per_print"),
        dataloader_drop_last=bool(config.get("dataloader_drop_last", False)),
        monitoring=monitoring, ignored=ignored, config=config, world_size=world)
