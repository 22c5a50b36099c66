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
from .param_table import ParamTable
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
    # groups=: each pattern's own group's collectives, and the whole data-parallel size its
    # summed gradients are divided by ([Note: a module's own group] in core/units.py).
    own: dict = field(default_factory=dict)    # pattern -> (Comm, dp_world)
    saves: SaveReads = field(default_factory=SaveReads)   # background saves reading state
    table: ParamTable = field(default_factory=ParamTable)  # each slot's and unit's made state

    def comm_of(self, unit: Unit) -> Comm:
        """The collectives a unit is gathered and reduced over: its own group's where
        ``groups=`` gave its module one, else the shard group's."""
        return self.comm if unit.group is None else self.own[unit.group][0]

    @property
    def comms(self) -> list[Comm]:
        """Every group's collectives, the shard group's first: each keeps its own queue."""
        return [self.comm] + [comm for comm, _ in self.own.values()]

    def divisor(self, unit: Unit) -> int:
        """What a unit's summed gradient is divided by to average it over the global batch
        (1 where the collective averaged it already).

        [Note: experts' gradients] An expert's gradient is summed over its own group only
        (the ranks holding the same experts), yet it already holds the gradients of the
        tokens every data-parallel rank sent it (expert parallelism's all-to-all brought
        them, and its backward sent theirs back): it is divided by the whole data-parallel
        size, the global batch's mean as for the dense weights."""
        comm = self.comm_of(unit)
        if unit.group is not None:   # (NCCL's reduce-scatter averaged over its own ranks)
            return self.own[unit.group][1] // (comm.world if comm.averages else 1)
        divisor = 1 if comm.averages else comm.world
        if self.replicas is not None and not self.replicas.averages:   # summed over replicas
            divisor *= self.replicas.world
        return divisor

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
