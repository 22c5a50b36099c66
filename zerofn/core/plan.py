"""The plan: a frozen description of what the composed transforms ask for.

Transforms never touch a model themselves; each one edits a Plan, and the runtime is
built from the finished plan. This is what makes applying transforms one at a time (a
sharding transform first) and through ``compose`` (any order) give the same result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ShardingPolicy:
    """How parameters are grouped and sharded (every stage; ZeRO-3's own options last)."""
    group: Any = None                  # ProcessGroup, 1-D or 2-D (HSDP) DeviceMesh, or None
    groups: Any = None                 # {module name or pattern: 1-D DeviceMesh} (experts)
    units: Any = None                  # None, submodules or their names, or an int
    bucket_size: int = 4_000_000       # elements of collective buffers in flight
    sync_module_states: bool = True
    init: Any = None                   # a meta-built model's initializer
    timeout: float | None = None       # seconds a collective may wait
    stall_warning: float | None = 60.0  # seconds in one wait before it is logged
    on_nonfinite: str | None = None    # "skip", "raise", "ignore"; None: nonfinite_rule()'s
    prefetch: int = 1                  # ZeRO-3: units gathered ahead
    reshard_after_forward: bool = True
    persist_below: int = 0             # ZeRO-3: parameters kept whole below this size
    reduce_to_owner: bool = False      # ZeRO-3: owned gradients reduced to their owner


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute, all-gather and reduction dtypes, and fp16 loss scaling (DeepSpeed's)."""
    param_dtype: Any = None            # None: the parameters' own
    reduce_dtype: Any = None           # None: the compute dtype
    cast_forward_inputs: bool = True   # floating inputs of the model's forward to param_dtype
    loss_scale: float | None = None    # a static scale; None: dynamic for fp16
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OffloadPolicy:
    """Where master rows and optimizer state live off the device (None: on it)."""
    device: str | None = None          # "cpu" or "nvme"
    path: str | None = None            # NVMe: the swap file's directory
    params: bool = False               # ZeRO-3: parameter shards too
    units_in_flight: int = 2           # NVMe: the staging ring's buffers
    state_dtype: Any = torch.float32   # Adam's moments: fp32, bf16 or int8 (8-bit codes)
    master_dtype: Any = torch.float32  # master rows: fp32 or bf16 (stochastic rounding)
    seed: int = 0                      # the stochastic rounding's random stream
    ratio: Any = 1.0                   # the share of the optimizer state offloaded, or "auto"
    device_budget: Any = None          # ratio="auto": device bytes, or a share of free memory
    host_budget: Any = None            # ratio="auto" with NVMe: host bytes for the state
    placement: Any = None              # {unit name or pattern: "device" | "host" | "nvme"}
    overlap_step: bool = False         # the host steps each unit during backward


@dataclass(frozen=True)
class MonitorPolicy:
    """zf.tensorboard: where and how often the run is logged."""
    log_dir: str | None = None         # None: no monitor
    every: int = 10
    ranks: Any = (0,)
    csv: str | None = None
    profile: Any = None
    memory_snapshot: int = 0


# Where a unit's master rows and optimizer state live, nearest the compute first: its
# home (one name for it everywhere).
HOMES = ("device", "host", "nvme")

# Each option a transform takes: (the policy it sets, its field there).
OPTION_FIELDS = {
    **{f.name: ("sharding", f.name) for f in dataclasses.fields(ShardingPolicy)},
    **{f.name: ("precision", f.name) for f in dataclasses.fields(PrecisionPolicy)},
    "offload": ("offload", "device"), "offload_path": ("offload", "path"),
    "offload_params": ("offload", "params"), "units_in_flight": ("offload", "units_in_flight"),
    "state_dtype": ("offload", "state_dtype"), "master_dtype": ("offload", "master_dtype"),
    "offload_seed": ("offload", "seed"), "offload_ratio": ("offload", "ratio"),
    "overlap_step": ("offload", "overlap_step"), "device_budget": ("offload", "device_budget"),
    "host_budget": ("offload", "host_budget"), "offload_placement": ("offload", "placement"),
    "tensorboard": ("monitor", "log_dir"), "tensorboard_every": ("monitor", "every"),
    "tensorboard_ranks": ("monitor", "ranks"), "tensorboard_csv": ("monitor", "csv"),
    "profile": ("monitor", "profile"), "memory_snapshot": ("monitor", "memory_snapshot"),
}
POLICIES = {"sharding": ShardingPolicy, "precision": PrecisionPolicy,
            "offload": OffloadPolicy, "monitor": MonitorPolicy}
# The options each transform accepts (shared ones set the whole plan: give each once).
SHARED_OPTIONS = ("group", "groups", "units", "bucket_size", "sync_module_states", "init",
                  "timeout", "stall_warning", "on_nonfinite")
NONFINITE_RULES = ("skip", "raise", "ignore")
PARAM_OPTIONS = ("prefetch", "reshard_after_forward", "persist_below", "reduce_to_owner")
OFFLOAD_OPTIONS = ("offload", "offload_path", "offload_params", "units_in_flight", "state_dtype",
                   "master_dtype", "offload_seed", "offload_ratio", "overlap_step",
                   "device_budget", "host_budget", "offload_placement")
MONITOR_OPTIONS = ("tensorboard", "tensorboard_every", "tensorboard_ranks", "tensorboard_csv",
                   "profile", "memory_snapshot")
PRECISION_OPTIONS = tuple(f.name for f in dataclasses.fields(PrecisionPolicy))


@dataclass(frozen=True)
class Plan:
    """What to shard, and how.

    ``stage`` is 0 (nothing), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
    ``applied`` names the transforms applied so far, so a second application is caught.
    ``options`` holds the options given, by the transforms' names for them (checked for
    conflicts, compared across ranks); the policies read them as frozen dataclasses.
    """

    stage: int = 0
    applied: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    sharding = property(lambda self: self._policy("sharding"), doc="ShardingPolicy")
    precision = property(lambda self: self._policy("precision"), doc="PrecisionPolicy")
    offload = property(lambda self: self._policy("offload"), doc="OffloadPolicy")
    monitor = property(lambda self: self._policy("monitor"), doc="MonitorPolicy")

    def _policy(self, name: str):
        given = {f: self.options[o] for o, (p, f) in OPTION_FIELDS.items()
                 if p == name and o in self.options}
        return POLICIES[name](**given)

    def with_transform(self, name: str, stage: int, options: dict[str, Any]) -> "Plan":
        if name in self.applied:
            raise ValueError(
                f"zerofn.{name}() was applied twice to the same model. Apply each transform "
                "once; to change its options, build the model and optimizer afresh.")
        merged = dict(self.options)
        for key, value in options.items():
            if key in merged and merged[key] is not value and merged[key] != value:
                raise ValueError(
                    f"zerofn.{name}(): option {key}={value!r} conflicts with {key}="
                    f"{merged[key]!r} given to an earlier transform. Give it once.")
            merged[key] = value
        return dataclasses.replace(
            self, stage=max(self.stage, stage), applied=self.applied + (name,), options=merged)

    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16's dynamic scaling, or a static ``loss_scale``)."""
        return self.precision.loss_scale is not None or self.precision.param_dtype == torch.float16

    def nonfinite_rule(self) -> str:
        """What a step whose gradients hold inf or nan does: the ``on_nonfinite`` given, else
        "skip", or "raise" under ``overlap_step`` (whose host steps units before any rank
        can know: no skip can be kept there). Under fp16 loss scaling "skip" is the loss
        scaler's (which also lowers the scale); the other two are refused there at set-up."""
        given = self.sharding.on_nonfinite
        if given is not None:
            return given
        return "raise" if self.offload.overlap_step else "skip"

    def problems(self) -> list[str]:
        """The configuration rules this plan breaks, each as the sentence a user reads: the
        rules that need no model, stated here once for every front door (the transforms at
        set-up, ``zerofn train`` before any rank starts, the planner's candidates, the
        Lightning and DeepSpeed translations: config.py). What needs the model, the device
        or the optimizer is checked at set-up by the runtime."""
        out = []
        if self.stage == 0 and self.applied:
            out.append(f"{self.applied[-1]}() shards nothing by itself: compose it with a "
                       "sharding transform, e.g. zerofn.compose(zerofn.shard_optimizer(), "
                       f"zerofn.{self.applied[-1]}(...)).")
        if self.offload.params and 0 < self.stage < 3:
            out.append("offload(params=True) offloads parameter shards, which only ZeRO-3 "
                       "has: add zerofn.shard_params(), or drop params=True.")
        if self.offload.master_dtype == torch.bfloat16 and \
                self.precision.param_dtype != torch.bfloat16:
            out.append("offload(master_dtype=torch.bfloat16): bf16 masters are the rows the "
                       "device computes with, so the compute dtype must be bf16: add "
                       "zf.mixed_precision(torch.bfloat16).")
        return out + self._nonfinite_problems()

    def _nonfinite_problems(self) -> list[str]:
        """What ``on_nonfinite`` cannot keep under this plan (runtime/step_grads.py's [Note:
        the non-finite guard])."""
        given = self.sharding.on_nonfinite
        if self.scales_loss() and given in ("raise", "ignore"):
            return [f"on_nonfinite={given!r}: under loss scaling (fp16, or a static loss_scale) "
                    "the scaler skips a step whose gradients overflow and lowers the scale, "
                    "which is how it finds its scale; leave on_nonfinite unset (or 'skip'), "
                    "or compute in bf16."]
        if self.offload.overlap_step and self.nonfinite_rule() == "skip":
            return ["on_nonfinite='skip': offload(overlap_step=True) steps units on the host "
                    "during backward, before any rank knows whether a gradient is non-finite, "
                    "so the step cannot be skipped; use 'raise' (the default there: it stops "
                    "the run naming the step and the parameter) or 'ignore'."]
        return []

    def describe(self) -> list[str]:
        """The plan as lines compared across ranks at set-up, one per option, so a mismatch
        names the option. The group and the NVMe path may differ by rank (a local drive), as
        do the meshes ``groups`` names (compared by their patterns)."""
        policies = {name: getattr(self, name) for name in POLICIES}
        opts = {o: getattr(policies[p], f) for o, (p, f) in OPTION_FIELDS.items()
                if o not in ("group", "offload_path")}
        opts["units"] = _describe_units(opts["units"])
        opts["groups"] = None if opts["groups"] is None else sorted(map(str, opts["groups"]))
        opts["init"] = _describe_init(opts["init"])
        return [f"stage={self.stage}"] + [f"{k}={opts[k]!r}" for k in sorted(opts)]


def _describe_init(init) -> str:
    """A bound method's repr holds its address, which differs per process."""
    if init is None:
        return "reset_parameters"
    return getattr(init, "__qualname__", type(init).__name__)


def _describe_units(units: Any) -> Any:
    if units is None or isinstance(units, int):
        return units
    return tuple(u if isinstance(u, str) else type(u).__name__ for u in units)
