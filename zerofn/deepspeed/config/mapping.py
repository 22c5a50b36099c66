"""A DeepSpeed config's sections mapped to zerofn: the batch-size triple, precision, the
zero_optimization options (sharding, ZeRO-3 leaf modules, offload) and monitoring, as
``{transform name: options}`` and as the composed transform."""
from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist

from ... import api as zt
from ...config import Config
from .. import keys as K
from ..utils import leaf_units, mark_from_config
from .settings import DeepSpeedConfigWarning

DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
# The monitoring sections zf.tensorboard writes for.
WRITERS = ("tensorboard", "csv_monitor")
DEEPSPEED_JOB_NAME = "DeepSpeedJobName"


# -- stage and world size --------------------------------------------------------------
def stage_of(config: dict) -> int:
    """zero_optimization.stage, as written (0 included)."""
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):          # DeepSpeed's legacy form: true means stage 1
        return int(zero)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3; got {stage!r}.")
    return stage


def resolve_world_size(world_size: int | None) -> int:
    """The data-parallel world size of the batch rule: as given, else the initialized process
    group's, else ``$WORLD_SIZE``, else 1."""
    if world_size is not None:
        return int(world_size)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


# -- batch sizes -----------------------------------------------------------------------
def batch_sizes(config: dict, world: int) -> dict:
    """DeepSpeed's rule: any two of train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps determine the third (integer division, as DeepSpeed), and
    ``train = micro * accumulation * world`` must hold."""
    train, micro, accum = (config.get(k) for k in K.BATCH_KEYS)
    for name, value in zip(K.BATCH_KEYS, (train, micro, accum)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"DeepSpeed config: {name} must be an integer (or \"auto\"), "
                             f"got {value!r}.")
    if train is not None and micro is not None and accum is None:
        accum = train // micro // world
    elif train is not None and accum is not None and micro is None:
        micro = train // world // accum
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * world
    elif train is not None and micro is None and accum is None:
        accum, micro = 1, train // world
    elif micro is not None and train is None and accum is None:
        accum, train = 1, micro * world
    elif train is None and micro is None:
        raise ValueError("DeepSpeed config: give train_batch_size or "
                         "train_micro_batch_size_per_gpu (or both).")
    if min(train, micro, accum) <= 0 or train != micro * accum * world:
        raise ValueError(
            f"DeepSpeed config: train_batch_size ({train}) must equal "
            f"train_micro_batch_size_per_gpu ({micro}) * gradient_accumulation_steps ({accum}) "
            f"* world size ({world}), each at least 1. Fix one of them, or set it to \"auto\".")
    return {"train_batch_size": train, "micro_batch_size": micro,
            "gradient_accumulation_steps": accum}


# -- precision -------------------------------------------------------------------------
def bf16_section(config: dict) -> dict:
    return config.get("bf16", config.get("bfloat16", {}))


def precision_of(config: dict) -> tuple[torch.dtype | None, dict]:
    """``(compute dtype, mixed_precision's loss-scaling options)``."""
    fp16, bf16 = config.get("fp16", {}), bf16_section(config)
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; "
                         "enable one of them.")
    if bf16.get("enabled"):
        return torch.bfloat16, {}
    if not fp16.get("enabled"):
        return None, {}
    opts = {k: fp16[k] for k in K.FP16_SCALING if k in fp16}
    if opts.get("loss_scale", 0) == 0:      # DeepSpeed's 0: dynamic scaling
        opts.pop("loss_scale", None)
    return torch.float16, opts


def _reduce_dtype(config: dict) -> torch.dtype | None:
    name = config.get("communication_data_type")
    if name is None:
        return None
    if str(name).lower().removeprefix("torch.") not in DTYPES:
        raise ValueError(f"DeepSpeed config: communication_data_type {name!r} is not one of "
                         f"fp16, bf16, fp32.")
    return DTYPES[str(name).lower().removeprefix("torch.")]


# -- zero_optimization -----------------------------------------------------------------
def zero_section(config: dict) -> dict:
    zero = config.get("zero_optimization", {})
    return {} if isinstance(zero, bool) else zero


def zero_value(zero: dict, name: str):
    """A zero_optimization value under either spelling (``x`` or ``stage3_x``)."""
    plain, prefixed = zero.get(name), zero.get("stage3_" + name)
    if plain is not None and prefixed is not None and plain != prefixed:
        raise ValueError(f"DeepSpeed config: zero_optimization.{name}={plain!r} and "
                         f"zero_optimization.stage3_{name}={prefixed!r} are the same setting "
                         f"with two values; keep one.")
    return plain if plain is not None else prefixed


