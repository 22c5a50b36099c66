"""A configuration as every front door states it, and the one place it becomes zerofn's
transforms.

The front doors (the planner's candidates and probes, ``zerofn train``, the Lightning
strategies, the DeepSpeed config) each translate their own vocabulary into a ``Config``
and nothing more: ``transforms()`` turns the stage and the options into the composed
transforms, and ``problems()`` checks the configuration by the plan's own rules
(core/plan.py's ``Plan.problems``) with no model, so a front door can refuse before any
rank starts with the words the transforms would use at set-up.

Example:
    >>> cfg = Config(3, offload={"device": "cpu", "params": True})
    >>> [repr(t) for t in cfg.transforms()][2:]
    ['zerofn.shard_params()', 'zerofn.offload()']
    >>> Config(2, offload={"device": "cpu", "params": True}).problems()[0][:32]
    'offload(params=True) offloads pa'
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import api
from .core.plan import Plan


@dataclass(frozen=True)
class Config:
    """``stage``: 0 (nothing of zerofn's: the planner's DDP), 1, 2 or 3. Each dict holds
    one transform's options by that transform's own names; None leaves it out."""
    stage: int
    sharding: dict = field(default_factory=dict)   # shard_optimizer's (every stage's)
    params: dict = field(default_factory=dict)     # shard_params's own (ZeRO-3)
    precision: dict | None = None                  # mixed_precision's
    offload: dict | None = None                    # offload's, "device" among them
    tensorboard: dict | None = None                # tensorboard's, "logdir" among them

    def transforms(self) -> list[api.Transform]:
        """The transforms, in the order a user composes them."""
        if self.params and self.stage != 3:
            raise TypeError(f"zerofn.shard_params()'s options {sorted(self.params)} were given "
                            f"at stage {self.stage}: only ZeRO-3 (stage 3) takes them.")
        out = [api.shard_optimizer(**self.sharding)] if self.stage else []
        out += [api.shard_grads()] * (self.stage >= 2)
        out += [api.shard_params(**self.params)] * (self.stage == 3)
        if self.precision is not None:
            out.append(api.mixed_precision(**self.precision))
        if self.offload is not None:
            options = dict(self.offload)
            out.append(api.offload(options.pop("device"), **options))
        if self.tensorboard is not None:
            options = dict(self.tensorboard)
            out.append(api.tensorboard(options.pop("logdir"), **options))
        return out

    def transform(self) -> api.Transform:
        return api.compose(*self.transforms())

    def plan(self) -> Plan:
        """The plan the transforms make, with no model."""
        plan = Plan()
        for t in self.transforms():
            plan = t.edit(plan)
        return plan

    def problems(self) -> list[str]:
        """The plan's rules this configuration breaks (``Plan.problems``); the stage's own
        range is the front door's to check."""
        return self.plan().problems()
