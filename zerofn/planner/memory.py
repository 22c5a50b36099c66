"""Peak bytes one rank holds in each phase of a step (forward, backward, optimizer step),
by place (device, host, NVMe), built from what zerofn's runtime allocates for a candidate.

The terms:

- **model state**: the parameters, gradient shards, masters and optimizer state, laid out
  as the runtime lays them out (``zf.model_state_bytes`` counts the same tensors):
  rank 0's rows of every parameter (rank 0 holds the most: ``torch.chunk``'s split),
  each unit's padded flat shard for the gradients, one 4-byte ``step`` counter per
  parameter tensor. Offloaded homes are ``estimate_placement``'s (zerofn/core/estimate.py).
- **the pool** (runtime/pool.py): the reduce-scatter send buffers, as many as the
  in-flight bound (runtime/comm.py: 4 × ``bucket_size`` bytes, at least
  ``KEEP_IN_FLIGHT`` + the one filling) allows, each a whole unit in the reduce dtype
  (ZeRO-1 too: it packs at backward's end under the same bound); ZeRO-3 adds the gathered
  units, the one computing and ``prefetch`` ahead, in the compute dtype, and a pooled
  copy per unit at the step where the gradients' dtype is not the masters'.
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

from dataclasses import dataclass

import torch
from torch import nn

from zerofn.core.estimate import estimate_placement
from zerofn.core.units import build_units
from zerofn.io.checkpoint.checksums import FILE_BYTES
from zerofn.runtime.host_malloc import THRESHOLD

from .activations import Activations
from .candidates import DTYPES, Candidate

PHASES = ("forward", "backward", "step", "save")
SAVES = (None, "sync", "async")     # how the run saves checkpoints (save_checkpoint)
PLACES = ("device", "host", "nvme")
KEEP_IN_FLIGHT = 2          # runtime/comm.py
FP32 = 4


@dataclass(frozen=True)
class Shape:
    """What the memory model reads of a model laid out over ``world`` ranks (rank 0).

    Attributes:
        tensor_numels: each unique parameter tensor's elements.
        local: rank 0's rows of every parameter (elements).
        shard: the units' padded flat shards together (elements).
        unit_shards: each unit's padded shard (elements), in unit order.
        named_local: rank 0's rows summed over the state dict's names (a tied parameter
            under each of its names).
    """

    world: int
    tensor_numels: tuple[int, ...]
    local: int
    shard: int
    unit_shards: tuple[int, ...]
    named_local: int = 0

    @property
    def params(self) -> int:
        return sum(self.tensor_numels)

    @property
    def tensors(self) -> int:
        return len(self.tensor_numels)

    @property
    def largest_tensor(self) -> int:
        return max(self.tensor_numels, default=0)

    def largest_piece(self, stage: int) -> int:
        """Elements of the largest piece of one parameter a rank holds: the whole tensor
        under DDP (stage 0), its rows under ZeRO."""
        return self.largest_tensor if stage == 0 else -(-self.largest_tensor // self.world)

    def mapped(self, itemsize: int, threshold: int = THRESHOLD) -> int:
        """Bytes of the whole gradients that are blocks of ``threshold`` bytes or more:
        under zerofn's runtime on a CPU glibc maps each by itself and unmaps it when freed
        (runtime/host_malloc.py), so the heap's overhead does not apply to them."""
        return sum(itemsize * n for n in self.tensor_numels if itemsize * n >= threshold)

    @property
    def largest(self) -> int:
        return max(self.unit_shards, default=0)


def shape_of(model: nn.Module, world: int) -> Shape:
    """The model's layout at ``world`` ranks under zerofn's default units (a meta model
    will do: only shapes are read)."""
    units = build_units(model, None, world, 0)
    slots = [s for u in units for s in u.slots]
    rows = {id(s.param): s.local_numel for s in slots}
    return Shape(world=world, tensor_numels=tuple(s.numel for s in slots),
                 local=sum(s.local_numel for s in slots),
                 shard=sum(u.shard_numel for u in units),
                 unit_shards=tuple(u.shard_numel for u in units if u.slots),
                 named_local=sum(rows.get(id(p), 0) for _, p in
                                 model.named_parameters(remove_duplicate=False)))


