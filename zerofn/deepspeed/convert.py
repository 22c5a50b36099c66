"""Convert a DeepSpeed ZeRO-1/2/3 checkpoint into a zerofn checkpoint.

    python -m zerofn.deepspeed.convert CKPT_DIR OUT_DIR [--tag TAG]

``CKPT_DIR`` is what ``engine.save_checkpoint(CKPT_DIR)`` wrote (its ``latest`` names the
checkpoint to read), one of its ``global_stepN`` directories, or the save dir with
``--tag``. The checkpoint may come from any data-parallel world size. ``OUT_DIR`` becomes
a checkpoint root as ``zerofn.save_checkpoint`` writes it (``OUT_DIR/step-N`` and
``OUT_DIR/latest``): ``zerofn.load_checkpoint(OUT_DIR, model, opt)`` loads it at any world
size and stage.

Kept: the fp32 master weights (not the 16-bit module copies), every per-element optimizer
state (Adam's two moments) and its step, the param groups' hyperparameters, the fp16 loss
scaler, frozen parameters, buffers, tied names, the global step (as the checkpoint's step)
and the client state given to ``save_checkpoint`` (as extras). DeepSpeed's own bookkeeping
rides along in one extra, ``deepspeed``. See docs/deepspeed_checkpoints.md.

DeepSpeed is not needed: its pickled objects are read by a restricted unpickler that gives
each DeepSpeed class an inert stand-in, and the flat partitions are cut apart from the
layout facts written down in ``_zero12_params`` and ``_zero3_params``.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..checkpoint import _publish, _step_name, _to_bytes
from ..consolidate import _single_process
from ..runtime.optimizer import SCALER_KEY

# engine.save_checkpoint's own keys in *_model_states.pt; every other key is client state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "num_experts", "ds_autoep_layers",
    "autoep_layers", "folding"})
_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Pipeline stages save layer_NN[-model_MM]-model_states.pt; mixture-of-experts runs add
# layer_L_expert_E_mp_rank_MM_model_states.pt and expp_rank_R_mp_rank_MM_optim_states.pt.
_OTHER_PARALLEL = re.compile(r"(layer_\d+|expp_rank_\d+|.*expert_\d+).*\.pt$")


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


# -- reading pickles without DeepSpeed -----------------------------------------------------
class _StandIn:
    """Stands in for a class pickled into a DeepSpeed checkpoint (a loss scaler, an enum,
    a dataclass): it keeps what the pickle held, ``args`` and ``state``, and runs nothing."""

    path = ""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.path} from a DeepSpeed checkpoint>"


def _load(path: str, key: str) -> dict:
    """``torch.load`` with torch's restricted (weights-only) unpickler; every global it does
    not allow is replaced by a ``_StandIn`` subclass of the same name. The file must be a
    dict holding ``key``."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        stand_ins = [(type(name.rsplit(".", 1)[-1], (_StandIn,), {"path": name}), name)
                     for name in unsafe]
        with torch.serialization.safe_globals(stand_ins):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is one clear error naming it
        raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"{path} is not a DeepSpeed checkpoint file (it has no {key!r}).")
    return data


def _pickled_classes(obj) -> set[str]:
    """The paths of the classes stood in for anywhere inside ``obj``."""
    if isinstance(obj, _StandIn):
        return {obj.path}
    if isinstance(obj, dict):
        return set().union(*(_pickled_classes(k) | _pickled_classes(v) for k, v in obj.items()))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return set().union(*(_pickled_classes(v) for v in obj))
    return set()


