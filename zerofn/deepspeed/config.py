"""A DeepSpeed config read into zerofn: ``from_deepspeed_config``.

The config (a dict or a JSON file, as DeepSpeed reads it) becomes one zerofn transform plus
what else it asks for: optimizer and scheduler factories, batch sizes, clipping. Every key
is accounted for (``docs/deepspeed.md`` has the full table): keys zerofn acts on are mapped
to the transform option nearest in meaning; keys that mean nothing to zerofn get one
``DeepSpeedConfigWarning`` listing them with the reason; unknown keys (typos, which
DeepSpeed ignores silently) get a warning naming the closest known key; contradictions
raise ``ValueError`` naming both keys. ``"auto"`` values are filled as Hugging Face's
DeepSpeed integration fills them.
"""
from __future__ import annotations

import base64
import binascii
import copy
import difflib
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
import torch
import torch.distributed as dist

from .. import transforms as zt
from . import keys as K
from .schedulers import SCHEDULERS
from .utils import leaf_units, mark_from_config

AUTO = "auto"
# Hugging Face's TrainingArguments defaults, which its integration writes over "auto".
HF_MICRO_BATCH = 8                      # per_device_train_batch_size
HF_FILLS = {
    "gradient_clipping": 1.0,           # max_grad_norm
    "optimizer.params.lr": 5e-5,        # learning_rate
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_num_steps": 1,   # max(1, warmup_steps=0)
    "fp16.enabled": False,
    "bf16.enabled": False,
}
GRADIENT_CLIPPING_DEFAULT = 1.0         # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise
DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
# Monitoring: the two writers become zf.tensorboard; the two measurements are series it
# always writes (time/, comm/), so they need a writer.
WRITERS = ("tensorboard", "csv_monitor")
MEASUREMENTS = ("wall_clock_breakdown", "comms_logger")
WRITER_KNOWN = frozenset(("enabled", "output_path", "job_name"))
DEEPSPEED_JOB_NAME = "DeepSpeedJobName"
NOT_BUILT_OPTIMIZERS = ("lamb", "lion", "muadam", "muadamw", "musgd", "muon", "onebitadam",
                        "zerooneadam", "onebitlamb")


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed config key zerofn does not act on: ignored, unknown, or not wired yet."""


@dataclass(frozen=True)
class OptimizerFactory:
    """``factory(params)`` builds ``cls(params, **kwargs)``."""
    cls: type
    kwargs: dict

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


@dataclass(frozen=True)
class SchedulerFactory:
    """``factory(optimizer)`` builds ``cls(optimizer, **kwargs)``."""
    cls: type
    kwargs: dict

    def __call__(self, optimizer):
        return self.cls(optimizer, **self.kwargs)


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
    _reject_removed(raw)
    _warn_unknown(raw)
    world = _world_size(world_size)
    stage = _stage(raw)
    config, filled = resolve_auto(raw, model, stage)
    batch = batch_sizes(config, world)
    param_dtype, precision_opts = _precision(config)
    transforms = _transforms(config, stage, param_dtype, precision_opts, group,
                             _leaf_units(_zero_section(config), stage, model))
    monitoring = _monitoring(config)
    ignored = tuple(_ignored(config, stage))
    _warn(filled, ignored, monitoring)
    return DeepSpeedSettings(
        transform=_compose(transforms), transforms=transforms, stage=stage,
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


# -- loading --------------------------------------------------------------------------------
def load_config(config_or_path) -> dict:
    """A private copy of the config: a dict, a JSON file's path, or base64 JSON (as DeepSpeed
    accepts). Duplicate keys in a file are an error, as in DeepSpeed."""
    if isinstance(config_or_path, dict):
        return copy.deepcopy(config_or_path)
    if isinstance(config_or_path, (str, os.PathLike)):
        path = os.fspath(config_or_path)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f, object_pairs_hook=_no_duplicates)
        try:
            return json.loads(base64.urlsafe_b64decode(path).decode("utf-8"),
                              object_pairs_hook=_no_duplicates)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"A DeepSpeed config is a dict, the path of a JSON file or base64 JSON; "
                     f"got {config_or_path!r} (no such file).")


def _no_duplicates(pairs) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"DeepSpeed config: key {key!r} appears twice in one section.")
        out[key] = value
    return out


def _reject_removed(config: dict) -> None:
    removed = [k for k in K.REMOVED if k in config]
    if removed:
        raise ValueError(f"DeepSpeed config: {removed} were removed from DeepSpeed (0.19.8 "
                         f"refuses them too); delete them from the config.")


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return int(world_size)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


# -- unknown keys -------------------------------------------------------------------------
def _sections(config: dict):
    """``(dotted prefix, section dict, its known keys)`` for every section zerofn checks."""
    yield "", config, K.TOP_KNOWN
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        yield "zero_optimization.", zero, K.ZERO_KNOWN
        for name, known in (("offload_optimizer", K.OFFLOAD_OPTIMIZER_KNOWN),
                            ("offload_param", K.OFFLOAD_PARAM_KNOWN)):
            if isinstance(zero.get(name), dict):
                yield f"zero_optimization.{name}.", zero[name], known
    for name, known in (("fp16", K.FP16_KNOWN), ("bf16", K.BF16_KNOWN),
                        ("bfloat16", K.BF16_KNOWN), ("optimizer", K.OPTIMIZER_KNOWN),
                        ("scheduler", K.SCHEDULER_KNOWN),
                        ("activation_checkpointing", K.ACTIVATION_CHECKPOINTING_KNOWN),
                        ("tensorboard", WRITER_KNOWN), ("csv_monitor", WRITER_KNOWN)):
        if isinstance(config.get(name), dict):
            yield f"{name}.", config[name], known


def _warn_unknown(config: dict) -> None:
    for prefix, section, known in _sections(config):
        for key in section:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f"did you mean {prefix}{close[0]!r}?" if close else \
                    "no known key is close to it"
                warnings.warn(f"DeepSpeed config: unknown key {prefix}{key!r} (DeepSpeed would "
                              f"ignore it silently); {hint}", DeepSpeedConfigWarning, stacklevel=4)


# -- "auto" -----------------------------------------------------------------------------------
def _stage(config: dict) -> int:
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):          # DeepSpeed's legacy form: true means stage 1
        return int(zero)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3; got {stage!r}.")
    return stage


def hidden_size_of(model) -> int | None:
    """The hidden size Hugging Face reads: ``config.hidden_size``, else the largest of
    ``config.hidden_sizes``, else the same on ``config.text_config``."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if hasattr(cfg, "hidden_size"):
            return cfg.hidden_size
        if hasattr(cfg, "hidden_sizes"):
            return max(cfg.hidden_sizes)
    return None


