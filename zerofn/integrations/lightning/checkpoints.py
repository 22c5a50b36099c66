"""Checkpoints of both strategies: zerofn's sharded DCP checkpoint (a directory), or one
full file written by rank 0; what Lightning keeps beside the weights rides along.

A sharded checkpoint at Lightning's path ``P`` is a zerofn checkpoint root: ``P/step-N``
(the DCP checkpoint) and ``P/latest``, one checkpoint kept per path, so ``P`` is what
``zerofn consolidate`` and ``zf.load_checkpoint`` read. Lightning's own entries (epoch,
global step, loops, callbacks, LR schedulers, hyper-parameters) are one extra of it,
rank 0's, so every rank saves the same bytes.
"""
from __future__ import annotations

import os
import shutil

import torch
from torch import nn

import zerofn as zf

from ...io.consolidate import LIGHTNING_EXTRA
from ...state_dict import get_model_state_dict, set_model_state_dict

FABRIC_EXTRA = "fabric"      # Fabric's entries of the state it saves, beside the model's


def clear_other_kind(path: str, sharded: bool) -> None:
    """Rank 0, before a save: what the other state_dict_type left at ``path`` (a file where
    a directory goes, or the reverse), as Lightning replaces a checkpoint of the same name."""
    if sharded and os.path.isfile(path):
        os.remove(path)
    elif not sharded and os.path.isdir(path):
        shutil.rmtree(path)


def save_sharded(path: str, model: nn.Module, optimizer, step: int, extra: str,
                 entries: dict) -> None:
    """zerofn's checkpoint of ``model`` and ``optimizer`` at ``path``, with ``entries``
    (the same on every rank) as the extra ``extra``; every rank calls it."""
    zf.save_checkpoint(path, model, optimizer, step=step, keep=1, **{extra: entries})


def load_sharded(path: str, model: nn.Module, optimizer, extra: str) -> dict:
    """Load zerofn's checkpoint at ``path`` (any world size and stage) into ``model`` and,
    unless None, ``optimizer``; return the entries saved as ``extra``."""
    loaded = zf.load_checkpoint(path, model, optimizer, **{extra: None})
    if loaded is None:
        raise FileNotFoundError(f"{path} holds no complete zerofn checkpoint (an unfinished "
                                "save?); resume from another one.")
    return loaded[extra]


def full_state(model: nn.Module, optimizer):
    """``(model, optimizer)`` state as full tensors on the CPU, gathered on every rank; the
    optimizer's None when ``optimizer`` is."""
    if optimizer is None:
        return get_model_state_dict(model, full=True, device="cpu"), None
    return zf.get_state_dict(model, optimizer, full=True, device="cpu")


def load_full(model: nn.Module, optimizer, model_state: dict, optim_state,
              names: list[str]) -> None:
    """Full (or sharded) state into the sharded model, and the optimizer unless None.
    ``names``: the optimizer's parameters' names, in its order, for a state dict keyed by
    index (torch's own, as DDP's checkpoints hold it) rather than by name (zerofn's)."""
    if optimizer is None:
        set_model_state_dict(model, model_state)
        return
    if optim_state is None:
        raise KeyError("the checkpoint holds no optimizer state to resume from (saved with "
                       "weights only?); load it for evaluation, or resume from another one.")
    zf.set_state_dict(model, optimizer, model_state, by_name(optim_state, names))


def by_name(optim_state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index as zerofn keys it, by name."""
    groups = optim_state["param_groups"]
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optim_state
    count = sum(len(g["params"]) for g in groups)
    if count != len(names):
        raise ValueError(f"the checkpoint's optimizer holds {count} parameters, this one "
                         f"{len(names)}: it was saved from another model or optimizer.")
    return {**optim_state,
            "state": {names[i]: v for i, v in optim_state["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in groups]}


def param_names(model: nn.Module, optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters, in its order (before the transform)."""
    name_of = {p: n for n, p in model.named_parameters()}
    return [name_of[p] for g in optimizer.param_groups for p in g["params"]]


def on_meta(model: nn.Module) -> bool:
    """Built on the meta device (the transform materializes it, one rank's rows at a time)."""
    return any(p.is_meta for p in model.parameters())


def eval_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer with no state, for a model sharded to evaluate: zerofn shards a model
    together with an optimizer."""
    return torch.optim.SGD(model.parameters(), lr=0.0)
