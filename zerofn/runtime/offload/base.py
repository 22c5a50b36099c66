"""What every offload is to the runtime: the ``Offload`` interface, and the host arenas
both kinds allocate from.

An offload keeps a unit's master rows and optimizer state off the device (host memory,
or a swap file), lands its reduced gradients in host buffers, and steps the optimizer
there. The runtime talks to it only through ``Offload``: no caller asks which kind it
holds, so a new placement (a share kept on the device, another state dtype) is a new
class, not new branches.

Lifetime, per runtime: built at set-up from the units; ``place_masters`` takes each unit's
initial rows once (and ``param_shard`` its ZeRO-3 compute shard under ``params=True``);
``register_state`` hands the optimizer its state tensors; then every step lands the
gradients in ``grads`` and calls ``step``, which gives each unit's updated compute rows to
the runtime as soon as the unit is done. ``materialize`` makes the state readable for a
state-dict access until the next step; ``recast`` follows masters changed outside a step.
"""
from __future__ import annotations

import abc

import torch

from ...optim.cpu_adam import CPUAdam
from ..pinned import host_buffer
from ..timing import UNTIMED
from ...core.units import Unit

ALIGN = 64   # elements: keeps every view 256-byte aligned for the vector kernels


class HostArena:
    """One host allocation handed out as aligned views; never freed while training.
    Page-locked (exactly its size) when ``pin``."""

    def __init__(self, sizes: list[int], dtype: torch.dtype | None, pin: bool = False):
        total = sum(aligned(n) for n in sizes)
        # (units without parameters have no dtype; they take no room either)
        self.buffer = host_buffer(total, dtype or torch.float32, pin)
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        view = self.buffer[self._used:self._used + numel]
        self._used += aligned(numel)
        return view

    def holds(self, t: torch.Tensor) -> bool:
        start = self.buffer.untyped_storage().data_ptr()
        return start <= t.untyped_storage().data_ptr() < start + self.buffer.nbytes


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def device_of(units) -> torch.device:
    """The device the units compute on (the CPU for a model without parameters)."""
    return next((u.device for u in units if u.device is not None), torch.device("cpu"))


def cpu_adam_steps(optimizer) -> bool:
    """Whether zerofn's CPU Adam can step ``optimizer`` for it (Adam, AdamW, CPUAdam without
    amsgrad, maximize, capturable or differentiable): else torch.optim steps the host
    masters itself."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, CPUAdam):
        return False
    return not any(g.get("amsgrad") or g.get("maximize") or g.get("capturable")
                   or g.get("differentiable") for g in optimizer.param_groups)


def decoupled_weight_decay(optimizer) -> bool:
    """AdamW's weight decay (decoupled from the gradient), else Adam's L2 term."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.param_groups[0].get("decoupled_weight_decay", False))