def model_state(c: Candidate, shape: Shape) -> dict[str, dict[str, int]]:
    """Model-state bytes by place and role, as ``zf.model_state_bytes`` counts them after
    a step (ZeRO-1's whole gradients are backward's, not counted here)."""
    if c.offload is not None:
        return _offloaded_state(c, shape)
    cb = DTYPES[c.precision].itemsize
    counters = FP32 * shape.tensors
    if c.stage == 0:     # DDP: everything whole; torch's AdamW keeps a counter per tensor
        device = dict(params=cb * shape.params, grads=cb * shape.params,
                      optimizer=2 * FP32 * shape.params + counters)
    else:
        masters = FP32 * shape.local if cb != FP32 else 0
        device = dict(params=cb * (shape.local if c.stage == 3 else shape.params),
                      grads=cb * shape.shard,
                      optimizer=2 * FP32 * shape.local + masters + counters)
    return {"device": device, "host": _zeros(), "nvme": _zeros()}


def _offloaded_state(c: Candidate, shape: Shape) -> dict[str, dict[str, int]]:
    compute = DTYPES[c.precision]
    # rank 0's rows, exactly (the formulas share the count evenly)
    placed = estimate_placement(shape.local * shape.world, shape.world, c.stage, compute,
                                torch.bfloat16 if c.master_dtype == "bf16" else torch.float32,
                                offload=c.offload, offload_params=c.params,
                                largest_unit=shape.largest * shape.world,
                                state_dtype=DTYPES[c.state_dtype], ratio=c.ratio)
    out = {place: {role: int(placed[place][role]) for role in ("params", "grads", "optimizer")}
           for place in PLACES}
    # the reducer's gradient shards stay on the device whatever the home; the host's
    # Adam keeps a step counter per tensor; ZeRO-1/2 keep the whole parameters
    out["device"]["grads"] = compute.itemsize * shape.shard
    out["host" if c.offload == "cpu" else "nvme"]["optimizer"] += FP32 * shape.tensors
    if c.stage < 3:
        out["device"]["params"] = compute.itemsize * shape.params
    return out


