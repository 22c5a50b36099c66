"""A DeepSpeed ZeRO-1/2/3 checkpoint read into full tensors by name: ``read_checkpoint``.

The rank files (``ds_files``) give the fp32 masters and optimizer state of the trainable
parameters, cut apart by ``ds_partitions``; the model files give frozen parameters, buffers
and tied names; the optimizer file the fp16 loss scaler; what is left, the client state and
DeepSpeed's bookkeeping, becomes extras.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..runtime.optimizer import SCALER_KEY
from .ds_files import (StandIn, check_model_files, check_ranks, find_step_dir, load_file,
                       pickled_classes, rank_files)
from .ds_partitions import param_groups, partition_states, zero3_params, zero12_params

# engine.save_checkpoint's own keys in *_model_states.pt; every other key is client state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "num_experts", "ds_autoep_layers",
    "autoep_layers", "folding"})


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint gathered into full tensors, in zerofn's terms.

    ``model`` maps every state-dict name (tied aliases included) to a full tensor: the fp32
    master of trainable parameters, frozen parameters and buffers. ``optim`` is a state dict
    in the format of ``torch.distributed.checkpoint.state_dict`` with FQN keys.
    """
    path: str
    stage: int
    world: int
    dtype: torch.dtype
    step: int
    model: dict
    optim: dict
    extras: dict
    notes: list[str] = field(default_factory=list)


