"""What every home of a unit's state is to the runtime: the ``Home`` interface, and the
allocations homes hand out views of.

A home holds a unit's master rows and optimizer state, and steps them: on the device
(``DeviceHome``, device.py), in host memory (``HostHome``, ``LowpHostHome``) or in a swap
file (``NvmeHome``). Every unit has exactly one, and ``Homes`` (composed.py) routes each call
to the unit's own where several share a model. The runtime talks to it only through
``Home``: no caller asks which kind it holds, so a new placement is a new class, not new
branches; "no offload" is the device home, not the absence of one.

Lifetime, per runtime: built at set-up from the units and the offload policy, before any
optimizer is known; ``place_masters`` takes each unit's initial rows once (and
``param_shard`` its ZeRO-3 compute shard under ``params=True``). ``bind`` is given the
optimizer when the runtime finds it (at set-up where the transform was given it, else at
its first step or state-dict access): the optimizer chooses the kernel that steps and the
state it needs, never the layout, so what backward does before then is the same either
way. Then every step lands the gradients the home takes during backward in ``grads`` and
calls ``step``, which gives each unit's updated compute rows to the runtime as soon as the
unit is done. ``materialize`` makes the state readable for a state-dict access until the
next step; ``recast`` follows masters changed outside a step.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from ...optim.cpu_adam import CPUAdam
from ..pinned import host_buffer
from ..param_table import ParamTable
from ..timing import UNTIMED
from ...core.units import Unit, local_of

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


class FlatBuffers:
    """``{key: (dtype, numel)}`` as zeroed views of one buffer per dtype (``views``), each
    starting ``align`` elements apart (256 bytes for fp32), as vector kernels like: one
    allocation per kind and dtype, where many small long-lived blocks made while a
    meta-built model's transient full units come and go would fragment the host heap.
    ``holds`` tells accounting which storage they share (memory.py)."""

    def __init__(self, sizes: dict, device: torch.device, align: int = 64):
        self.views: dict = {}
        self._storages = []
        for dtype in {dt for dt, _ in sizes.values()}:
            mine = {k: n for k, (dt, n) in sizes.items() if dt == dtype}
            padded = {k: -(-n // align) * align for k, n in mine.items()}
            buf = torch.zeros(sum(padded.values()), dtype=dtype, device=device)
            self._storages.append(buf.untyped_storage())
            at = 0
            for k, n in mine.items():
                self.views[k] = buf[at:at + n]
                at += padded[k]
        self.where = device.type

    def holds(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(s.data_ptr() == ptr for s in self._storages)


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


@dataclass(frozen=True)
class HomeSpec:
    """What every home is built from: the offload policy (how its state is stored, where
    the swap file goes), the device, the global rank (which names a swap file: HSDP's
    replicas share shard ranks), the timing its work fills, and ZeRO-3 ``params=True``'s
    compute dtype per unit whose shard a home holds. Not the optimizer: homes are laid out
    before it is known (the module note); ``adam`` says whether the one the transform was
    given (if any) has its state stepped by zerofn's CPU Adam, which ratio="auto"'s host
    budget counts (assumed where none was given)."""

    policy: object                  # core/plan.py's OffloadPolicy
    reduce_dtype: torch.dtype | None
    device: torch.device
    rank: int = 0
    timing: object = UNTIMED
    param_dtypes: dict = field(default_factory=dict)
    adam: bool = True
    table: ParamTable = field(default_factory=ParamTable)   # the runtime's (param_table.py)

    def grad_dtype(self, unit: Unit) -> torch.dtype:
        """What a unit's gradients land in off the device: the reduce dtype, scaled fp16
        too. Whatever steps them reads them so and unscales as it reads (step_grads.py's [Note:
        deferred scaling]): zerofn's CPU Adam in its kernel, another optimizer as the host
        casts them to the masters' dtype (host.py)."""
        return self.reduce_dtype or unit.compute_dtype


