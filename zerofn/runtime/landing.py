"""Where a unit's reduced gradient rows go as soon as they are final, during backward.

Under offload they land in the unit's host buffer: ZeRO-2/3 start that copy during
backward, as soon as the unit's shard is reduced (``shard_ready``), so it overlaps the
backward of the units still to come; ZeRO-1, which reduces in the step, starts every
unit's copy before waiting for the first (step_grads.py). Where the offload brings
gradients down in its own step (homes/ring.py's [Note: the host ring]) nothing lands
here: the step reads the device's rows, and the offload copies them.
"""
from __future__ import annotations

import torch


class Landing:
    """Where each unit's reduced gradient rows go as soon as they are final: the landing
    buffer of the home that takes them during backward (``homes.grads``), copied there on
    the copy stream while backward goes on; a unit with none keeps them on the device until
    the step. Under ``overlap_step`` a landed unit is handed to the host's Adam at once
    (overlap.py). Built before the reducer, which tells it of each final shard.

    ``crosses``: some unit's state lives off the device (its gradient shards are then lent
    from the pool, grads.py's [Note: lent gradient shards]).
    """

    def __init__(self, ctx, homes, visible, early=None):
        self.homes, self.visible, self.early, self.copies = homes, visible, early, ctx.copies
        self.crosses = any(homes.home_of(u) != "device" for u in ctx.units if u.slots)
        self.streamed: set = set()    # units whose shard is on its way to its home

    def shard_ready(self, unit, shard: torch.Tensor, got: set) -> None:
        """A backward's reduced shard of ``unit`` is final; copy it to its home now. Under
        accumulation each backward copies again: the shard sums on the device and the last
        copy is the one the step reads. (A unit without a landing buffer crosses in its
        home's step; ``got``: the parameters that got a gradient on this rank.)"""
        if unit not in self.homes.grads:
            return
        self.copies.to_host(unit, self.homes.grads[unit], shard)
        self.streamed.add(unit)
        self.visible.watch(unit)     # the loop's edits must reach the copy
        if self.early is not None:
            self.early.landed(unit, got)

    def wait(self, units) -> None:
        for unit in units:
            self.copies.host_wait(unit)
        self.streamed.clear()
