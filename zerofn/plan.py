"""The plan: a frozen description of what the composed transforms ask for.

Transforms never touch a model themselves; each one edits a Plan, and the runtime is
built from the finished plan. This is what makes applying transforms one at a time and
through ``compose`` give the same result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Options shared by every stage: a transform that names one sets it for the whole plan.
SHARED_OPTIONS = ("group", "units", "bucket_size", "sync_module_states", "init", "timeout")
PARAM_OPTIONS = ("prefetch", "reshard_after_forward", "persist_below")
OFFLOAD_OPTIONS = ("offload", "offload_path", "offload_params", "units_in_flight")
MONITOR_OPTIONS = ("tensorboard", "tensorboard_every", "tensorboard_ranks", "tensorboard_csv",
                   "profile", "memory_snapshot")
PRECISION_OPTIONS = ("param_dtype", "reduce_dtype", "loss_scale", "initial_scale_power",
                     "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                     "min_loss_scale")
DEFAULTS = {
    "group": None,
    "units": None,
    "bucket_size": 4_000_000,
    "sync_module_states": True,
    "init": None,
    "timeout": None,
    "prefetch": 1,
    "reshard_after_forward": True,
    "persist_below": 0,
    "param_dtype": None,
    "reduce_dtype": None,
    "loss_scale": None,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1.0,
    "offload": None,
    "offload_path": None,
    "offload_params": False,
    "units_in_flight": 2,
    "tensorboard": None,
    "tensorboard_every": 10,
    "tensorboard_ranks": (0,),
    "tensorboard_csv": None,
    "profile": None,
    "memory_snapshot": 0,
}


@dataclass(frozen=True)
class Plan:
    """What to shard, and how.

    ``stage`` is 0 (nothing), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
    ``applied`` names the transforms applied so far, so a second application is caught.
    ``options`` holds the explicitly given options; ``option(name)`` falls back to defaults.
    """

    stage: int = 0
    applied: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def option(self, name: str) -> Any:
        return self.options.get(name, DEFAULTS[name])

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

    def describe(self) -> list[str]:
        """The plan as lines compared across ranks at set-up, one per option, so a mismatch
        names the option. The group and the NVMe path may differ by rank (a local drive)."""
        opts = {k: self.option(k) for k in DEFAULTS if k not in ("group", "offload_path")}
        opts["units"] = _describe_units(opts["units"])
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