class Offload(abc.ABC):
    """A place off the device for master rows and optimizer state (see the module note).

    Attributes:
        grads: ``{unit: host buffer}`` the unit's reduced gradient rows land in during
            backward; a unit not in it keeps them on the device until the step.
        cpu_adam: zerofn's CPU Adam steps (step.py then defers unscaling and clipping to
            its kernel); else the user's torch.optim optimizer steps host masters.
        param_reader: ZeRO-3 parameter shards read ahead of their gathers (``take(unit)``)
            where they live in a file, else None.
        time_series: the monitor's series this offload's work fills.
    """

    timing = UNTIMED     # runtime/timing.py: the runtime's, given to the constructor
    grads: dict
    cpu_adam: bool
    param_reader = None
    time_series: tuple[str, ...] = ()

    @abc.abstractmethod
    def arenas(self) -> list[HostArena]:
        """Every host allocation it holds (accounting tells their views apart by them)."""

    @abc.abstractmethod
    def place_masters(self, unit: Unit, keep: bool) -> torch.Tensor | None:
        """Take this rank's initial rows of ``unit`` (from its full parameters) and point
        each slot's ``opt_param`` where the optimizer finds them. Returns the master rows
        in memory, to build a compute shard from, where ``keep``; else may return None."""

    @abc.abstractmethod
    def param_shard(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """ZeRO-3 ``params=True``: the unit's compute shard in ``dtype``, held here."""

    @abc.abstractmethod
    def register_state(self, optimizer) -> None:
        """Give the optimizer its state tensors, so its state dict is the usual one."""

    @abc.abstractmethod
    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None) -> None:
        """Step every unit with a gradient in ``grads`` (``{slot: rows}``: host rows where
        the unit's gradients landed in ``self.grads``, else the device's, which the step
        copies down itself), gradients times ``grad_scale`` as they are read;
        ``after_unit(unit, rows)`` takes each unit's updated compute rows at once.
        ``copies`` (runtime/copies.py) orders this offload's own copies, and memory it
        rewrites within the step after the copies up from it."""

    @abc.abstractmethod
    def updated_rows(self, unit: Unit) -> torch.Tensor | None:
        """This rank's current rows of ``unit`` in the compute dtype, to refresh the compute
        parameters from (after a torch.optim step or a load); None where they already are
        the compute parameters' own rows."""

    def recast(self) -> None:
        """Masters changed outside a step (set-up, a load): compute copies follow."""

    def materialize(self, optimizer) -> None:
        """Make every state tensor readable in memory until the next step (state dicts)."""

    def compute_copies(self) -> list[torch.Tensor]:
        """Host copies of the rows in the compute dtype (model state, for accounting)."""
        return []

    early = None   # runtime/early_step.py's EarlySteps, under overlap_step
    ring = None    # ring.py's HostRing, where gradients and rows cross through one

    def steps_early(self, unit: Unit) -> bool:
        """Whether ``step_unit`` can step ``unit`` alone, during backward
        ([Note: the host step during backward])."""
        return False

    def step_unit(self, optimizer, unit: Unit, grads: dict) -> None:
        """Step ``unit``'s rows alone (``grads``: its slots' host rows), leaving the copy
        back to ``step``, which skips the units ``early`` has stepped."""
        raise NotImplementedError(f"{type(self).__name__} steps whole steps only")

    def release(self, units) -> None:
        """Stop holding ``units``, which another part took over (ratio="auto")."""
        raise NotImplementedError(f"{type(self).__name__} keeps every unit it was given")

    def attach_early(self, early) -> None:
        self.early = early

    def staying(self) -> list[Unit]:
        """The units whose masters and state stay on the device (``ratio`` < 1)."""
        return []

    def exact_dtypes(self, unit: Unit) -> tuple[torch.dtype, torch.dtype]:
        """``(masters, moments)``: the narrowest dtypes that hold ``unit``'s masters and
        Adam moments exactly (bf16 where they are stored in bf16), for checkpoints."""
        return torch.float32, torch.float32

    def state_buffers(self) -> list[torch.Tensor]:
        """Where optimizer state is stored in another form than the optimizer's tensors
        show it (fewer bits), for accounting."""
        return []

    def unseen_bytes(self) -> dict[str, dict[str, int]]:
        """``{where: {role: bytes}}`` held outside any tensor accounting can see (a swap
        file, a staging ring standing for it)."""
        return {}


def rows_into(unit: Unit, master: torch.Tensor) -> torch.Tensor:
    """This rank's initial rows of ``unit`` (from its full parameters) into the flat
    ``master``, each slot's ``opt_param`` a view of them; returns ``master``."""
    for s in unit.slots:
        s.opt_param = s.shard_of(master).copy_(s.rows_of(s.param.detach()))
    return master


def point_at(t: torch.Tensor, view, shape, stand_in) -> None:
    """Point ``t`` (keeping its identity, which the optimizer keys on) at ``view``'s memory,
    or at a one-element stand-in with stride 0."""
    with torch.no_grad():
        if view is None:
            t.set_(stand_in.untyped_storage(), 0, shape, [0] * len(shape))
        else:
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def stand_in(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` backed by one element (zero strides) that can later be pointed
    at real memory with ``set_``: what the optimizer's tensors are while the state lives
    elsewhere (a swap file, fewer bits), so no second copy of the rows is held."""
    one = torch.zeros(1, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(one.untyped_storage(), 0, shape, [0] * len(shape))