def unprefixed(key: str) -> str:
    name = key[len("stage3_"):]
    return name if key.startswith("stage3_") and name in K.STAGE3_ALIASED else key


def _sharding_options(zero: dict, stage: int) -> tuple[dict, dict]:
    """``(options shared by every stage, shard_params's options)``."""
    buckets = ["reduce_bucket_size"] + (["prefetch_bucket_size"] if stage == 3
                                        else ["allgather_bucket_size"])
    # (prefetch's 0 means no prefetch, not a bound: it leaves the bound to the others)
    sizes = [int(zero_value(zero, b)) for b in buckets if zero_value(zero, b)]
    shared = {"bucket_size": max(sizes)} if sizes else {}
    params = {}
    if stage == 3:
        threshold = zero_value(zero, "param_persistence_threshold")
        if threshold is not None:
            params["persist_below"] = int(threshold) + 1    # DeepSpeed keeps numel <= threshold
        if zero_value(zero, "prefetch_bucket_size") == 0:
            params["prefetch"] = 0                          # DeepSpeed's 0: no prefetch
    return shared, params


def zero3_leaf_units(zero: dict, stage: int, model) -> list | None:
    """ZeRO-3: units that make each ZeRO-3 leaf module of ``model`` a unit of its own
    (``zerofn.deepspeed.utils``), after marking those ``leaf_module`` names; None where
    the model has none."""
    section = zero.get("leaf_module")
    if stage != 3:
        return None      # (a section is reported: a ZeRO-3 setting)
    if section and model is None:
        raise ValueError("DeepSpeed config: zero_optimization.leaf_module names modules of "
                         "a model, and none was given: pass model= to from_deepspeed_config "
                         "(zerofn train's built-in GPT has no such modules: drop the section).")
    if model is None:
        return None
    missing = mark_from_config(model, section) if section else []
    if missing:
        warnings.warn(f"DeepSpeed config: zero_optimization.leaf_module entries {missing} "
                      "match no module of the model.", DeepSpeedConfigWarning, stacklevel=4)
    return leaf_units(model)


def _offload_section(zero: dict, name: str, legacy: str) -> dict:
    section = dict(zero.get(name) or {})
    if zero.get(legacy) and not section:     # DeepSpeed's deprecated booleans
        section = {"device": "cpu"}
    device = section.get("device", "none") or "none"
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"DeepSpeed config: zero_optimization.{name}.device must be "
                         f"\"none\", \"cpu\" or \"nvme\"; got {device!r}.")
    section["device"] = device
    return section


def _offload_options(zero: dict, stage: int) -> dict | None:
    """zerofn's one ``offload(...)`` from DeepSpeed's two offload sections."""
    opt = _offload_section(zero, "offload_optimizer", "cpu_offload")
    par = _offload_section(zero, "offload_param", "cpu_offload_param")
    if par["device"] != "none" and stage != 3:
        raise ValueError(f"DeepSpeed config: zero_optimization.offload_param (device "
                         f"{par['device']!r}) needs zero_optimization.stage 3, but the stage is "
                         f"{stage}: parameters are sharded only in ZeRO-3.")
    if "none" not in (opt["device"], par["device"]) and opt["device"] != par["device"]:
        raise ValueError(f"DeepSpeed config: zero_optimization.offload_param.device "
                         f"{par['device']!r} and zero_optimization.offload_optimizer.device "
                         f"{opt['device']!r} differ; zerofn offloads both to one place. "
                         f"Use the same device for both.")
    device = par["device"] if par["device"] != "none" else opt["device"]
    if device == "none":
        return None
    options = {"device": device, "params": par["device"] != "none"}
    if opt["device"] != "none" and "ratio" in opt:   # (DeepSpeed's Twin-Flow is ZeRO-3 only;
        options["ratio"] = float(opt["ratio"])     # zerofn's share works at every stage)
    if device == "nvme":
        options["path"] = _nvme_path(opt, par)
        if par["device"] == "nvme" and "buffer_count" in par:
            options["units_in_flight"] = int(par["buffer_count"])
    return options


# bf16 keys (DeepSpeed 0.19.8, with offload_optimizer.device "cpu") -> offload()'s options
HOST_STATE_KEYS = {"bf16_optimizer_states": "state_dtype",
                   "bf16_master_weights_and_grads": "master_dtype"}