def _hidden_fills(hidden: int) -> dict:
    return {"reduce_bucket_size": hidden * hidden,
            "prefetch_bucket_size": int(0.9 * hidden * hidden),
            "param_persistence_threshold": 10 * hidden}


def resolve_auto(raw: dict, model, stage: int) -> tuple[dict, list[str]]:
    """Replace every "auto" as Hugging Face's integration would with default
    TrainingArguments. Returns the config and "key=value" for each value taken from those
    defaults (batch sizes and hidden-size keys are derived, not defaulted)."""
    config = copy.deepcopy(raw)
    filled = []
    for path, parent, key in list(_auto_values(config)):
        if path in K.BATCH_KEYS:
            del parent[key]      # the batch rule derives it (batch_sizes)
        elif path.startswith("zero_optimization."):
            _fill_zero_auto(parent, key, path, model, stage)
        elif path == "scheduler.params.warmup_max_lr":
            parent[key] = None   # the schedulers' None: the optimizer's own lr
        elif path in HF_FILLS:
            parent[key] = copy.copy(HF_FILLS[path])
            filled.append(f"{path}={parent[key]!r}")
        else:
            raise ValueError(_auto_error(path))
    if any(p in K.BATCH_KEYS for p, _, _ in _auto_values(raw)) and not any(
            k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        config["train_micro_batch_size_per_gpu"] = HF_MICRO_BATCH
        filled.append(f"train_micro_batch_size_per_gpu={HF_MICRO_BATCH}")
    return config, filled


def _auto_values(node, prefix=""):
    for key, value in list(node.items()):
        path = prefix + key
        if isinstance(value, dict):
            yield from _auto_values(value, path + ".")
        elif value == AUTO:
            yield path, node, key


def _fill_zero_auto(zero: dict, key: str, path: str, model, stage: int) -> None:
    name = _unprefixed(key)
    fills = ("reduce_bucket_size",) + (("prefetch_bucket_size", "param_persistence_threshold")
                                       if stage == 3 else ())
    if name not in fills:
        if name in ("prefetch_bucket_size", "param_persistence_threshold"):
            del zero[key]        # a ZeRO-3 key under another stage: unused, as in Hugging Face
            return
        raise ValueError(_auto_error(path))
    hidden = hidden_size_of(model) if model is not None else None
    if hidden is None:
        raise ValueError(
            f"DeepSpeed config: {path} is \"auto\", which Hugging Face derives from the model's "
            f"hidden size, but " + ("no model was given" if model is None else
                                    "the model's config has neither hidden_size nor "
                                    "hidden_sizes (nor on its text_config)") +
            f". Pass model= (with a .config), or write a number for {path}.")
    zero[key] = _hidden_fills(hidden)[name]


def _auto_error(path: str) -> str:
    if path.endswith("total_num_steps"):
        return (f"DeepSpeed config: {path} is \"auto\"; Hugging Face fills it from the Trainer's "
                f"number of training steps, which zerofn cannot know. Write the number of "
                f"optimizer steps you will run.")
    return (f"DeepSpeed config: {path} is \"auto\", which zerofn cannot resolve (Hugging Face's "
            f"integration resolves batch sizes, bucket sizes, the persistence threshold, "
            f"clipping, optimizer and scheduler values and fp16/bf16.enabled). Write a value.")


# -- batch sizes ------------------------------------------------------------------------------
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


# -- precision ------------------------------------------------------------------------------
def _bf16_section(config: dict) -> dict:
    return config.get("bf16", config.get("bfloat16", {}))


def _precision(config: dict) -> tuple[torch.dtype | None, dict]:
    """``(compute dtype, mixed_precision's loss-scaling options)``."""
    fp16, bf16 = config.get("fp16", {}), _bf16_section(config)
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


# -- zero_optimization ------------------------------------------------------------------------
def _zero_section(config: dict) -> dict:
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


def _sharding_options(zero: dict, stage: int) -> tuple[dict, dict]:
    """``(options shared by every stage, shard_params's options)``."""
    buckets = ["reduce_bucket_size"] + (["prefetch_bucket_size"] if stage == 3
                                        else ["allgather_bucket_size"])
    sizes = [int(zero_value(zero, b)) for b in buckets if zero_value(zero, b) is not None]
    shared = {"bucket_size": max(sizes)} if sizes else {}
    params = {}
    if stage == 3:
        threshold = zero_value(zero, "param_persistence_threshold")
        if threshold is not None:
            params["persist_below"] = int(threshold) + 1    # DeepSpeed keeps numel <= threshold
        if zero_value(zero, "prefetch_bucket_size") == 0:
            params["prefetch"] = 0                          # DeepSpeed's 0: no prefetch
    return shared, params


def _leaf_units(zero: dict, stage: int, model) -> list | None:
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
    if device == "nvme":
        options["path"] = _nvme_path(opt, par)
        if par["device"] == "nvme" and "buffer_count" in par:
            options["units_in_flight"] = int(par["buffer_count"])
    return options


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


def _transforms(config: dict, stage: int, param_dtype, precision_opts: dict, group,
                units=None) -> dict:
    """``{transform name: options}`` in the order they are composed."""
    zero = _zero_section(config)
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
        out["offload"] = offload
    monitor = _monitor_options(config)
    if monitor is not None:
        out["tensorboard"] = monitor
    return out


def _monitor_options(config: dict) -> dict | None:
    """``zf.tensorboard``'s options from the tensorboard and csv_monitor sections: each
    writes to ``output_path/job_name`` as in DeepSpeed (rank 0 only, as there), the event
    files to tensorboard's (or, with csv_monitor alone, to the CSV directory), every
    ``steps_per_print`` steps (DeepSpeed's default 10)."""
    tb, csv_monitor = (config.get(name) if isinstance(config.get(name), dict) else {}
                       for name in WRITERS)
    if not (_enabled(tb) or _enabled(csv_monitor)):
        return None
    path = {name: os.path.join(section.get("output_path") or "",
                               section.get("job_name") or DEEPSPEED_JOB_NAME)
            for name, section in zip(WRITERS, (tb, csv_monitor))}
    options = {"logdir": path["tensorboard" if _enabled(tb) else "csv_monitor"],
               "every": int(config.get("steps_per_print") or 10)}
    if _enabled(csv_monitor):
        options["csv"] = path["csv_monitor"]
    return options


def _compose(transforms: dict) -> zt.Transform:
    made = []
    for name, options in transforms.items():
        options = dict(options)
        if name == "offload":
            made.append(zt.offload(options.pop("device"), **options))
        elif name == "tensorboard":
            made.append(zt.tensorboard(options.pop("logdir"), **options))
        else:
            made.append(getattr(zt, name)(**options))
    return zt.compose(*made)


# -- optimizer and scheduler ------------------------------------------------------------------
def optimizer_factory(section: dict | None) -> OptimizerFactory | None:
    """DeepSpeed's "optimizer" section as a torch.optim factory.

    Adam and AdamW follow DeepSpeed: "Adam" steps as AdamW (decoupled weight decay) unless
    ``adam_w_mode`` is false; weight decay defaults to 0 (DeepSpeed's fused and CPU Adam)
    unless ``torch_adam`` is true (then torch's own defaults). Other names are
    torch.optim classes (SGD, RMSprop, Adagrad, ...).
    """
    if not section:
        return None
    name, params = section.get("type"), dict(section.get("params") or {})
    if not isinstance(name, str):
        raise ValueError("DeepSpeed config: the optimizer section needs a \"type\" (e.g. AdamW).")
    if "max_grad_norm" in params:
        raise ValueError("DeepSpeed config: optimizer.params.max_grad_norm is not an optimizer "
                         "parameter; use the top-level gradient_clipping.")
    if name.lower() in ("adam", "adamw"):
        cls = _adam_class(name, params)
    elif name.lower() in NOT_BUILT_OPTIMIZERS:
        raise ValueError(f"DeepSpeed config: optimizer {name!r} is DeepSpeed's own; zerofn runs "
                         f"torch.optim optimizers (Adam, AdamW, SGD, ...). Pick one of those, or "
                         f"pass your own optimizer.")
    else:
        cls = _torch_optimizer(name)
    _check_params(cls, params, "optimizer.params", skip=("self", "params"))
    return OptimizerFactory(cls, params)


def _adam_class(name: str, params: dict) -> type:
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = params.pop("adam_w_mode", True)
    params.pop("fp32_optimizer_states", None)    # zerofn's optimizer state is always fp32
    if not params.pop("bias_correction", True):
        raise ValueError("DeepSpeed config: optimizer.params.bias_correction=false has no "
                         "torch.optim equivalent; zerofn's Adam always corrects bias.")
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)     # DeepSpeed's fused/CPU Adam default
    return torch.optim.AdamW if name.lower() == "adamw" or adam_w_mode else torch.optim.Adam


