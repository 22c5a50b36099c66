"""The public transforms: each is a factory of a ``Transform`` that edits a plan.

A ``Transform`` is a callable ``(model, optimizer) -> (model, optimizer)`` holding only its
options. Applying one to a model that an earlier transform already sharded rebuilds the
runtime from the combined plan, so ``t2(*t1(m, o))`` equals ``compose(t1, t2)(m, o)``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .plan import PARAM_OPTIONS, SHARED_OPTIONS, Plan

Edit = Callable[[Plan], Plan]


class Transform:
    """A composable transform: ``model, optimizer = transform(model, optimizer)``."""

    def __init__(self, name: str, edits: tuple[Edit, ...]):
        self.name = name
        self._edits = edits

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from .runtime.runtime import apply_plan
        return apply_plan(model, optimizer, self._edits)

    def __repr__(self) -> str:
        return f"zerofn.{self.name}"


def _stage_transform(name: str, stage: int, allowed: tuple[str, ...], options: dict) -> Transform:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"zerofn.{name}() got unknown option(s) {unknown}; "
                        f"it accepts {sorted(allowed)}.")
    return Transform(f"{name}()", (lambda plan: plan.with_transform(name, stage, options),))


def shard_optimizer(**options) -> Transform:
    """ZeRO-1: each rank keeps and steps only its shard of the optimizer state.

    Options (shared by all stages; give each at most once):
        group: a ProcessGroup or 1-D DeviceMesh to shard over (default: the world).
        units: how parameters are grouped for collectives: None (one unit per child of
            every ModuleList plus one for the rest), a list of submodules or their names,
            or an int (a module becomes a unit once it holds that many parameters).
        bucket_size: elements of collective buffers allowed in flight at once.
        sync_module_states: broadcast rank 0's parameters and buffers at set-up (like DDP).

    Example:
        >>> model, opt = zerofn.shard_optimizer()(model, opt)
    """
    return _stage_transform("shard_optimizer", 1, SHARED_OPTIONS, options)


def shard_grads(**options) -> Transform:
    """ZeRO-2: gradients are reduce-scattered during backward; each rank keeps its shard.

    Implies ``shard_optimizer()`` (a gradient shard is only useful to an optimizer shard).
    Takes the shared options of ``shard_optimizer``.
    """
    return _stage_transform("shard_grads", 2, SHARED_OPTIONS, options)


def shard_params(**options) -> Transform:
    """ZeRO-3: parameters are sharded too and gathered per unit only while it runs.

    Implies ``shard_grads()`` and ``shard_optimizer()``. Between steps the model's
    parameters are ``DTensor``s with ``Shard(0)``, as FSDP2's are.

    Options, besides the shared ones:
        prefetch: how many units ahead to gather while one computes (default 1).
        reshard_after_forward: free a unit's full parameters after its forward and gather
            them again in backward (default True; False trades memory for one all-gather).
        persist_below: parameters with fewer elements stay whole on every rank (like
            DeepSpeed's ``stage3_param_persistence_threshold``): no gather in forward or
            backward, their optimizer state still sharded (default 0: none).
    """
    return _stage_transform("shard_params", 3, SHARED_OPTIONS + PARAM_OPTIONS, options)


def compose(*transforms: Transform) -> Transform:
    """One transform applying all of ``transforms``; order does not matter.

    Example:
        >>> zero3 = zerofn.compose(zerofn.shard_optimizer(), zerofn.shard_grads(),
        ...                        zerofn.shard_params())
        >>> model, opt = zero3(model, opt)
    """
    for t in transforms:
        if not isinstance(t, Transform):
            raise TypeError(f"zerofn.compose() takes transforms such as zerofn.shard_params(), "
                            f"got {t!r}.")
    edits = tuple(e for t in transforms for e in t._edits)
    return Transform("compose(" + ", ".join(t.name for t in transforms) + ")", edits)