def host_state_options(config: dict, device: str) -> dict:
    """offload("cpu")'s stored dtypes from DeepSpeed's bf16 section: bf16 moments, bf16
    masters. (zerofn also has int8 moments, which DeepSpeed's config cannot name.)"""
    bf16 = bf16_section(config)
    if device != "cpu" or not bf16.get("enabled"):
        return {}
    return {option: torch.bfloat16 for key, option in HOST_STATE_KEYS.items() if bf16.get(key)}


def _nvme_path(opt: dict, par: dict) -> str:
    paths = {name: s.get("nvme_path") for name, s in (("offload_optimizer", opt),
                                                       ("offload_param", par))
             if s["device"] == "nvme"}
    if None in paths.values():
        missing = next(n for n, p in paths.items() if p is None)
        raise ValueError(f"DeepSpeed config: zero_optimization.{missing}.device is \"nvme\" but "
                         f"zero_optimization.{missing}.nvme_path is missing; name a directory on "
                         f"the drive.")
    if len(set(paths.values())) > 1:
        raise ValueError(f"DeepSpeed config: zero_optimization.offload_optimizer.nvme_path and "
                         f"zero_optimization.offload_param.nvme_path differ ({paths}); zerofn "
                         f"keeps one swap file per rank: use one directory.")
    return str(next(iter(paths.values())))


# -- transforms ------------------------------------------------------------------------
def transform_options(config: dict, stage: int, param_dtype, precision_opts: dict, group,
                      units=None) -> dict:
    """``{transform name: options}`` in the order they are composed."""
    zero = zero_section(config)
    shared, param_opts = _sharding_options(zero, stage)
    if group is not None:
        shared["group"] = group
    if units is not None:
        shared["units"] = units
    out = {"shard_optimizer": shared}
    if stage >= 2:
        out["shard_grads"] = {}
    if stage == 3:
        out["shard_params"] = param_opts
    reduce_dtype = _reduce_dtype(config)
    if param_dtype is not None or reduce_dtype is not None:
        out["mixed_precision"] = dict(precision_opts, param_dtype=param_dtype or torch.float32,
                                      reduce_dtype=reduce_dtype)
    offload = _offload_options(zero, stage)
    if offload is not None:
        out["offload"] = dict(offload, **host_state_options(config, offload["device"]))
    monitor = _monitor_options(config)
    if monitor is not None:
        out["tensorboard"] = monitor
    return out


def _monitor_options(config: dict) -> dict | None:
    """``zf.tensorboard``'s options from the tensorboard and csv_monitor sections: each
    writes to ``output_path/job_name`` as in DeepSpeed (rank 0 only, as there), the event
    files to tensorboard's (or, with csv_monitor alone, to the CSV directory), every
    ``steps_per_print`` steps (10 where the config has none; DeepSpeed's default is None,
    and its own monitor writes every step)."""
    tb, csv_monitor = (config.get(name) if isinstance(config.get(name), dict) else {}
                       for name in WRITERS)
    if not (is_enabled(tb) or is_enabled(csv_monitor)):
        return None
    path = {name: os.path.join(section.get("output_path") or "",
                               section.get("job_name") or DEEPSPEED_JOB_NAME)
            for name, section in zip(WRITERS, (tb, csv_monitor))}
    options = {"logdir": path["tensorboard" if is_enabled(tb) else "csv_monitor"],
               "every": int(config.get("steps_per_print") or 10)}
    if is_enabled(csv_monitor):
        options["csv"] = path["csv_monitor"]
    return options


def compose_transforms(transforms: dict, stage: int) -> zt.Transform:
    """``transform_options``' dict as the one transform (stage 0 runs as ZeRO-1, as the
    dict says: zerofn has no unsharded mode)."""
    return Config(max(stage, 1), sharding=transforms["shard_optimizer"],
                  params=transforms.get("shard_params", {}),
                  precision=transforms.get("mixed_precision"), offload=transforms.get("offload"),
                  tensorboard=transforms.get("tensorboard")).transform()


# -- sections kept as read -------------------------------------------------------------
def activation_checkpointing(config: dict) -> dict:
    return {**K.ACTIVATION_CHECKPOINTING_DEFAULTS, **config.get("activation_checkpointing", {})}


def monitoring_sections(config: dict) -> dict:
    return {name: copy.deepcopy(config[name]) for name in K.MONITORS if name in config}


def is_enabled(value) -> bool:
    return bool(value.get("enabled", False)) if isinstance(value, dict) else bool(value)
