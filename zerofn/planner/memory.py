"""Peak bytes one rank holds in each phase of a step (forward, backward, optimizer step),
by place (device, host, NVMe), built from what zerofn's runtime allocates for a candidate.

The terms:

- **model state**: the parameters, gradient shards, masters and optimizer state, laid out
  as the runtime lays them out (``zf.model_state_bytes`` counts the same tensors):
  rank 0's rows of every parameter (rank 0 holds the most: ``torch.chunk``'s split),
  each unit's padded flat shard for the gradients, one 4-byte ``step`` counter per
  parameter tensor; a frozen parameter held (with masters) but without gradient, moments
  or counter: ``estimate_placement``'s formulas (zerofn/core/estimate.py, their one
  home) over rank 0's exact ``Layout``.
- **the pool** (runtime/pool.py): its requests over two steps replayed under the pool's
  own best-fit rule and the collectives' own in-flight queue (pool_replay.py): the
  reduce-scatter send buffers, ZeRO-3's gathered units, the step's copies and
  all-gathers.
- **activations**, measured on fake tensors (activations.py): the peak of forward and
  backward with gradients kept (DDP, ZeRO-1) or let go as they are packed (ZeRO-2/3).
- **the step's temporaries**: torch's AdamW makes its temporaries per parameter on a CPU
  (its for-loop implementation, the default there) and per list on a GPU (multi-tensor:
  the whole model under DDP, one unit under zerofn's device home, which steps one unit at
  a time); zerofn's CPU Adam steps in place.
- **the process**: what a process holds before the model (the interpreter, torch, the
  process group) and the allocator's overhead on what a step makes and frees (the
  terms above but the model state), both measured by the probe (probe.py), not guessed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zerofn.core.estimate import HOST_RING_DEPTH, Layout, estimate_placement
from zerofn.core.plan import HOMES, ShardingPolicy
from zerofn.core.units import build_units
from zerofn.io.checkpoint.checksums import FILE_BYTES
from zerofn.runtime.grads import lends_shards as runtime_lends_shards
from zerofn.runtime.homes.assignment import staying_units
from zerofn.runtime.host_malloc import THRESHOLD

from .activations import Activations
from .candidates import DTYPES, Candidate
from .owned import Owned
from .pool_replay import PoolReplay

PHASES = ("forward", "backward", "step", "save")
SAVES = (None, "sync", "async")     # how the run saves checkpoints (save_checkpoint)
# save_checkpoint's staging_bytes when not given: two data files (io/checkpoint/api.py)
STAGING_BYTES = 2 * FILE_BYTES
HOMES = HOMES
FP32 = 4


@dataclass(frozen=True)
class Shape:
    """What the memory model reads of a model laid out over ``world`` ranks (rank 0).

    Attributes:
        tensor_numels: each unique parameter tensor's elements.
        tensor_locals: rank 0's elements of each (its rows).
        trainable: whether each requires a gradient (a frozen one gets no gradient and no
            optimizer state; it is still held, sharded at ZeRO-3, and has masters).
        unit_shards: each unit's padded flat shard (elements), in unit order.
        unit_trainable: rank 0's elements of each unit's trainable parameters (a unit
            with none is never reduced: no send buffer, no lent gradient shard).
        named_local: rank 0's rows summed over the state dict's names (a tied parameter
            under each of its names).
        buffers: bytes of the model's buffers, which every rank holds whole.
        root: whether the last unit is the root (it has parameters of its own).
        root_first: whether a trainable parameter of the root runs after every other unit
            (a final norm, a head), read from the modules' order as registered: its
            gradient comes first in backward, and with it the root's send buffer.
        rank: the data-parallel rank described.
        owned: the parameters whole-tensor optimizers hold (owned.py), or None: Adam
            steps every parameter.
        tensor_owned: whether each tensor is one of them (no Adam moments or counter).
        units: the units with parameters, as the runtime builds them (where a ``ratio``
            keeps some on the device: ``owned_places``).
        order: the model's parameter names in order (which units a ``ratio`` keeps).
    """

    world: int
    tensor_numels: tuple[int, ...]
    tensor_locals: tuple[int, ...]
    trainable: tuple[bool, ...]
    unit_shards: tuple[int, ...]
    unit_trainable: tuple[int, ...]
    named_local: int = 0
    buffers: int = 0
    root: bool = False
    root_first: bool = False
    rank: int = 0
    owned: Owned | None = None
    tensor_owned: tuple[bool, ...] = ()
    units: tuple = field(default=(), compare=False, repr=False)
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def params(self) -> int:
        return sum(self.tensor_numels)

    @property
    def tensors(self) -> int:
        return len(self.tensor_numels)

    @property
    def local(self) -> int:
        """Rank 0's rows of every parameter (elements)."""
        return sum(self.tensor_locals)

    @property
    def shard(self) -> int:
        """The units' padded flat shards together (elements)."""
        return sum(self.unit_shards)

    @property
    def trainable_numels(self) -> tuple[int, ...]:
        return tuple(n for n, t in zip(self.tensor_numels, self.trainable) if t)

    @property
    def trainable_params(self) -> int:
        return sum(self.trainable_numels)

    @property
    def trainable_tensors(self) -> int:
        return len(self.trainable_numels)

    @property
    def trainable_local(self) -> int:
        return sum(self.unit_trainable)

    def _adam(self) -> list[int]:
        """Indices of the trainable tensors Adam steps (those no whole-tensor optimizer
        owns)."""
        owned = self.tensor_owned or (False,) * self.tensors
        return [i for i, (t, o) in enumerate(zip(self.trainable, owned)) if t and not o]

    @property
    def adam_params(self) -> int:
        return sum(self.tensor_numels[i] for i in self._adam())

    @property
    def adam_local(self) -> int:
        """This rank's rows of the tensors Adam steps (its moments' elements)."""
        return sum(self.tensor_locals[i] for i in self._adam())

    @property
    def adam_tensors(self) -> int:
        return len(self._adam())

    def owned_held(self, stage: int) -> int:
        """Optimizer-role bytes this rank holds for owned parameters (owned.py)."""
        return 0 if self.owned is None else self.owned.held(self.rank, stage)

    def owned_places(self, stage: int, offload: str | None, ratio: float) -> dict[str, int]:
        """``owned_held``'s bytes by place: an owner keeps a parameter's state and whole
        masters where the home of its unit keeps the masters' rows (runtime/owned.py: on
        the optimizer's tensor's device): the device without offload and in the units a
        ``ratio`` keeps there (runtime/homes/assignment.py's ``staying_units``), the host
        under offload, NVMe's too (the swap file holds the rows; the owner's tensors are
        in memory)."""
        held = self.owned_held(stage)
        if offload is None or self.owned is None:
            return {"device": held, "host": 0}
        staying = staying_units(list(self.units), ratio, {n: i for i, n in
                                                          enumerate(self.order)}) \
            if ratio < 1 else []
        on_device = self.owned.held(self.rank, stage,
                                    frozenset(s.fqn for u in staying for s in u.slots))
        return {"device": on_device, "host": held - on_device}

    def to_owner_bytes(self, itemsize: int) -> dict[str, int]:
        """Under ``reduce_to_owner`` (runtime/to_owner.py), bytes a phase holds on top of
        the model state, by phase: this rank's whole gradients as their owner, from
        backward to the step (``zf.model_state_bytes`` does not count them: it reads the
        state after ``zero_grad``), and in backward a unit's owned gradients packed for
        their reduce, each padded whole, on every rank (the largest unit's)."""
        if self.owned is None:
            return {}
        held = self.owned.to_owner_grads(self.rank, itemsize)
        names = self.owned.names
        sends = max((sum(itemsize * self.world * s.chunk * s.inner for s in u.slots
                         if s.fqn in names) for u in self.units), default=0)
        return {"backward": held + sends, "step": held}

    @property
    def owned_local(self) -> int:
        """This rank's rows of the owned tensors (elements)."""
        return self.trainable_local - self.adam_local

    @property
    def reduced_shards(self) -> tuple[int, ...]:
        """The padded shards of the units that have gradients to reduce."""
        return tuple(n for n, t in zip(self.unit_shards, self.unit_trainable) if t)

    @property
    def reduced(self) -> int:
        return sum(self.reduced_shards)

    def largest_piece(self, stage: int, trainable: bool = False) -> int:
        """Elements of the largest piece of one parameter (``trainable``: of those Adam
        steps) a rank holds: the whole tensor under DDP (stage 0), its rows under ZeRO."""
        numels = [self.tensor_numels[i] for i in self._adam()] if trainable \
            else self.tensor_numels
        largest = max(numels, default=0)
        return largest if stage == 0 else -(-largest // self.world)

    def mapped(self, itemsize: int, threshold: int = THRESHOLD) -> int:
        """Bytes of the whole gradients that are blocks of ``threshold`` bytes or more:
        with the threshold fixed on a CPU (``zf.return_large_frees()``, which ``zerofn
        train`` calls) glibc maps each by itself and unmaps it when freed
        (runtime/host_malloc.py), so the heap's overhead does not apply to them."""
        return sum(itemsize * n for n in self.trainable_numels if itemsize * n >= threshold)

    @property
    def largest(self) -> int:
        return max(self.unit_shards, default=0)


def shape_of(model: nn.Module, world: int, rank: int = 0, owned: Owned | None = None) -> Shape:
    """The model's layout at ``world`` ranks under zerofn's default units (a meta model
    will do: only shapes are read), as data-parallel ``rank`` holds it (rank 0, the
    default, holds the most rows; with ``owned`` parameters each owner holds more). A
    parameter tensor parallelism split (a DTensor) is laid out from its local tensor, as the
    runtime lays it out (core/units.py), so ``world`` is then the data-parallel ranks and
    the shape one tensor-parallel rank's."""
    built = build_units(model, None, world, rank)
    units = [u for u in built if u.slots]
    slots = [s for u in units for s in u.slots]
    names = owned.names if owned is not None else frozenset()
    held = {id(p) for n, p in model.named_parameters() if n in names}
    rows = {id(s.param): s.local_numel for s in slots}
    buffers = {id(b): b.nbytes for b in model.buffers()}
    return Shape(world=world, tensor_numels=tuple(s.numel for s in slots),
                 tensor_locals=tuple(s.local_numel for s in slots),
                 trainable=tuple(s.requires_grad for s in slots),
                 unit_shards=tuple(u.shard_numel for u in units),
                 unit_trainable=tuple(sum(s.local_numel for s in u.trainable) for u in units),
                 named_local=sum(rows.get(id(p), 0) for _, p in
                                 model.named_parameters(remove_duplicate=False)),
                 buffers=sum(buffers.values()), root=bool(built[-1].slots),
                 root_first=_root_runs_last(model, built), rank=rank, owned=owned,
                 tensor_owned=tuple(id(s.param) in held for s in slots), units=tuple(units),
                 order=tuple(n for n, _ in model.named_parameters()))


def _root_runs_last(model: nn.Module, built) -> bool:
    """Whether a trainable root parameter is registered in a module after every other
    unit's module (a final norm, a head): forward runs it last, so backward packs its
    gradient first. (Registration order stands in for the forward's, as it does for a
    transformer's blocks and the layers around them.)"""
    order = {m: i for i, m in enumerate(model.modules())}
    last = max((order[u.module] for u in built[:-1] if u.module is not model), default=-1)
    return any(order.get(module, -1) > last for s in built[-1].trainable
               for module, _ in s.owners)


def model_state(c: Candidate, shape: Shape, device_is_host: bool = False
                ) -> dict[str, dict[str, int]]:
    """Model-state bytes by place and role, as ``zf.model_state_bytes`` counts them after
    a step (ZeRO-1's whole gradients are backward's, not counted here):
    ``estimate_placement``'s formulas (zerofn/core/estimate.py) over rank 0's exact
    layout. Frozen parameters are held (and have masters, which the state dict reads) but
    have no gradient, no moments and no step counter; torch's AdamW (and the host's Adam)
    keeps a counter per trainable tensor. ``device_is_host``: the device is this CPU, whose
    memory (none of it page-locked) is resident once written, not once allocated: the
    kept gradient shards of a unit never reduced and the host ring's columns of frozen
    rows are not."""
    layout = Layout(whole=shape.params, rows=shape.local,
                    whole_trainable=shape.adam_params, trainable=shape.adam_local,
                    grads=shape.trainable_params if c.stage == 0 else
                    grad_shards(c, shape, device_is_host),
                    counters=shape.adam_tensors, largest=shape.largest,
                    ring_slots=max(1, min(HOST_RING_DEPTH, len(shape.unit_shards))),
                    ring_written=max(shape.unit_trainable, default=0) if device_is_host
                    else None)
    placed = estimate_placement(layout, shape.world, c.stage, DTYPES[c.precision],
                                torch.bfloat16 if c.master_dtype == "bf16" else torch.float32,
                                offload=c.offload, offload_params=c.params,
                                state_dtype=DTYPES[c.state_dtype], ratio=c.ratio)
    # An owner keeps its state and whole masters where its masters' rows are
    for place, held in shape.owned_places(c.stage, c.offload, c.ratio).items():
        placed[place]["optimizer"] += held
    if c.offload == "nvme":
        # the swap file's blocks keep room for Adam's moments on every row, owned ones too
        placed["nvme"]["optimizer"] += 2 * FP32 * shape.owned_local * c.ratio
    return {place: {role: int(placed[place][role]) for role in ("params", "grads", "optimizer")}
            for place in HOMES}


def lends_shards(c: Candidate) -> bool:
    """Whether the gradient shards are lent by the pool to the units that reduce, until
    ``zero_grad`` (ZeRO-1's, and any whose step is offloaded), not one buffer over every
    unit made at the first reduction (ZeRO-2/3's): runtime/grads.py's rule, where an
    offloaded candidate's shards cross to a home."""
    return runtime_lends_shards(c.stage, crosses=c.offload is not None)


def grad_shards(c: Candidate, shape: Shape, device_is_host: bool = False) -> int:
    """Elements of the reduced gradient shards a rank keeps (``lends_shards``); on a CPU,
    those written (``model_state``)."""
    return shape.reduced if lends_shards(c) or device_is_host else shape.shard


def pool_bytes(c: Candidate, shape: Shape, bucket_size: int = ShardingPolicy.bucket_size,
               prefetch: int = ShardingPolicy.prefetch, gloo: bool = True) -> tuple[int, int]:
    """``(bytes, heap bytes)``: what the runtime's buffer pool holds once two steps have
    run (runtime/pool.py), its requests replayed (pool_replay.py), but the bytes of the
    gradient shards it lends (model state); and of that, what lies in buffers under
    ``THRESHOLD`` bytes, which glibc serves from its heap where the device is the host
    (larger ones it maps by themselves: runtime/host_malloc.py). ``gloo``: the
    collectives are gloo's (a CPU device), not NCCL's."""
    if c.stage == 0:
        return 0, 0
    cb = DTYPES[c.precision].itemsize
    buffers = PoolReplay(c.stage, shape.world, shape.unit_shards,
                         tuple(n > 0 for n in shape.unit_trainable), shape.root, cb, FP32,
                         lent=lends_shards(c), mixed_copies=c.offload is None and cb != FP32,
                         bucket_size=bucket_size, prefetch=prefetch, gloo=gloo,
                         root_first=shape.root_first).run().buffer_bytes()
    return sum(held for _, held in buffers), \
        sum(held for whole, held in buffers if whole < THRESHOLD)


def step_temporaries(c: Candidate, shape: Shape, device_is_host: bool = True) -> int:
    """Bytes the step allocates at its peak: the owned step's (owned.py), which runs
    first and frees them, or torch's AdamW's (none where zerofn's CPU Adam steps offloaded
    Adam; beside a whole-tensor optimizer torch's steps the host's Adam, not the swap
    file's), in fp32: on a CPU, a tensor at a time, two of its size (the denominator is
    the second moment's square root, then that divided by the bias correction: both live
    at once); on a GPU, one list of temporaries (the square roots, divided in place) of
    what it steps at once."""
    owned = 0 if shape.owned is None else shape.owned.step_bytes(
        shape.rank, c.stage, c.to_owner, DTYPES[c.precision].itemsize)
    if c.offload and not device_is_host:
        # (the owner steps on the device: its whole masters and state on the host come up)
        owned += shape.owned_places(c.stage, c.offload, c.ratio)["host"]
    # (beside a whole-tensor optimizer the host's Adam is torch's, not zerofn's kernel;
    # the swap file's is the kernel's either way)
    if c.offload is not None and c.ratio == 1.0 and (shape.owned is None or
                                                      c.offload == "nvme"):
        return owned
    if device_is_host:
        return max(owned, 2 * FP32 * shape.largest_piece(c.stage, trainable=True))
    return max(owned, FP32 * (shape.adam_params if c.stage == 0 else max(shape.unit_trainable)))


def activations_of(c: Candidate, acts: Activations) -> dict[str, int]:
    """Activation bytes on top of the model state per phase: DDP's and ZeRO-1's backward
    keeps every whole gradient (DDP's are its model state already)."""
    backward = acts.backward_kept if c.stage <= 1 else acts.backward_dropped
    if c.stage == 0:
        backward -= acts.grads
    return {"forward": acts.forward, "backward": backward, "step": 0, "save": 0}


def state_dict_bytes(c: Candidate, shape: Shape) -> dict[str, int]:
    """Bytes of the rank's state dicts (``get_state_dict``): the model's, its rows of every
    parameter by name as fp32 masters (tied parameters under each name, frozen ones too);
    the optimizer's, two fp32 moments a row and a step counter per tensor Adam steps, and
    owned state as the owners spread it (owned.py)."""
    # stage 0 holds whole parameters: rank 0's rows times the ranks, padding included
    named = shape.named_local * (1 if c.stage else shape.world)
    rows = shape.adam_params if c.stage == 0 else shape.adam_local
    owned = 0 if shape.owned is None else \
        shape.owned.held(shape.rank, 0) if c.stage == 0 else shape.owned.spread(shape.rank)
    return {"model": FP32 * named,
            "optim": 2 * FP32 * rows + FP32 * shape.adam_tensors + owned}


def save_copies(c: Candidate, shape: Shape, saves: str | None,
                device_is_host: bool = True) -> int:
    """Bytes of the state dicts' tensors a save copies to the host, over the whole save: a
    background save copies every one (its writer copies each unit's items out of the live
    state as it writes them, io/checkpoint/unit_copies.py; the rest at the call,
    io/checkpoint/staging.py); a synchronous one has DCP's copies: every tensor on a GPU,
    and on a CPU each that is a view into a larger buffer (its rows of a whole parameter
    past world 1, a unit's flat masters under ZeRO-3 or mixed precision, offloaded state
    in its arena or read a unit at a time), not torch's own moments or whole fp32
    parameters."""
    sizes = state_dict_bytes(c, shape)
    if saves is None:
        return 0
    if saves == "async" or not device_is_host:
        return sizes["model"] + sizes["optim"]
    whole = c.stage == 0 or (c.stage < 3 and shape.world == 1 and c.precision == "fp32"
                             and c.offload is None)
    return (0 if whole else sizes["model"]) + (sizes["optim"] if c.offload else 0)


def staging(staging_bytes: int = STAGING_BYTES) -> tuple[int, int]:
    """``(data file, copies before a change)``: how ``save_checkpoint`` splits
    ``staging_bytes`` (io/checkpoint/api.py): each data file at most half of it (its
    writer holds one tensor's copy at a time, so the file's size bounds the file, not
    what the save holds), a background save's copies made before a step changes a unit
    the rest, a unit read from a file included."""
    return staging_bytes // 2, staging_bytes - staging_bytes // 2


def unit_read(c: Candidate, shape: Shape) -> int:
    """Bytes of the one unit a save holds read into memory at a time (io/checkpoint/
    streamed.py's ``UnitReader``), where the state is out of memory between steps: a unit
    in a swap file (its block's masters and moments) or in fewer bits on the host (its
    masters and moments decoded into one fp32 (3, shard) buffer, through one fp32 piece
    of a slot at a time). None where every unit's state is in memory."""
    lowp = (c.state_dtype, c.master_dtype) != ("fp32", "fp32")
    if c.offload is None or (c.offload == "cpu" and not lowp):
        return 0
    decoded = 3 * FP32 * shape.largest
    if c.offload == "nvme" and not lowp:
        return decoded       # (the block's own fp32 views)
    stored = shape.largest * (DTYPES[c.master_dtype].itemsize + 2 *
                              DTYPES[c.state_dtype].itemsize) if c.offload == "nvme" else 0
    return decoded + stored + FP32 * shape.largest_piece(c.stage, trainable=True)


def save_held(c: Candidate, shape: Shape, saves: str | None,
              device_is_host: bool = True, staging_bytes: int = STAGING_BYTES) -> int:
    """Host bytes a save holds at once (``staging_bytes``: ``save_checkpoint``'s). Its
    writer copies one tensor at a time and lets it go once written (io/checkpoint/
    checksums.py's [Note: one item at a time]), whatever the data file's size: the
    largest tensor the rank writes (fp32 rows, the largest saved dtype but for bf16
    masters and moments), where the save copies any; and the unit it reads
    (``unit_read``). A synchronous save holds those two. A background save also the
    copies it makes before the next steps change units it has not written yet, within
    the half of ``staging_bytes`` a data file leaves, less the decoded unit the runtime
    reserves for the read (unit_copies.py's [Note: copy-before-write per unit]), and
    never more than the state it copies; a bf16 tensor read from fewer bits is cast on
    its way into that copy, one more of it."""
    if saves is None:
        return 0
    copies = save_copies(c, shape, saves, device_is_host)
    read = unit_read(c, shape)
    item = min(copies, FP32 * shape.largest_piece(c.stage))
    if saves == "sync":
        return read + item
    _, budget = staging(staging_bytes)
    reserved = 3 * FP32 * shape.largest if read else 0     # (UnitCopies' _reading)
    aside = min(copies - item, max(0, budget - reserved))
    cast = DTYPES["bf16"].itemsize * shape.largest_piece(c.stage, trainable=True) \
        if read and "bf16" in (c.master_dtype, c.state_dtype) else 0
    return read + item + aside + cast


def save_bytes(c: Candidate, shape: Shape, saves: str | None,
               device_is_host: bool = True) -> int:
    """Host bytes a checkpoint save holds on top of the state (io/checkpoint): its copies
    and the unit it reads (``save_held``). Offloaded state, in a file or in fewer bits, is
    read a unit at a time as DCP writes it, never the whole state at once."""
    return save_held(c, shape, saves, device_is_host)


@dataclass(frozen=True)
class Process:
    """What a process holds besides the model (measured by the probe): ``base`` bytes of
    resident memory once torch and a process group are up, and ``overhead``, the
    allocator's bytes per byte of what a step makes and frees (activations, buffers,
    temporaries: fragmentation, freed memory kept). The model state is made once and kept,
    so it is counted as it is."""

    base: int = 0
    overhead: float = 0.0


def peaks(c: Candidate, shape: Shape, acts: Activations, process: Process = Process(),
          device_is_host: bool = True, saves: str | None = None
          ) -> dict[str, dict[str, int]]:
    """``{phase: {place: bytes}}``: rank 0's peak in each phase (``saves``: how the run
    saves checkpoints, SAVES; None leaves the save phase at the step's resident bytes).
    Where the device is the CPU (this machine) its bytes are host memory too, and the
    process's base counts once."""
    state = model_state(c, shape, device_is_host)
    resident = {p: sum(state[p].values()) for p in HOMES}
    resident["device"] += shape.buffers     # (the model's own, whole on every rank)
    pool, pool_heap = pool_bytes(c, shape, gloo=device_is_host)
    extra = activations_of(c, acts)
    extra["step"] = step_temporaries(c, shape, device_is_host)
    if c.to_owner and c.stage == 3:
        for phase, held in shape.to_owner_bytes(DTYPES[c.precision].itemsize).items():
            extra[phase] += held
    out = {}
    # With the threshold fixed on a CPU (zf.return_large_frees(), as zerofn train runs)
    # glibc maps every block of THRESHOLD bytes or more by
    # itself and unmaps it when freed (runtime/host_malloc.py): no heap overhead on the
    # pool's large buffers or on ZeRO-1's large whole gradients. (A GPU's caching
    # allocator: none counted.)
    mapped = {phase: 0 for phase in PHASES}
    if device_is_host and c.stage == 1:
        mapped["backward"] = min(shape.mapped(DTYPES[c.precision].itemsize), extra["backward"])
    # DDP's gradients are made in each backward and freed by zero_grad (set_to_none), in
    # a process whose mmap threshold glibc moves up to 32 MiB: the allocator's overhead
    # falls on them as on any other memory a step makes and frees
    remade = state["device"]["grads"] * process.overhead \
        if device_is_host and c.stage == 0 else 0
    for phase in PHASES:
        churn = pool + pool_heap * process.overhead + mapped[phase] + \
            (extra[phase] - mapped[phase]) * (1 + process.overhead) + \
            (remade if phase in ("backward", "step") else 0)
        device, host = resident["device"] + churn, resident["host"]
        if device_is_host:
            host, device = host + device, 0
        out[phase] = {"device": int(device), "host": int(host + process.base),
                      "nvme": resident["nvme"]}
    saving = save_bytes(c, shape, saves, device_is_host)
    if saves == "async":
        # a background save writes while the next steps run, and copies units aside as
        # they are about to change: its bytes come on top of the steps' own
        out["save"]["host"] = max(out[ph]["host"] for ph in PHASES if ph != "save") + saving
    elif device_is_host and saves is not None:
        # the heap keeps what the step freed (all but the blocks glibc maps by itself),
        # and the save's copies take that memory first
        kept = max(out[ph]["host"] for ph in PHASES if ph != "save") - max(mapped.values())
        out["save"]["host"] = max(kept, out["save"]["host"] + saving)
    else:
        out["save"]["host"] += saving
    return out


def peak(c: Candidate, shape: Shape, acts: Activations, process: Process = Process(),
         device_is_host: bool = True, saves: str | None = None) -> dict[str, int]:
    """The largest of each place over the phases."""
    return largest(peaks(c, shape, acts, process, device_is_host, saves))


def largest(by_phase: dict[str, dict[str, int]], phases=PHASES) -> dict[str, int]:
    """Each place's largest bytes over ``phases`` of ``peaks``' answer."""
    return {place: max(by_phase[ph][place] for ph in phases) for place in HOMES}