def _torch_optimizer(name: str) -> type:
    classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
               if isinstance(getattr(torch.optim, n), type)
               and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}
    if name.lower() not in classes:
        close = difflib.get_close_matches(name.lower(), classes, n=1)
        raise ValueError(f"DeepSpeed config: optimizer type {name!r} is neither Adam/AdamW nor "
                         f"a torch.optim class" + (f"; did you mean {classes[close[0]].__name__!r}?"
                                                   if close else "."))
    return classes[name.lower()]


def _check_params(fn, params: dict, where: str, skip: tuple) -> None:
    accepted = [p for p in inspect.signature(fn).parameters if p not in skip]
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            raise ValueError(f"DeepSpeed config: {where}.{key} is not a parameter of "
                             f"{fn.__name__} (it takes {accepted})"
                             + (f"; did you mean {close[0]!r}?" if close else "."))


def scheduler_factory(section: dict | None) -> SchedulerFactory | None:
    """DeepSpeed's "scheduler" section: WarmupLR, WarmupDecayLR, WarmupCosineLR with
    DeepSpeed's formulas (``zerofn.deepspeed.schedulers``), or a torch.optim.lr_scheduler
    class by name, as DeepSpeed falls back to."""
    if not section:
        return None
    name, params = section.get("type"), dict(section.get("params") or {})
    cls = SCHEDULERS.get(name) or getattr(torch.optim.lr_scheduler, str(name), None)
    if not isinstance(cls, type):
        known = sorted(SCHEDULERS) + ["OneCycle", "LRRangeTest"]
        hint = ("; zerofn does not build DeepSpeed's OneCycle and LRRangeTest: use "
                "torch.optim.lr_scheduler.OneCycleLR, or pass your own scheduler"
                if name in ("OneCycle", "LRRangeTest") else
                f"; did you mean {difflib.get_close_matches(str(name), known, n=1)}?")
        raise ValueError(f"DeepSpeed config: scheduler type {name!r} is not one of "
                         f"{sorted(SCHEDULERS)} nor a torch.optim.lr_scheduler class{hint}")
    _check_params(cls, params, "scheduler.params", skip=("self", "optimizer"))
    return SchedulerFactory(cls, params)