# -- finding the files ---------------------------------------------------------------------
def _find_step_dir(path, tag: str | None = None) -> str:
    """The directory holding one checkpoint's rank files (``global_stepN``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory; pass the directory given to DeepSpeed's "
                         f"engine.save_checkpoint() or one of its global_step* directories.")
    if tag is not None:
        step_dir = os.path.join(path, tag)
        if not os.path.isdir(step_dir):
            raise ValueError(f"{path} has no checkpoint tagged {tag!r} (no directory {step_dir}).")
        return step_dir
    if any(_MODEL_FILE.match(n) or _OPTIM_FILE.match(n) for n in os.listdir(path)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        step_dir = os.path.join(path, tag)
        if not os.path.isdir(step_dir):
            raise ValueError(f"{latest} names {tag!r}, but {step_dir} does not exist: the save "
                             f"did not finish or the directory was moved; pass --tag.")
        return step_dir
    raise ValueError(f"{path} is not a DeepSpeed checkpoint: it has neither a 'latest' file nor "
                     f"*_model_states.pt / *_optim_states.pt files. Pass the directory given "
                     f"to engine.save_checkpoint(), one of its global_step* directories, or "
                     f"the save dir with --tag.")


def _rank_files(step_dir: str) -> tuple[dict, dict]:
    """``({dp_rank: model file}, {dp_rank: optimizer file})``; ZeRO-1/2 have one model file
    (rank 0's), ZeRO-3 one per rank."""
    names = sorted(os.listdir(step_dir))
    other = [n for n in names if _OTHER_PARALLEL.match(n)]
    if other:
        raise ValueError(f"{step_dir} holds pipeline-parallel or mixture-of-experts files "
                         f"({', '.join(other[:3])}); zerofn converts data-parallel ZeRO "
                         f"checkpoints only.")
    if "offloaded_tensors" in names:
        raise ValueError(f"{step_dir} keeps its optimizer state in offloaded_tensors/ "
                         f"(offload_optimizer to NVMe), not in the rank files; zerofn cannot "
                         f"convert it. Load it in DeepSpeed and save again without NVMe offload.")
    model, optim, mp_ranks = {}, {}, set()
    for name in names:
        for pattern, files in ((_MODEL_FILE, model), (_OPTIM_FILE, optim)):
            match = pattern.match(name)
            if match:
                mp_ranks.add(int(match.group(2)))
                files[int(match.group(1) or 0)] = os.path.join(step_dir, name)
    if mp_ranks - {0}:
        raise ValueError(f"{step_dir} holds model-parallel ranks mp_rank_"
                         f"{', mp_rank_'.join(f'{r:02d}' for r in sorted(mp_ranks))}: a tensor- "
                         f"or pipeline-parallel checkpoint. zerofn converts data-parallel ZeRO "
                         f"checkpoints (mp_rank_00 only); merge the model-parallel ranks first, "
                         f"e.g. with DeepSpeed's ds_to_universal.")
    if not model:
        raise ValueError(f"{step_dir} has no *_model_states.pt file: it is not a DeepSpeed "
                         f"checkpoint directory, or rank 0's model file is missing.")
    if not optim:
        raise ValueError(f"{step_dir} has no *_optim_states.pt files: it was saved without ZeRO "
                         f"(zero_optimization.stage 0), which zerofn does not convert, or the "
                         f"optimizer files are missing.")
    return model, optim


# -- reading the checkpoint ----------------------------------------------------------------
def read_checkpoint(path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO checkpoint (see the module docstring) into full tensors.

    Args:
        path: the save dir (its ``latest`` is read), or one ``global_stepN`` directory.
        tag: a checkpoint tag under ``path`` (e.g. ``"global_step100"``).

    Returns:
        A ``DeepSpeedCheckpoint``.

    Example:
        >>> ck = read_checkpoint("ds_ckpt")            # doctest: +SKIP
        >>> ck.model["lm_head.weight"].dtype           # doctest: +SKIP
        torch.float32
    """
    step_dir = _find_step_dir(path, tag)
    model_files, optim_files = _rank_files(step_dir)
    optims = {r: _load(f, "optimizer_state_dict")["optimizer_state_dict"]
              for r, f in sorted(optim_files.items())}
    stage, world = _stage_and_world(optims, optim_files)
    _check_model_files(model_files, stage, world, step_dir)
    ranks = range(world) if stage == 3 else [0]   # ZeRO-1/2: rank 0's model file alone
    models = {r: _load(model_files[r], "param_shapes") for r in ranks}
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
    parts = [_partition_states(osd, ck.stage, file) for osd, file in zip(optims, files)]
    groups, group_of = _param_groups(optims[0], ck.stage, len(parts[0]), head.get("ds_config"),
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
            params = _zero3_params(shapes, rank_parts, ck.world, where)
        else:
            pads = paddings[k] if paddings else [0] * len(shapes)
            params = _zero12_params(shapes, rank_parts, pads, ck.world, where)
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
        stage = 1 if stage is None else int(stage.args[0] if isinstance(stage, _StandIn) else stage)
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
    _check_ranks(set(optims), world, "optimizer", files)
    return stage, world


def _check_ranks(ranks: set, world: int, what: str, files: dict) -> None:
    missing, extra = sorted(set(range(world)) - ranks), sorted(ranks - set(range(world)))
    where = os.path.dirname(next(iter(files.values())))
    if missing:
        raise ValueError(f"{where}: {what} files of data-parallel ranks {missing} are missing "
                         f"(found {len(ranks)} of the {world} the checkpoint was saved with); "
                         f"copy the complete directory.")
    if extra:
        raise ValueError(f"{where}: {what} files of ranks {extra} do not belong to a world of "
                         f"{world} (mismatched world sizes): the directory mixes files from "
                         f"different runs.")


def _check_model_files(files: dict, stage: int, world: int, step_dir: str) -> None:
    if stage == 3:
        _check_ranks(set(files), world, "model-state", files)
    elif 0 not in files or "zero_pp_rank" in os.path.basename(files[0]):
        raise ValueError(f"{step_dir}: a ZeRO-{stage} checkpoint needs mp_rank_00_model_states.pt, "
                         f"which is missing.")


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


def _partition_states(osd: dict, stage: int, file: str) -> list[dict]:
    """This rank's pieces, one dict per flat group: ``master`` (its fp32 partition) and
    every per-element optimizer state cut to the same length; scalars (``step``) as is."""
    keys = ("fp32_flat_groups", "optimizer_state_dict") if stage == 3 \
        else ("single_partition_of_fp32_groups", "base_optimizer_state")
    if any(k not in osd for k in keys):
        raise ValueError(f"{file} lacks {' or '.join(k for k in keys if k not in osd)}, which "
                         f"a ZeRO-{stage} optimizer file holds; the file is damaged or not "
                         f"DeepSpeed's.")
    masters, base = (osd[k] for k in keys)
    if isinstance(base, list):
        raise ValueError(f"{file} was saved with zero_optimization.elastic_checkpoint=true, "
                         f"which keeps no optimizer hyperparameters; zerofn does not convert it.")
    order = [i for group in base["param_groups"] for i in group["params"]]
    if len(order) != len(masters):
        raise ValueError(f"{file}: {len(masters)} flat fp32 groups but the optimizer holds "
                         f"{len(order)} tensors; the file is inconsistent.")
    out = []
    for master, idx in zip(masters, order):
        n = master.numel()
        piece = {"master": master.detach().reshape(-1).float()}
        for key, value in base["state"].get(idx, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.numel() < n:
                    raise ValueError(f"{file}: optimizer state {key!r} has {value.numel()} "
                                     f"elements, fewer than its fp32 partition's {n}.")
                piece[key] = value.reshape(-1)[:n].float()
            else:
                piece[key] = value
        out.append(piece)
    return out


def _param_groups(osd: dict, stage: int, n_flat: int, ds_config, file: str) -> tuple[list, list]:
    """The optimizer's param groups (hyperparameters, ``params`` to be filled with FQNs) and
    the group of each flat group. ZeRO-3 adds the flat sub-groups of one param group to it
    in order, so flat group k is the k-th tensor the optimizer holds."""
    base = osd["optimizer_state_dict"] if stage == 3 else osd["base_optimizer_state"]
    groups, group_of = [], []
    for g, group in enumerate(base["param_groups"]):
        groups.append({**_torch_hyperparameters(group, ds_config), "params": []})
        group_of += [g] * len(group["params"])
    if len(group_of) != n_flat:
        raise ValueError(f"{file}: the param groups list {len(group_of)} tensors, the "
                         f"checkpoint holds {n_flat} flat groups.")
    return groups, group_of


def _torch_hyperparameters(group: dict, ds_config) -> dict:
    """A group's hyperparameters; DeepSpeed's own Adams (FusedAdam, DeepSpeedCPUAdam: the
    groups with ``bias_correction``) get the keys of torch.optim.Adam/AdamW added, so a
    torch optimizer loads them. They keep their AdamW mode outside the groups: DeepSpeed
    runs config type "AdamW" as AdamW, and "Adam" too unless ``adam_w_mode`` is false."""
    hyper = {k: v for k, v in group.items() if k != "params"}
    if "bias_correction" not in hyper:
        return hyper
    if not hyper["bias_correction"]:
        raise ValueError("the optimizer ran without Adam bias correction (bias_correction="
                         "False), which no torch.optim optimizer can continue.")
    spec = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    adam_w = True
    if isinstance(spec, dict) and str(spec.get("type", "")).lower() == "adam":
        adam_w = bool((spec.get("params") or {}).get("adam_w_mode", True))
    defaults = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                    differentiable=False, fused=None, decoupled_weight_decay=adam_w)
    return {**defaults, **hyper}


def _zero12_params(shapes: dict, parts: list[dict], paddings: list, world: int, where: str) -> dict:
    """ZeRO-1/2 (and BF16_Optimizer): one param group is one flat buffer holding its
    parameters in ``param_shapes`` order, each followed by its alignment padding
    (``param_alignment_paddings``), the whole padded to a multiple of 2 * world and cut into
    ``world`` equal consecutive partitions. Each rank saves its partition, ZeRO-1/2 without
    the trailing padding (``group_paddings``), so the partitions concatenated are the flat
    buffer up to at most that padding."""
    flat = {k: torch.cat([p[k] for p in parts]) for k, v in parts[0].items() if torch.is_tensor(v)
            and v.dim() > 0}
    total, offset, out = flat["master"].numel(), 0, {}
    for (name, shape), pad in zip(shapes.items(), paddings):
        n = math.prod(shape)
        if offset + n > total:
            raise ValueError(f"{where}: the partitions hold {total} elements, too few for "
                             f"param_shapes (short at {name}); a rank file is truncated or "
                             f"from another run.")
        out[name] = {**_scalars(parts[0]), **{k: v[offset:offset + n].view(shape)
                                              for k, v in flat.items()}}
        offset += n + pad
    if total - offset >= 2 * world:
        raise ValueError(f"{where}: the partitions hold {total} elements but param_shapes "
                         f"use {offset}; the files do not match each other.")
    return out


def _zero3_params(shapes: dict, parts: list[dict], world: int, where: str) -> dict:
    """ZeRO-3: every parameter is partitioned on its own. Flattened and padded to a multiple
    of ``world``, rank r holds elements [r*c, (r+1)*c), c = ceil(numel / world); a rank's flat
    sub-group is its pieces of the sub-group's parameters, in ``param_shapes`` order."""
    length = parts[0]["master"].numel()
    if any(p["master"].numel() != length for p in parts):
        raise ValueError(f"{where}: the ranks' partitions differ in length "
                         f"({[p['master'].numel() for p in parts]}); the files do not match.")
    offset, out = 0, {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        c = -(-n // world)
        if offset + c > length:
            raise ValueError(f"{where}: each partition holds {length} elements, too few for "
                             f"param_shapes (short at {name}).")
        out[name] = {**_scalars(parts[0]), **{
            k: torch.cat([p[k][offset:offset + c] for p in parts])[:n].view(shape)
            for k, v in parts[0].items() if torch.is_tensor(v) and v.dim() > 0}}
        offset += c
    if offset != length:
        raise ValueError(f"{where}: each partition holds {length} elements but param_shapes "
                         f"use {offset}; the files do not match each other.")
    return out


def _scalars(part: dict) -> dict:
    """Per-group scalar state; ``step`` as torch.optim keeps it (a float32 0-dim tensor),
    also when DeepSpeed's CPU Adam kept an int."""
    out = {}
    for key, value in part.items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            out[key] = torch.tensor(float(value), dtype=torch.float32) if key == "step" \
                else value.clone() if torch.is_tensor(value) else value
    return out


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
    state = (scaler.state if isinstance(scaler, _StandIn) else None) or {}
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
        if _pickled_classes(value):
            ck.notes.append(_unpickled(f"DeepSpeed's {key}", value))
            del info[key]
    for key, value in head.items():
        if key in _ENGINE_KEYS:
            continue
        if key in ("step", "deepspeed"):
            ck.notes.append(f"client state {key!r} collides with zerofn's own extra; dropped")
        elif _pickled_classes(value):
            ck.notes.append(_unpickled(f"client state {key!r}", value))
        else:
            ck.extras[key] = value


def _unpickled(what: str, value) -> str:
    return (f"{what} holds {', '.join(sorted(_pickled_classes(value)))}; dropped: the converter "
            f"runs no pickled code, so it keeps only tensors and plain Python values")


def _clipping(osd: dict, head: dict):
    """The gradient-clipping norm: ZeRO-1/2 keep it in the optimizer file, ZeRO-3 only in
    the config (None when the config left it to DeepSpeed's version-dependent default)."""
    if "clip_grad" in osd:
        return osd["clip_grad"]
    config = head.get("ds_config")
    return config.get("gradient_clipping") if isinstance(config, dict) else None


# -- writing the zerofn checkpoint -----------------------------------------------------------
def convert(path, out, tag: str | None = None) -> tuple[str, DeepSpeedCheckpoint]:
    """Convert the DeepSpeed checkpoint at ``path`` into a zerofn checkpoint root ``out``.

    Args:
        path: a DeepSpeed save dir, or one ``global_stepN`` directory.
        out: the zerofn checkpoint root to write (created if missing); the converted
            checkpoint becomes ``out/step-N`` (N = DeepSpeed's global step) and ``latest``.
        tag: a checkpoint tag under ``path`` instead of its ``latest``.

    Returns:
        ``(directory written, the DeepSpeedCheckpoint read)``.

    Example:
        >>> convert("ds_ckpt", "zf_ckpt")                    # doctest: +SKIP
        >>> zerofn.load_checkpoint("zf_ckpt", model, opt)    # doctest: +SKIP
        {'step': 100, 'epoch': 3, 'deepspeed': {...}}
    """
    ck = read_checkpoint(path, tag)
    root, name = os.fspath(out), _step_name(ck.step)
    final, tmp = os.path.join(root, name), os.path.join(root, ".tmp-" + name)
    if os.path.exists(final):
        raise ValueError(f"{final} exists; convert into another OUT_DIR or remove it first.")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    extra = {"step": _to_bytes(ck.step), **{k: _to_bytes(v) for k, v in ck.extras.items()}}
    state = {"model": ck.model, "optim": ck.optim, "extra": extra}
    with _single_process():
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
    _publish(root, name, keep=None)
    return final, ck


def _summary(ck: DeepSpeedCheckpoint, final: str) -> str:
    n_state = len(ck.optim["state"])
    lines = [f"DeepSpeed ZeRO-{ck.stage} checkpoint {ck.path} (world size {ck.world}, "
             f"{ck.extras['deepspeed']['dtype']}, global step {ck.step})",
             f"-> {final}: {len(ck.model)} model entries, optimizer state for {n_state} "
             f"parameters in {len(ck.optim['param_groups'])} groups"
             + (", fp16 loss scale " + str(ck.optim[SCALER_KEY]["scale"]) if SCALER_KEY in ck.optim
                else ""),
             f"   extras: {', '.join(sorted(ck.extras))}"]
    return "\n".join(lines + [f"   note: {n}" for n in ck.notes])


def main(argv=None, prog: str = "python -m zerofn.deepspeed.convert") -> int:
    """The command line; ``prog`` names it in the help (a console script passes its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="DeepSpeed save dir (uses its 'latest') or a "
                                           "global_stepN directory")
    parser.add_argument("out", help="zerofn checkpoint root to write")
    parser.add_argument("--tag", help="checkpoint tag under CHECKPOINT instead of 'latest'")
    args = parser.parse_args(argv)
    try:
        final, ck = convert(args.checkpoint, args.out, args.tag)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_summary(ck, final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
