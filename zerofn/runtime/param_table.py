"""The parameter-state table: what the runtime makes for each parameter and unit at set-up,
held by the runtime alone.

core/units.py describes the layout (a slot's shape, offset and rows; a unit's slots and
dtypes), which the planner and the checkpoints read too. What the runtime then creates
over that layout (the rows the optimizer steps, ZeRO-3's registered DTensor, a unit's flat
compute shard) is its own state, kept here, in one ``ParamTable`` per runtime, built
first and handed to every part through the context (``ctx.table``) and to the homes
through their spec (``spec.table``).

One access pattern, for reads and writes alike: ``table[slot].opt_param``,
``table[slot].sharded``, ``table[unit].shard`` (tests/test_runtime_view.py holds every
module to it, and modules outside runtime/ to the view's methods).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.units import Unit


@dataclass(eq=False)
class SlotState:
    """One parameter's runtime state (a slot of core/units.py's layout)."""

    opt_param: torch.Tensor | None = None    # what the optimizer steps: this rank's rows
    sharded: nn.Parameter | None = None      # ZeRO-3: the registered DTensor parameter


@dataclass(eq=False)
class UnitState:
    """One unit's runtime state."""

    shard: torch.Tensor | None = None        # ZeRO-3: this rank's compute rows, flat


class ParamTable:
    """``table[slot]`` -> its ``SlotState``, ``table[unit]`` -> its ``UnitState``; an entry
    is made empty (every field None) the first time its key is asked for, as the fields
    began when they were the layout's."""

    def __init__(self):
        self._of: dict = {}

    def __getitem__(self, key) -> SlotState | UnitState:
        entry = self._of.get(key)
        if entry is None:
            entry = self._of[key] = UnitState() if isinstance(key, Unit) else SlotState()
        return entry