# -- activation checkpointing, monitoring, ignored keys --------------------------------------
def activation_checkpointing(config: dict) -> dict:
    return {**K.ACTIVATION_CHECKPOINTING_DEFAULTS, **config.get("activation_checkpointing", {})}


def _monitoring(config: dict) -> dict:
    return {name: copy.deepcopy(config[name]) for name in K.MONITORS if name in config}


def _enabled(value) -> bool:
    return bool(value.get("enabled", False)) if isinstance(value, dict) else bool(value)


def _reportable(section: dict, table: dict, prefix: str) -> list[str]:
    out = []
    for key, value in section.items():
        reason, honoured = table.get(_unprefixed(key), (None, (K.ANY,)))
        if K.ANY not in honoured and value not in honoured:
            out.append(f"{prefix}{key}={value!r}: {reason}")
    return out


def _ignored(config: dict, stage: int) -> list[str]:
    """"key=value: reason" for every key that asks for something zerofn does not do."""
    zero = _zero_section(config)
    out = _reportable(config, K.TOP_IGNORED, "")
    out += _reportable(zero, K.ZERO_IGNORED, "zero_optimization.")
    for name, table in (("offload_optimizer", K.OFFLOAD_OPTIMIZER_IGNORED),
                        ("offload_param", K.OFFLOAD_PARAM_IGNORED)):
        section = zero.get(name) or {}
        if section.get("device", "none") != "none":
            out += _reportable(section, table, f"zero_optimization.{name}.")
    out += _stage_mismatches(zero, stage)
    out += _reportable(config.get("fp16", {}), K.FP16_IGNORED, "fp16.")
    out += _reportable(_bf16_section(config), K.BF16_IGNORED, "bf16.")
    out += _reportable(config.get("activation_checkpointing", {}),
                       K.ACTIVATION_CHECKPOINTING_IGNORED, "activation_checkpointing.")
    if config.get("optimizer", {}).get("legacy_fusion"):
        out.append("optimizer.legacy_fusion=True: zerofn has no fused fp16 optimizer")
    return out


def _unprefixed(key: str) -> str:
    name = key[len("stage3_"):]
    return name if key.startswith("stage3_") and name in K.STAGE3_ALIASED else key


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


def _warn(filled: list[str], ignored: tuple, monitoring: dict) -> None:
    if filled:
        warnings.warn("DeepSpeed config: \"auto\" filled with Hugging Face TrainingArguments' "
                      "defaults: " + ", ".join(filled), DeepSpeedConfigWarning, stacklevel=4)
    if ignored:
        warnings.warn("DeepSpeed config: zerofn does not act on these keys:\n  "
                      + "\n  ".join(ignored), DeepSpeedConfigWarning, stacklevel=4)
    enabled = [name for name, value in monitoring.items() if _enabled(value)]
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

