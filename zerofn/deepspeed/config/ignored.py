"""Reporting what zerofn does not act on: keys whose values ask for something zerofn does
not do, ZeRO-3 keys under another stage, "auto" values filled from defaults, and monitoring
zerofn cannot write. Each kind is one ``DeepSpeedConfigWarning``."""
from __future__ import annotations

import warnings

from .. import keys as K
from .mapping import (HOST_STATE_KEYS, WRITERS, bf16_section, host_state_options, is_enabled,
                      unprefixed, zero_section, zero_value)
from .settings import DeepSpeedConfigWarning

# Measurements zf.tensorboard always writes (time/ and comm/ series), so they need a writer.
MEASUREMENTS = ("wall_clock_breakdown", "comms_logger")


def ignored_keys(config: dict, stage: int) -> list[str]:
    """"key=value: reason" for every key that asks for something zerofn does not do."""
    zero = zero_section(config)
    out = _reportable(config, K.TOP_IGNORED, "")
    out += _reportable(zero, K.ZERO_IGNORED, "zero_optimization.")
    for name, table in (("offload_optimizer", K.OFFLOAD_OPTIMIZER_IGNORED),
                        ("offload_param", K.OFFLOAD_PARAM_IGNORED)):
        section = zero.get(name) or {}
        if section.get("device", "none") != "none":
            out += _reportable(section, table, f"zero_optimization.{name}.")
    out += _stage_mismatches(zero, stage)
    out += _reportable(config.get("fp16", {}), K.FP16_IGNORED, "fp16.")
    bf16 = bf16_section(config)
    if host_state_options(config, (zero.get("offload_optimizer") or {}).get("device", "none")):
        bf16 = {k: v for k, v in bf16.items() if k not in HOST_STATE_KEYS}   # (honoured)
    out += _reportable(bf16, K.BF16_IGNORED, "bf16.")
    out += _reportable(config.get("activation_checkpointing", {}),
                       K.ACTIVATION_CHECKPOINTING_IGNORED, "activation_checkpointing.")
    if (config.get("optimizer") or {}).get("legacy_fusion"):
        out.append("optimizer.legacy_fusion=True: zerofn has no fused fp16 optimizer")
    return out


def _reportable(section: dict, table: dict, prefix: str) -> list[str]:
    out = []
    for key, value in section.items():
        reason, honoured = table.get(unprefixed(key), (None, (K.ANY,)))
        if K.ANY not in honoured and value not in honoured:
            out.append(f"{prefix}{key}={value!r}: {reason}")
    return out


def _stage_mismatches(zero: dict, stage: int) -> list[str]:
    out = []
    for name in ("prefetch_bucket_size", "param_persistence_threshold"):
        if stage != 3 and zero_value(zero, name) is not None:
            out.append(f"zero_optimization.{name}: a ZeRO-3 setting, and the stage is {stage}")
    if stage != 3 and zero.get("leaf_module"):
        out.append(f"zero_optimization.leaf_module: a ZeRO-3 setting, and the stage is {stage}")
    if stage == 3 and "allgather_bucket_size" in zero:
        out.append("zero_optimization.allgather_bucket_size: ZeRO-1/2 only (ZeRO-3's gathers "
                   "follow stage3_prefetch_bucket_size)")
    return out


def warn_about_keys(filled: list[str], ignored: tuple, monitoring: dict) -> None:
    """One warning each for the "auto" values filled from Hugging Face's defaults, the keys
    zerofn does not act on, and the monitoring it cannot write or has no writer for."""
    if filled:
        warnings.warn("DeepSpeed config: \"auto\" filled with Hugging Face TrainingArguments' "
                      "defaults: " + ", ".join(filled), DeepSpeedConfigWarning, stacklevel=4)
    if ignored:
        warnings.warn("DeepSpeed config: zerofn does not act on these keys:\n  "
                      + "\n  ".join(ignored), DeepSpeedConfigWarning, stacklevel=4)
    enabled = [name for name, value in monitoring.items() if is_enabled(value)]
    not_built = [n for n in enabled if n not in WRITERS + MEASUREMENTS]
    if not_built:
        warnings.warn(f"DeepSpeed config: {not_built} are enabled, but zerofn cannot write "
                      f"W&B, Comet, flops-profiler or memory-breakdown output; the parsed "
                      f"sections are kept in settings.monitoring.", DeepSpeedConfigWarning,
                      stacklevel=4)
    unwritten = [n for n in enabled if n in MEASUREMENTS] \
        if not any(n in WRITERS for n in enabled) else []
    if unwritten:
        warnings.warn(f"DeepSpeed config: {unwritten} are enabled; zerofn measures step "
                      f"times and collectives always, and writes them (time/ and comm/ series) "
                      f"only through tensorboard or csv_monitor: enable one of those.",
                      DeepSpeedConfigWarning, stacklevel=4)