def pool_bytes(c: Candidate, shape: Shape, bucket_size: int = 4_000_000,
               prefetch: int = 1, gloo: bool = True) -> int:
    """Bytes the runtime's buffer pool holds once a step has run (runtime/pool.py);
    ``gloo``: the collectives are gloo's (a CPU device), not NCCL's."""
    if c.stage == 0:
        return 0
    cb = DTYPES[c.precision].itemsize
    fulls = sorted((shape.world * n for n in shape.unit_shards), reverse=True)
    bound = FP32 * bucket_size
    fit = max(KEEP_IN_FLIGHT, bound // max(1, cb * fulls[0])) + 1
    if c.stage == 3:
        # gathered units share the pool's buffers with the send buffers (params.py): in
        # backward the one computing, the one prefetched and the one being unpacked
        fit = max(fit, 2 + prefetch)
    total = cb * sum(fulls[:fit])
    if gloo and shape.world > 2:
        # zerofn's gloo reduce-scatter brings every other rank's chunk into a scratch as
        # large as the send buffer (runtime/comm.py), held while it runs
        total += cb * fulls[0]
    if c.offload is None and cb != FP32:   # the step's pooled copies in the masters' dtype
        total += FP32 * max(shape.unit_shards)
    return total


def pool_buffer_bytes(c: Candidate, shape: Shape) -> int:
    """Bytes of the pool's largest buffer: a whole unit in the compute dtype."""
    return DTYPES[c.precision].itemsize * shape.world * shape.largest


def step_temporaries(c: Candidate, shape: Shape, device_is_host: bool = True) -> int:
    """Bytes torch's AdamW allocates while it steps (zerofn's CPU Adam: none): one fp32
    temporary (the denominator) of what it steps at once."""
    if c.offload is not None and c.ratio == 1.0:
        return 0
    if device_is_host:
        return FP32 * shape.largest_piece(c.stage)
    return FP32 * (shape.params if c.stage == 0 else shape.largest)


def activations_of(c: Candidate, acts: Activations) -> dict[str, int]:
    """Activation bytes on top of the model state per phase: DDP's and ZeRO-1's backward
    keeps every whole gradient (DDP's are its model state already)."""
    backward = acts.backward_kept if c.stage <= 1 else acts.backward_dropped
    if c.stage == 0:
        backward -= acts.grads
    return {"forward": acts.forward, "backward": backward, "step": 0, "save": 0}


def state_dict_bytes(c: Candidate, shape: Shape) -> dict[str, int]:
    """Bytes of the rank's state dicts (``get_state_dict``): the model's, its rows of every
    parameter by name as fp32 masters (tied parameters under each name); the optimizer's,
    two fp32 moments a row and a step counter per tensor."""
    # stage 0 holds whole parameters: rank 0's rows times the ranks, padding included
    named = shape.named_local * (1 if c.stage else shape.world)
    rows = shape.params if c.stage == 0 else shape.local
    return {"model": FP32 * named, "optim": 2 * FP32 * rows + FP32 * shape.tensors}


def save_copies(c: Candidate, shape: Shape, saves: str | None,
                device_is_host: bool = True) -> int:
    """Bytes of the state dicts a save copies to the host: a background save stages all of
    them; a synchronous one has DCP's copies: every tensor on a GPU, and on a CPU each that
    is a view into a larger buffer (its rows of a whole parameter past world 1, a unit's
    flat masters under ZeRO-3 or mixed precision, offloaded state in its arena), not
    torch's own moments or whole fp32 parameters."""
    sizes = state_dict_bytes(c, shape)
    if saves is None:
        return 0
    if saves == "async" or not device_is_host:
        return sizes["model"] + sizes["optim"]
    whole = c.stage == 0 or (c.stage < 3 and shape.world == 1 and c.precision == "fp32"
                             and c.offload is None)
    return (0 if whole else sizes["model"]) + (sizes["optim"] if c.offload else 0)


def save_held(c: Candidate, shape: Shape, saves: str | None,
              device_is_host: bool = True) -> int:
    """Bytes a save's copies hold at once. A synchronous save: DCP's copies of one data
    file (io/checkpoint/checksums.py: DCP keeps a file's copies until it is written, in
    files of ``FILE_BYTES`` at most, or one larger tensor's rows). A background save: all
    it stages, and on a GPU one file's copies more (it stages device tensors into views
    of one page-locked buffer, io/checkpoint/staging.py, and DCP copies each view)."""
    copies = save_copies(c, shape, saves, device_is_host)
    one_file = min(copies, max(FILE_BYTES, FP32 * shape.largest_piece(c.stage)))
    if saves == "sync":
        return one_file
    return copies + (0 if device_is_host else one_file)


def save_bytes(c: Candidate, shape: Shape, saves: str | None,
               device_is_host: bool = True) -> int:
    """Host bytes a checkpoint save holds between steps (io/checkpoint): its copies of the
    state dicts (``save_held``), NVMe state read into memory whole (its swap file's
    bytes), low-precision host state decoded into fp32 (12 bytes a row)."""
    if saves is None:
        return 0
    out = save_held(c, shape, saves, device_is_host)
    if c.offload == "nvme":
        out += sum(model_state(c, shape)["nvme"].values())
    elif c.offload == "cpu" and (c.state_dtype, c.master_dtype) != ("fp32", "fp32"):
        out += 3 * FP32 * int(shape.local * c.ratio)
    return out


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
    state = model_state(c, shape)
    resident = {p: sum(state[p].values()) for p in PLACES}
    pool = pool_bytes(c, shape, gloo=device_is_host)
    extra = activations_of(c, acts)
    extra["step"] = step_temporaries(c, shape, device_is_host)
    out = {}
    # Under zerofn's runtime on a CPU glibc maps every block of THRESHOLD bytes or more by
    # itself and unmaps it when freed (runtime/host_malloc.py): no heap overhead on the
    # pool's large buffers or on ZeRO-1's large whole gradients. (A GPU's caching
    # allocator: none counted.)
    pool_overhead = 0.0 if pool_buffer_bytes(c, shape) >= THRESHOLD else process.overhead
    mapped = {phase: 0 for phase in PHASES}
    if device_is_host and c.stage == 1:
        mapped["backward"] = min(shape.mapped(DTYPES[c.precision].itemsize), extra["backward"])
    # DDP's gradients are made in each backward and freed by zero_grad (set_to_none), in
    # a process whose mmap threshold glibc moves up to 32 MiB: the allocator's overhead
    # falls on them as on any other memory a step makes and frees
    remade = state["device"]["grads"] * process.overhead \
        if device_is_host and c.stage == 0 else 0
    for phase in PHASES:
        churn = pool * (1 + pool_overhead) + mapped[phase] + \
            (extra[phase] - mapped[phase]) * (1 + process.overhead) + \
            (remade if phase in ("backward", "step") else 0)
        device, host = resident["device"] + churn, resident["host"]
        if device_is_host:
            host, device = host + device, 0
        out[phase] = {"device": int(device), "host": int(host + process.base),
                      "nvme": resident["nvme"]}
    saving = save_bytes(c, shape, saves, device_is_host)
    if device_is_host and saves is not None:
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
    return {place: max(by_phase[ph][place] for ph in phases) for place in PLACES}


def _zeros() -> dict[str, int]:
    return dict(params=0, grads=0, optimizer=0)
