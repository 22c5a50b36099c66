"""A candidate: one way to train a model, as the planner weighs it and ``zf.auto`` applies
it. Every choice the plan searches is a field here, and ``apply`` is the one place that
turns a candidate into zerofn's transforms (or, for stage 0, into DDP), so what the plan
predicts is what a run with its choice builds (tools/plan_accuracy.py measures it so).

Stage 0 is what zerofn does not do itself: plain data parallelism, torch's
``DistributedDataParallel`` (a single process trains the model as it is). Stages 1 to 3
are zerofn's ZeRO-1, ZeRO-2 and ZeRO-3.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from zerofn import api as zf
from zerofn.config import Config
from zerofn.core.units import default_unit_modules

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int8": torch.int8}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Candidate:
    """One configuration of a run: what to shard, where the state lives, in which dtypes,
    whether to recompute activations, and how the rank's batch is split.

    Attributes:
        stage: 0 (DDP), 1, 2 or 3.
        precision: the compute dtype, "fp32", "bf16" or "fp16" (masters and Adam state
            fp32 unless offloaded in fewer bits).
        offload: None, "cpu" or "nvme".
        params: ZeRO-3 with offload: the parameter shards too.
        ratio: the share of the optimizer state offloaded (the units first in parameter
            order keep the rest on the device).
        state_dtype, master_dtype: how offloaded Adam moments and masters are stored.
        checkpoint: activation checkpointing of every unit but the root.
        micro_batch: sequences per micro-batch on each rank.
        accum: micro-batches per optimizer step: under DDP and ZeRO-1 all but the last
            under ``no_sync``; ZeRO-2 and ZeRO-3 reduce each (``PlanResult.micro_batches``).
        to_owner: ZeRO-3's ``shard_params(reduce_to_owner=True)``: a whole-tensor
            optimizer's gradients reduced whole to their owners (not with NVMe).
    """

    stage: int
    precision: str = "fp32"
    offload: str | None = None
    params: bool = False
    ratio: float = 1.0
    state_dtype: str = "fp32"
    master_dtype: str = "fp32"
    checkpoint: bool = False
    micro_batch: int = 1
    accum: int = 1
    to_owner: bool = False

    def problems(self, world: int) -> list[str]:
        """Why zerofn cannot run this candidate (its own set-up refuses the same)."""
        out = []
        if self.stage not in (0, 1, 2, 3):
            out.append(f"stage {self.stage}: 0 (DDP), 1, 2 or 3")
        if self.offload is None and (self.params, self.state_dtype, self.master_dtype,
                                     self.ratio) != (False, "fp32", "fp32", 1.0):
            out.append("params, stored dtypes and ratio describe an offload")
        elif self.stage in (1, 2, 3) or (self.stage == 0 and self.offload is not None):
            out += self.config().problems()
        if (self.state_dtype, self.master_dtype) != ("fp32", "fp32") and \
                self.precision == "fp32":
            out.append("low-precision offloaded state needs mixed precision (fp32 masters)")
        if self.params and self.ratio != 1.0:
            out.append("params=True offloads every unit's shard: ratio 1")
        if self.to_owner and (self.stage != 3 or self.offload == "nvme"):
            out.append("reduce_to_owner is ZeRO-3's (shard_params), not with offload('nvme')")
        if min(self.micro_batch, self.accum) < 1:
            out.append("micro_batch and accum are at least 1")
        return out

    def config(self, nvme_path: str | None = None, init=None) -> Config:
        """This candidate as zerofn's configuration (``init``: a meta-built model's)."""
        offload = None if self.offload is None else dict(
            device=self.offload, params=self.params, ratio=self.ratio,
            path=nvme_path if self.offload == "nvme" else None,
            state_dtype=DTYPES[self.state_dtype], master_dtype=DTYPES[self.master_dtype])
        return Config(self.stage, sharding={} if init is None else {"init": init},
                      params={"reduce_to_owner": True} if self.to_owner and self.stage == 3
                      else {},
                      precision=None if self.precision == "fp32" else
                      {"param_dtype": DTYPES[self.precision]}, offload=offload)

    def transforms(self, nvme_path: str | None = None, init=None) -> list:
        """zerofn's transforms for stages 1 to 3 (none for stage 0)."""
        if self.offload == "nvme" and not nvme_path:
            raise ValueError("this plan offloads to NVMe: give nvme_path (a directory on "
                             "the drive).")
        return self.config(nvme_path, init).transforms()

    def apply(self, model: nn.Module, optimizer, nvme_path: str | None = None, init=None):
        """``(model, optimizer)`` set up as this candidate asks: activation checkpointing on
        the units' modules, then zerofn's transforms, or for stage 0 DDP over the world
        (the model as it is in a single process, cast to the compute dtype)."""
        if self.checkpoint:
            checkpoint_units(model)
        if self.stage:
            return zf.compose(*self.transforms(nvme_path, init))(model, optimizer)
        if self.precision != "fp32":
            raise ValueError("stage 0 (DDP) here trains in fp32: zerofn's mixed precision "
                             "needs a sharded optimizer (stage 1 or more).")
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() > 1:
            model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False,
                                                        gradient_as_bucket_view=True)
        return model, optimizer

    def describe(self) -> str:
        """One line, as the plan's table and ``zf.auto`` name the choice."""
        what = "DDP" if self.stage == 0 else f"ZeRO-{self.stage}"
        parts = [what, self.precision]
        if self.offload:
            off = f"offload {self.offload}" + (" params" if self.params else "")
            if self.ratio != 1.0:
                off += f" ratio {self.ratio:g}"
            if (self.state_dtype, self.master_dtype) != ("fp32", "fp32"):
                off += f" ({self.master_dtype} masters, {self.state_dtype} moments)"
            parts.append(off)
        if self.to_owner:
            parts.append("reduce to owner")
        if self.checkpoint:
            parts.append("checkpointing")
        parts.append(f"{self.micro_batch}x{self.accum}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Candidate":
        return cls(**data)


def checkpoint_units(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on each of zerofn's default units' modules (a
    transformer's blocks), in place: the parameters keep their names. A module that already
    recomputes its own activations (``checkpoint`` set, as zerofn.nanogpt's blocks take
    it) is told to instead of wrapped twice."""
    from torch.distributed._composable import checkpoint
    for module in default_unit_modules(model):
        if isinstance(getattr(module, "checkpoint", None), bool):
            module.checkpoint = True
        else:
            checkpoint(module)


def matches(candidate: Candidate, **fixed) -> bool:
    """Whether ``candidate`` has every field ``fixed`` names (a pattern for strings)."""
    for key, value in fixed.items():
        mine = getattr(candidate, key)
        if isinstance(value, str) and isinstance(mine, str):
            if not fnmatch.fnmatch(mine, value):
                return False
        elif mine != value:
            return False
    return True
