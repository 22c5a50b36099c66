"""Optimizer offload: master params and optimizer state on the host, the step in C++.

[Note: one arena] Every unit's host buffers are views of a few allocations made at
set-up (one per dtype: a unit's masters and state keep its parameters' dtype),
page-locked at their exact size when the runtime's device is CUDA (page-locked memory is
what lets copies overlap; see [Note: exact pinning] in pinned.py for why not
``pin_memory()``). On a CPU device, GPU or not, the same code runs on plain host memory
with synchronous copies.

For Adam and AdamW the step runs in ``zerofn.optim.adam_step`` over each parameter's rows
of the unit's flat buffers (fp32 masters; a unit of another dtype steps as torch.optim's
own Adam does, in its dtype); their views are registered as the optimizer's own state
(``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts see nothing different. Any other
torch.optim optimizer steps the host masters itself.
"""
from __future__ import annotations

import torch

from ..optim import adam_step
from ..optim.cpu_adam import CPUAdam
from .pinned import host_buffer, pins
from .timing import UNTIMED
from .units import Unit

ALIGN = 64   # elements: keeps every view 256-byte aligned for the vector kernels


class HostArena:
    """One host allocation handed out as aligned views; never freed while training.
    Page-locked (exactly its size) when ``pin``."""

    def __init__(self, sizes: list[int], dtype: torch.dtype | None, pin: bool = False):
        total = sum(_aligned(n) for n in sizes)
        # (units without parameters have no dtype; they take no room either)
        self.buffer = host_buffer(total, dtype or torch.float32, pin)
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        view = self.buffer[self._used:self._used + numel]
        self._used += _aligned(numel)
        return view

    def holds(self, t: torch.Tensor) -> bool:
        start = self.buffer.untyped_storage().data_ptr()
        return start <= t.untyped_storage().data_ptr() < start + self.buffer.nbytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def device_of(units) -> torch.device:
    """The device the units compute on (the CPU for a model without parameters)."""
    return next((u.device for u in units if u.device is not None), torch.device("cpu"))


def fused_adam_mode(optimizer) -> bool | None:
    """``adamw_mode`` for optimizers zerofn's CPU Adam can step for them, else None."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, CPUAdam):
        return None
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("capturable") or g.get("differentiable"):
            return None
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.param_groups[0].get("decoupled_weight_decay", False))


class HostOffload:
    """Per unit on the host: master rows, a gradient landing buffer and, for Adam, its state."""

    timing = UNTIMED     # runtime/timing.py

    def __init__(self, units: list[Unit], grad_dtype_of, optimizer, compute_dtype=None):
        self.adamw_mode = fused_adam_mode(optimizer)
        self.pin = pins(device_of(units))
        # (units without parameters have no dtype; they take no room either)
        self.master_dtype = {u: u.dtype or torch.float32 for u in units}
        self.compute_dtype = {u: compute_dtype or self.master_dtype[u] for u in units}
        self.master, self.exp_avg, self.exp_avg_sq = {}, {}, {}
        self._arenas = []
        for dtype, mine in _by_dtype(self.master_dtype).items():
            states = [self.master] + ([self.exp_avg, self.exp_avg_sq]
                                      if self.adamw_mode is not None else [])
            arena = HostArena([u.shard_numel for u in mine] * len(states), dtype, self.pin)
            for state in states:
                state.update({u: arena.take(u.shard_numel) for u in mine})
            self._arenas.append(arena)
        self._units = units
        self._steps = None
        # Under mixed precision the compute copy is kept in this (pinned) arena, where CPU
        # Adam writes it in its pass (another optimizer's rows are cast into it): what goes
        # back to the device is already in its dtype, and page-locked. A copy that also
        # casts would cast on the host into pageable memory and hold the step meanwhile.
        # Under parameter offload this copy is the parameter shard (``param_shard``).
        self.lowp = {}
        lowp = [u for u in units if self.compute_dtype[u] != self.master_dtype[u]]
        for dtype, mine in _by_dtype({u: self.compute_dtype[u] for u in lowp}).items():
            arena = HostArena([u.shard_numel for u in mine], dtype, self.pin)
            self.lowp.update({u: arena.take(u.shard_numel) for u in mine})
            self._arenas.append(arena)
        self.grad_arenas = {}
        self.grads = {}
        for u in units:
            dtype = grad_dtype_of(u)
            self.grad_arenas.setdefault(dtype, []).append(u)
        for dtype, us in list(self.grad_arenas.items()):
            arena = HostArena([u.shard_numel for u in us], dtype, self.pin)
            self.grad_arenas[dtype] = arena
            self.grads.update({u: arena.take(u.shard_numel) for u in us})

    def param_shard(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """ZeRO-3 parameter offload: the unit's compute shard on the host is the copy the
        step writes, the compute-dtype rows (or the masters themselves, in their dtype):
        no second host copy of the rows, and no copy into it after each step."""
        assert dtype == self.compute_dtype[unit], (unit.name, dtype)   # one plan made both
        lowp = self.lowp.get(unit)
        return self.master[unit] if lowp is None else lowp.copy_(self.master[unit])

    def arenas(self) -> list[HostArena]:
        return [a for a in (*self._arenas, self._steps, *self.grad_arenas.values()) if a]

    def compute_rows(self, unit: Unit) -> torch.Tensor:
        """Where the updated compute rows of a unit are read from after a step. CPU Adam
        writes the compute copy in its pass; a torch optimizer stepped the masters only,
        so they are cast into it first."""
        lowp = self.lowp.get(unit)
        if lowp is None:
            return self.master[unit]
        if self.adamw_mode is None:
            lowp.copy_(self.master[unit])
        return lowp

    def recast(self) -> None:
        """After masters changed outside a step (a load): the compute copies follow. (A
        torch optimizer's are cast whenever they are read, by ``compute_rows``.)"""
        if self.adamw_mode is None:
            return
        for u, lowp in self.lowp.items():
            lowp.copy_(self.master[u])

    def register_state(self, optimizer) -> None:
        """Hand the optimizer views of the flat Adam state, so its state dict is the usual."""
        if self.adamw_mode is None:
            return
        units = self._units
        trainable = [s for u in units for s in u.trainable]
        self._steps = HostArena([1] * len(trainable), torch.float32)
        for u in units:
            for s in u.trainable:
                before = optimizer.state.get(s.opt_param, {})
                state = {"step": self._steps.take(1).view(()),
                         "exp_avg": s.shard_of(self.exp_avg[u]),
                         "exp_avg_sq": s.shard_of(self.exp_avg_sq[u])}
                for k, v in before.items():   # state the optimizer had (e.g. loaded) moves in
                    state[k].copy_(v)
                optimizer.state[s.opt_param] = state

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0) -> None:
        """Adam over every parameter that has a gradient, from the host gradient rows, unit
        by unit; ``after_unit(unit, rows)`` gets each unit's updated compute rows at once.
        Gradients are multiplied by ``grad_scale`` (unscale x clip) in the kernel."""
        group_of = groups_by_param(optimizer)
        for u in self._units:
            adam_unit(optimizer, group_of, u, grads, self.master[u], self.exp_avg[u],
                      self.exp_avg_sq[u], self.adamw_mode, self.lowp.get(u), grad_scale,
                      self.timing)
            after_unit(u, self.compute_rows(u))


