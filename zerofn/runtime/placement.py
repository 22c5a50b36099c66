"""offload(ratio="auto"): after the first step, as many units as the device budget holds
move their optimizer state to the device; then the placement stays.

[Note: placing by the first step] Set-up puts every unit on the host (an arena each, so a
moved unit's host memory goes back), or, with ``host_budget``, those beyond it in the swap
file (homes/assignment.py). The first step shows what the device needs besides optimizer
state: parameters, gradients, buffers and the activations' peak. What the budget leaves
beyond that peak goes to the host's units in parameter order ([Note: which units stay] in
homes/assignment.py), each costing its masters and the optimizer's two moments in the
masters' dtype. The ranks take the smallest count any of them can hold (one all-reduce),
and the units move once. On CUDA the peak is the caching allocator's; on a CPU device,
where the host is the device, it is the process's peak resident memory less what the
host's homes hold.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .memory import proc_bytes
from .homes import in_parameter_order

DEFAULT_SHARE = 0.9     # of the device memory free at set-up, where no budget is given


class AutoPlacement:
    """Decides and makes ratio="auto"'s placement, once, after the first step."""

    def __init__(self, ctx, homes, optimizer):
        self.ctx, self.homes, self.optimizer = ctx, homes, optimizer
        self.budget = self._bytes(ctx.plan.offload.device_budget)
        self.placed = False
        self.reason = ""

    def _bytes(self, budget) -> int:
        if isinstance(budget, int):
            return budget
        device = self.ctx.device
        free, _ = torch.cuda.mem_get_info(device)
        return torch.cuda.memory_allocated(device) + int((budget or DEFAULT_SHARE) * free)

    def after_step(self) -> None:
        if self.placed:
            return
        self.placed = True
        peak = self._peak()
        candidates = in_parameter_order([u for u in self.ctx.units if u.slots
                                         and self.homes.home_of(u) == "host"],
                                        self.ctx.param_order)
        count, used = 0, 0
        for u in candidates:
            cost = self._cost(u)
            if used + cost > self.budget - peak:
                break
            count, used = count + 1, used + cost
        count = self._agree(count)
        self.homes.move(candidates[:count], self.optimizer)
        self.reason = (f"ratio auto: first step's device peak {peak / 2**20:,.0f} MiB of a "
                       f"{self.budget / 2**20:,.0f} MiB budget; {count} of {len(candidates)} "
                       f"units moved their optimizer state to the device "
                       f"({used / 2**20:,.0f} MiB)")

    def _peak(self) -> int:
        device = self.ctx.device
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        # the host is the device: the process's peak, less what the homes hold there
        held = sum(a.buffer.nbytes for a in self.homes.arenas() if hasattr(a, "buffer"))
        return proc_bytes("VmHWM") - held

    @staticmethod
    def _cost(unit) -> int:
        """A unit's device bytes once moved: its masters and the optimizer's two moments,
        in the masters' dtype."""
        return unit.shard_numel * 3 * unit.master_dtype.itemsize

    def _agree(self, count: int) -> int:
        t = torch.tensor([count], device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctx.groups.everyone)
        return int(t.item())