class Home(abc.ABC):
    """Where units' master rows and optimizer state live, and are stepped (see the module
    note).

    Attributes:
        grads: ``{unit: buffer}`` the unit's reduced gradient rows land in during backward
            (off the device); a unit not in it keeps them on the device until the step.
        defers_scaling: the step multiplies gradients by the unscale factor and the clip
            coefficient as it reads them (step_grads.py's [Note: deferred scaling]): every home
            off the device, whatever optimizer it is bound to.
        cpu_adam: zerofn's CPU Adam steps; else the user's torch.optim optimizer steps the
            masters (known once bound).
        param_reader: ZeRO-3 parameter shards read ahead of their gathers (``take(unit)``)
            where they live in a file, else None.
        time_series: the monitor's series this offload's work fills.
    """

    timing = UNTIMED     # runtime/timing.py: the runtime's, given to the constructor
    kind = "host"        # where its state lives: "device", "host" or "nvme"
    units: list          # the units it holds
    grads: dict
    defers_scaling = True
    cpu_adam = False
    param_reader = None
    ring = None          # ring.py's HostRing, where gradients and rows cross through one
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
    def bind(self, optimizer) -> None:
        """The optimizer that steps these units, found: choose the kernel that steps them,
        make the state it needs, and give the optimizer its state tensors, so its state
        dict is the usual one (state it already holds, e.g. loaded, moves in)."""

    @abc.abstractmethod
    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        """Step every unit with a gradient in ``grads`` (``{slot: rows}``: the rows where
        the unit's gradients landed in ``self.grads``, else the device's), gradients times
        ``grad_scale`` as they are read; ``after_unit(unit, rows)`` takes each unit's
        updated compute rows at once. ``copies`` (runtime/copies.py) orders this home's own
        copies, and memory it rewrites within the step after the copies up from it;
        ``early`` (overlap.py) holds the units stepped during backward already."""

    @abc.abstractmethod
    def updated_rows(self, unit: Unit) -> torch.Tensor | None:
        """This rank's current rows of ``unit`` in the compute dtype, to refresh the compute
        parameters from (after a torch.optim step or a load); None where they already are
        the compute parameters' own rows."""

    def recast(self) -> None:
        """Masters changed outside a step (set-up, a load): compute copies follow."""

    def materialize(self, optimizer) -> None:
        """Make every state tensor readable in memory until the next step (state dicts);
        ``optimizer`` None (none bound yet): the masters alone."""

    def unread(self, unit: Unit) -> bool:
        """Whether ``unit``'s state is out of memory between steps (a file, fewer bits) and
        not materialized now: the optimizer's tensors for it are stand-ins, and
        ``read_unit`` reads it."""
        return False

    def read_unit(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``unit``'s flat (master, exp_avg, exp_avg_sq) as ``materialize`` would show them,
        in new memory, the other units left where they are: a save reads one unit at a time
        (io/checkpoint/streamed.py). Only where ``unread(unit)``."""
        raise NotImplementedError(f"{type(self).__name__} holds its state in memory")

    def write_rows(self, unit: Unit, slot, rows: torch.Tensor) -> None:
        """``slot``'s master rows (of ``unit``) are ``rows``: a whole-tensor optimizer
        stepped them before ``step`` (runtime/owned.py)."""
        self.table[slot].opt_param.copy_(rows)

    def forget_state(self) -> None:
        """Another optimizer takes the units over: the optimizer state it will see starts
        afresh (the masters stay). Where the user's optimizer keeps its own, it goes with
        the optimizer retired."""

    def compute_copies(self) -> list[torch.Tensor]:
        """Host copies of the rows in the compute dtype (model state, for accounting)."""
        return []

    def masters_on_device(self, unit: Unit) -> bool:
        """Whether ``unit``'s masters are device memory (a compute shard in their dtype may
        then be the masters themselves)."""
        return False

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

    def on_device(self) -> list[Unit]:
        """The units whose masters and state live on the device."""
        return []

    def home_of(self, unit: Unit) -> str:
        """Where ``unit``'s state lives: "device", "host" or "nvme"."""
        return self.kind

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


def rows_into(unit: Unit, master: torch.Tensor, table) -> torch.Tensor:
    """This rank's initial rows of ``unit`` (from its full parameters) into the flat
    ``master``, each slot's ``opt_param`` (in the runtime's ``table``) a view of them;
    returns ``master``."""
    for s in unit.slots:
        table[s].opt_param = s.shard_of(master).copy_(s.rows_of(local_of(s.param).detach()))
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