def _by_dtype(dtype_of: dict) -> dict:
    """``{dtype: [units]}`` from ``{unit: dtype}``, in the units' order."""
    out: dict = {}
    for u, dtype in dtype_of.items():
        out.setdefault(dtype, []).append(u)
    return out


def groups_by_param(optimizer) -> dict:
    return {p: g for g in optimizer.param_groups for p in g["params"]}


def adam_unit(optimizer, group_of: dict, unit: Unit, grads: dict, master, exp_avg, exp_avg_sq,
              adamw_mode: bool, lowp=None, grad_scale: float = 1.0, timing=UNTIMED) -> list:
    """zerofn's CPU Adam over each of the unit's parameters that has a gradient, on the
    rows of flat master and state buffers, with that parameter's group hyperparameters
    and its own step count (as torch.optim keeps them); each gradient times
    ``grad_scale`` as it is read. Returns the slots whose rows it wrote (into ``lowp``
    too, in its dtype, where given)."""
    with timing.span("cpu_adam", "cpu_adam", unit.name):   # profiles show it against copies
        return _adam_slots(optimizer, group_of, unit, grads, master, exp_avg, exp_avg_sq,
                           adamw_mode, lowp, grad_scale)


def _adam_slots(optimizer, group_of, unit, grads, master, exp_avg, exp_avg_sq, adamw_mode,
                lowp, grad_scale) -> list:
    written = []
    for s in unit.trainable:
        g, group = grads.get(s), group_of.get(s.opt_param)
        if g is None or group is None:
            continue
        state = optimizer.state[s.opt_param]
        # Counted where this rank holds no rows too, as torch.optim counts an empty
        # parameter's steps: every rank's count, and every checkpoint's, is the same.
        state["step"] += 1
        if not s.local_numel:
            continue
        written.append(s)
        kernel = adam_step if master.dtype == torch.float32 else _torch_adam_step
        beta1, beta2 = group["betas"]
        kernel(s.shard_of(master).view(-1), g.reshape(-1), s.shard_of(exp_avg).view(-1),
               s.shard_of(exp_avg_sq).view(-1), step=int(state["step"]), lr=float(group["lr"]),
               beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
               adamw_mode=adamw_mode, grad_scale=grad_scale,
               out=None if lowp is None else s.shard_of(lowp).view(-1))
    return written


@torch.no_grad()
def _torch_adam_step(params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                     grad_scale: float = 1.0, out=None) -> None:
    """``adam_step`` for masters the C++ kernel does not take (fp64, or bf16 without mixed
    precision): torch.optim's single-tensor Adam/AdamW (what it runs on CPU tensors),
    in the masters' dtype."""
    g = grads.to(params.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw_mode:
            params.mul_(1 - lr * weight_decay)
        else:
            g = g.add(params, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    if out is not None:
        out.copy_(params)
