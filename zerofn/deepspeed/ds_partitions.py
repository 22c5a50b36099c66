"""The flat partitions of a DeepSpeed ZeRO optimizer file cut back into parameters.

ZeRO-1/2 and ZeRO-3 lay a param group's parameters out in flat fp32 buffers, each rank
saving its partition of them; the functions here hold the facts of those layouts
(``zero12_params``, ``zero3_params``) and turn one flat group's partitions into full
tensors by name: the fp32 master and every per-element optimizer state.
"""
from __future__ import annotations

import math

import torch

def partition_states(osd: dict, stage: int, file: str) -> list[dict]:
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


def param_groups(osd: dict, stage: int, n_flat: int, ds_config, file: str) -> tuple[list, list]:
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


def zero12_params(shapes: dict, parts: list[dict], paddings: list, world: int, where: str) -> dict:
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


def zero3_params(shapes: dict, parts: list[dict], world: int, where: str) -> dict:
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