def read_checkpoint(path, tag: str | None = None, *,
                    trusted: bool = False) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO checkpoint (see the module docstring) into full tensors.

    Args:
        path: the save dir (its ``latest`` is read), or one ``global_stepN`` directory.
        tag: a checkpoint tag under ``path`` (e.g. ``"global_step100"``).
        trusted: stand in for every class the files pickle, not only DeepSpeed's
            (``ds_files.load_file``); the values holding them are dropped.

    Returns:
        A ``DeepSpeedCheckpoint``.

    Example:
        >>> ck = read_checkpoint("ds_ckpt")            # doctest: +SKIP
        >>> ck.model["lm_head.weight"].dtype           # doctest: +SKIP
        torch.float32
    """
    step_dir = find_step_dir(path, tag)
    model_files, optim_files = rank_files(step_dir)
    optims = {r: load_file(f, "optimizer_state_dict", trusted)["optimizer_state_dict"]
              for r, f in sorted(optim_files.items())}
    stage, world = _stage_and_world(optims, optim_files)
    check_model_files(model_files, stage, world, step_dir)
    ranks = range(world) if stage == 3 else [0]   # ZeRO-1/2: rank 0's model file alone
    models = {r: load_file(model_files[r], "param_shapes", trusted) for r in ranks}
    head = models[0]
    _check_head(head, model_files[0], world)
    ck = DeepSpeedCheckpoint(step_dir, stage, world, _module_dtype(head),
                             int(head.get("global_steps") or 0), {}, {}, {})
    _add_trainable(ck, [optims[r] for r in range(world)], [optim_files[r] for r in range(world)],
                   head)
    _add_frozen_and_buffers(ck, models)
    _add_loss_scaler(ck, optims[0])
    _add_extras(ck, head, optims[0])
    return ck


def _add_trainable(ck: DeepSpeedCheckpoint, optims: list, files: list, head: dict) -> None:
    """fp32 masters and optimizer state of the trainable parameters, flat group by flat
    group (a param group, or under ZeRO-3 a sub-group of one), and the param groups."""
    parts = [partition_states(osd, ck.stage, file) for osd, file in zip(optims, files)]
    groups, group_of = param_groups(optims[0], ck.stage, len(parts[0]), head.get("ds_config"),
                                     files[0])
    param_shapes = head["param_shapes"]
    if len(param_shapes) != len(group_of):
        raise ValueError(f"{ck.path}: the model file lists {len(param_shapes)} flat groups in "
                         f"param_shapes, the optimizer files {len(group_of)}; they do not match.")
    paddings = optims[0].get("param_alignment_paddings")
    state = {}
    for k, shapes in enumerate(param_shapes):
        rank_parts, where = [p[k] for p in parts], f"{ck.path} flat group {k}"
        if ck.stage == 3:
            params = zero3_params(shapes, rank_parts, ck.world, where)
        else:
            pads = paddings[k] if paddings else [0] * len(shapes)
            params = zero12_params(shapes, rank_parts, pads, ck.world, where)
        for name, tensors in params.items():
            ck.model[name] = tensors.pop("master")
            state[name] = tensors
            groups[group_of[k]]["params"].append(name)
    ck.optim = {"state": {n: s for n, s in state.items() if s}, "param_groups": groups}
    if len(ck.optim["state"]) < len(state):
        ck.notes.append(f"{len(state) - len(ck.optim['state'])} parameters had no optimizer "
                        f"state yet (no step taken); none is written for them")


def _stage_and_world(optims: dict, files: dict) -> tuple[int, int]:
    """ZeRO stage (1 for BF16_Optimizer, DeepSpeed's bf16 ZeRO-1) and data-parallel world
    size, the same in every file; every rank's file present."""
    seen = {}
    for rank, osd in optims.items():
        if "optimizer_state_dict" not in osd and "base_optimizer_state" not in osd:
            raise ValueError(f"{files[rank]} is not a ZeRO optimizer file (it has no "
                             f"base_optimizer_state or optimizer_state_dict).")
        stage = osd.get("zero_stage")
        stage = 1 if stage is None else int(stage.args[0] if isinstance(stage, StandIn) else stage)
        count = osd["partition_count"]
        counts = set(count) if isinstance(count, (list, tuple)) else {count}
        if len(counts) != 1:
            raise ValueError(f"{files[rank]}: param groups are partitioned over different "
                             f"world sizes {sorted(counts)} (expert parallelism); zerofn "
                             f"converts plain data-parallel ZeRO checkpoints only.")
        seen[rank] = (stage, counts.pop())
    stage, world = seen[min(seen)]
    odd = {r: v for r, v in seen.items() if v != (stage, world)}
    if odd:
        r = min(odd)
        raise ValueError(f"mismatched files: {files[min(seen)]} is ZeRO-{stage} at world size "
                         f"{world} but {files[r]} is ZeRO-{odd[r][0]} at world size {odd[r][1]}; "
                         f"the directory mixes files from different runs.")
    if stage not in (1, 2, 3):
        raise ValueError(f"{files[min(seen)]}: unknown ZeRO stage {stage}.")
    check_ranks(set(optims), world, "optimizer", files)
    return stage, world


def _check_head(head: dict, file: str, world: int) -> None:
    """Rank 0's model file: from a run of this world size, with no model parallelism."""
    saved_world = head.get("dp_world_size", world)
    if saved_world != world:
        raise ValueError(f"mismatched files: {file} was saved at data-parallel world size "
                         f"{saved_world}, the optimizer files at {world}; the directory mixes "
                         f"files from different runs.")
    dims = head.get("checkpoint_parallel_dimensions") or {}
    degrees = {"tensor": dims.get("tp_degree", 1), "pipeline": dims.get("pp_degree", 1),
               "model": head.get("mp_world_size", 1)}
    over = {k: v for k, v in degrees.items() if v and v > 1}
    if over:
        raise ValueError(f"{file} was saved with " + ", ".join(f"{k}-parallel degree {v}"
                                                               for k, v in over.items())
                         + "; zerofn converts data-parallel ZeRO checkpoints only.")


def _module_dtype(head: dict) -> torch.dtype:
    """The dtype DeepSpeed computed in: that of the module's parameter entries."""
    names = {n for shapes in head["param_shapes"] for n in shapes}
    for name, value in (head.get("module") or {}).items():
        if name in names and torch.is_tensor(value) and value.is_floating_point():
            return value.dtype
    return torch.float32


def _add_frozen_and_buffers(ck: DeepSpeedCheckpoint, models: dict) -> None:
    """Frozen parameters (ZeRO-3: partitioned like trainable ones, one fragment per rank's
    model file; ZeRO-1/2: whole in the module state), buffers, then tied aliases."""
    head = models[0]
    module, buffers = head.get("module") or {}, set(head.get("buffer_names") or ())
    shared = head.get("shared_params") or {}
    frozen = head.get("frozen_param_shapes") or {}
    if ck.stage == 3:
        for name, shape in frozen.items():
            pieces = [models[r]["frozen_param_fragments"][name].reshape(-1)
                      for r in range(ck.world)]
            ck.model[name] = torch.cat(pieces)[:math.prod(shape)].view(shape).float()
    else:
        for name, value in module.items():
            if name not in ck.model and name not in buffers and name not in shared:
                ck.model[name] = value.float() if value.is_floating_point() else value
    for name in head.get("buffer_names") or ():
        value = module[name]
        ck.model[name] = value.float() if value.is_floating_point() else value
    for alias, name in shared.items():
        if name in ck.model:
            ck.model[alias] = ck.model[name]


def _add_loss_scaler(ck: DeepSpeedCheckpoint, osd: dict) -> None:
    """fp16: DeepSpeed's loss scaler as zerofn's (``zerofn_loss_scaler`` in the optimizer
    state); both follow DeepSpeed's DynamicLossScaler, field for field."""
    scaler = osd.get("loss_scaler")
    state = (scaler.state if isinstance(scaler, StandIn) else None) or {}
    dynamic = bool(state.get("dynamic")) or bool(osd.get("dynamic_loss_scale"))
    if not (dynamic or ck.dtype == torch.float16):
        return
    if dynamic:
        ck.optim[SCALER_KEY] = {"scale": float(state["cur_scale"]),
                                "hysteresis_left": int(state["cur_hysteresis"]),
                                "iteration": int(state["cur_iter"]),
                                "last_overflow": int(state["last_overflow_iter"])}
        ck.extras.setdefault("deepspeed", {})["loss_scaling"] = dict(
            loss_scale=None, loss_scale_window=state["scale_window"],
            hysteresis=state["delayed_shift"], min_loss_scale=state["min_scale"],
            consecutive_hysteresis=state["consecutive_hysteresis"])
    else:
        scale = float(state.get("cur_scale", 1.0))
        ck.optim[SCALER_KEY] = {"scale": scale, "hysteresis_left": 1,
                                "iteration": ck.step, "last_overflow": -1}
        ck.extras.setdefault("deepspeed", {})["loss_scaling"] = dict(loss_scale=scale)


def _add_extras(ck: DeepSpeedCheckpoint, head: dict, osd: dict) -> None:
    """Client state keys as extras, each on its own; DeepSpeed's bookkeeping under
    ``deepspeed``. Values holding objects of other classes (DeepSpeed's, numpy's) are
    dropped, and said so: only their stand-ins were read."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    info = ck.extras.setdefault("deepspeed", {})
    info.update(zero_stage=ck.stage, world_size=ck.world, dtype=names.get(ck.dtype, str(ck.dtype)),
                global_steps=ck.step, skipped_steps=head.get("skipped_steps"),
                global_samples=head.get("global_samples"), gradient_clipping=_clipping(osd, head),
                lr_scheduler=head.get("lr_scheduler"), ds_config=head.get("ds_config"),
                ds_version=head.get("ds_version"))
    for key, value in list(info.items()):
        if pickled_classes(value):
            ck.notes.append(_unpickled(f"DeepSpeed's {key}", value))
            del info[key]
    for key, value in head.items():
        if key in _ENGINE_KEYS:
            continue
        if key in ("step", "deepspeed"):
            ck.notes.append(f"client state {key!r} collides with zerofn's own extra; dropped")
        elif pickled_classes(value):
            ck.notes.append(_unpickled(f"client state {key!r}", value))
        else:
            ck.extras[key] = value


def _unpickled(what: str, value) -> str:
    return (f"{what} holds {', '.join(sorted(pickled_classes(value)))}; dropped: the converter "
            f"runs no pickled code, so it keeps only tensors and plain Python values")


def _clipping(osd: dict, head: dict):
    """The gradient-clipping norm: ZeRO-1/2 keep it in the optimizer file, ZeRO-3 only in
    the config (None when the config left it to DeepSpeed's version-dependent default)."""
    if "clip_grad" in osd:
        return osd["clip_grad"]
    config = head.get("ds_config")
    return config.get("gradient_clipping") if isinstance(config, dict) else None
