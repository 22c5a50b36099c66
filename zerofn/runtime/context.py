"""What a runtime's parts share, as one object: the device, the plan, the groups and their
collectives, the buffer pool, the copy streams, the observers and the units. Built once,
first, by the runtime, and handed to each part it composes (the reducer, the step's
gradients, the gatherer, the shards, the forward hooks, the step), as FSDP2's
``FSDPCommContext`` is shared by its parameter groups: no part takes ten arguments, and
none reaches another through its owner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.plan import Plan
from ..core.units import Unit
from .comm import Comm
from .copies import CopyStreams
from .events import Observers
from .mesh import Groups
from .pool import BufferPool
from .save_reads import SaveReads


@dataclass(frozen=True)
class RuntimeContext:
    device: torch.device        # where the model computes
    plan: Plan                  # what the transforms asked for
    groups: Groups              # the shard, replicate and every-rank groups; mesh, placements
    comm: Comm                  # the shard group's collectives, counted
    replicas: Comm | None       # HSDP's replicate group's, else None
    pool: BufferPool            # gathered units, send buffers, reduction temporaries
    copies: CopyStreams         # copies between host and device, ordered per unit
    observers: Observers        # told what happens; their timing and guard serve the parts
    units: tuple[Unit, ...]     # the model's units, the root last
    param_order: dict           # a parameter's name -> its index in model.named_parameters()
    saves: SaveReads = field(default_factory=SaveReads)   # background saves reading state

    @property
    def timing(self):
        """Labels (and under a monitor times) the parts' regions (timing.py)."""
        return self.observers.timing

    @property
    def guard(self):
        """Wraps the entry points backward's hooks and the step go through (events.py)."""
        return self.observers.guard

    @property
    def stage(self) -> int:
        return self.plan.stage
