"""Whole-tensor optimizers (Muon, Adafactor) in the plan: which parameters are owned, by
which rank, and what each owner holds.

The owners are the runtime's own (runtime/owned.py: ``whole_params`` in its order, given to
``owners``), so the plan names the ranks a run will. What an owner holds is measured, not
assumed: each member steps the parameters a rank owns, all in one call as the owner's
step makes it, on fake whole tensors (no memory, no arithmetic) under torch's
``MemTracker``, which gives the state it keeps (Muon's momentum, Adafactor's row and
column statistics and step) and the peak of its own work buffers (Newton-Schulz's, and
what a for-loop step keeps of one tensor's while it computes the next's). On top of that
state an owner keeps its parameters' whole fp32 masters between steps, and during the
step the whole gradients gathered to it.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from zerofn.core.units import aligned
from zerofn.runtime.chain import step_without_hooks
from zerofn.runtime.owned import is_whole, owners, whole_params

from .candidates import NAMES

FP32 = 4     # the masters' and the owned state's dtype (fp32 masters: no offload)


@dataclass(frozen=True)
class OwnedTensor:
    """One owned parameter.

    Attributes:
        name: its name in the model.
        shape: its whole shape.
        owner: the rank that steps it whole.
        optimizer: the class name of the optimizer that holds it.
        state: each tensor of the optimizer's state for it, as ``(shape, bytes)``.
    """

    name: str
    shape: tuple[int, ...]
    owner: int
    optimizer: str
    state: tuple[tuple[tuple[int, ...], int], ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def state_bytes(self) -> int:
        return sum(b for _, b in self.state)

    def padded(self, world: int) -> int:
        """Elements of the gather's buffer on the owner: each rank's rows padded to the
        shard's ``chunk`` rows (runtime/owned.py's ``_piece``)."""
        rows = self.shape[0] if self.shape else 1
        return world * -(-rows // world) * (self.numel // max(rows, 1))

    def columns(self, world: int) -> int:
        """Elements of its columns in its unit's rank-major buffers: each rank's rows padded
        to ``chunk`` rows and aligned as the shard aligns each slot (units.py)."""
        rows = self.shape[0] if self.shape else 1
        return world * aligned(-(-rows // world) * (self.numel // max(rows, 1)))

    def rows_of(self, world: int, rank: int) -> int:
        """Rows ``rank`` holds under ``torch.chunk``'s split (units.py's layout)."""
        rows = self.shape[0] if self.shape else 1
        chunk = -(-rows // world)
        return max(0, min(chunk, rows - rank * chunk))


@dataclass(frozen=True)
class Owned:
    """The owned parameters of a model's optimizers at ``world`` ranks, each rank's share
    of the update's work (``load``: runtime/owned.py's ``cost``), the bytes its
    optimizers' steps allocate beyond their state at their peak (``work``: the rank's own
    parameters; ``work_all``: every owned parameter, as DDP steps them) and the matmul
    flops they run, by dtype (``flops``, ``flops_all``: Newton-Schulz's in bf16)."""

    world: int
    tensors: tuple[OwnedTensor, ...]
    load: tuple[float, ...]
    work: tuple[int, ...]
    work_all: int
    flops: tuple[dict[str, int], ...]
    flops_all: dict[str, int]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)

    def of(self, rank: int) -> list[OwnedTensor]:
        return [t for t in self.tensors if t.owner == rank]

    def held(self, rank: int, stage: int, names: frozenset[str] | None = None) -> int:
        """Optimizer-role bytes ``rank`` holds for owned parameters between steps (of those
        ``names`` names, where given): under DDP every rank steps every parameter whole,
        with its state; under ZeRO the owner alone holds the state and its whole fp32
        masters."""
        if stage == 0:
            return sum(t.state_bytes for t in self.tensors if names is None or t.name in names)
        return sum(t.state_bytes + FP32 * t.numel for t in self.of(rank)
                   if names is None or t.name in names)

    def step_bytes(self, rank: int, stage: int, to_owner: bool = False,
                   grad_itemsize: int = FP32) -> int:
        """Bytes the owned step allocates on ``rank`` at its peak: under ZeRO the whole
        gradients of its parameters, gathered before any owner steps and held through the
        step (``to_owner``: reduced to it in backward already, ``to_owner_grads``, and
        cast to the masters' fp32 here where they are in fewer bits), then the largest of
        its optimizer's own work buffers and of one whole tensor on its way back (the
        padded copy an owner scatters, or a broadcast's receive buffer on the other ranks
        at ZeRO-1/2); under DDP the work buffers. (Gloo's worker thread sometimes holds
        a collective's buffer a little past its return: up to one whole tensor more, not
        counted.)"""
        if stage == 0:
            return self.work_all
        mine, work = self.of(rank), self.work[rank]
        gathered = sum(FP32 * t.padded(self.world) for t in mine) if not to_owner else \
            sum(FP32 * t.numel for t in mine) if grad_itemsize != FP32 else 0
        back = [FP32 * t.padded(self.world) for t in mine] if stage == 3 else \
            [FP32 * t.numel for t in self.tensors if t.owner != rank]
        return gathered + max([work] + back)

    def to_owner_grads(self, rank: int, itemsize: int) -> int:
        """Bytes of the whole gradients ``rank`` holds as their owner from backward to the
        step under ``reduce_to_owner`` (runtime/to_owner.py): each its reduce's buffer,
        padded to ``chunk`` rows a rank, in the gradients' dtype (``itemsize``)."""
        return sum(itemsize * t.padded(self.world) for t in self.of(rank))

    def spread(self, rank: int) -> int:
        """Bytes of owned state a state dict shows on ``rank``: each state tensor of the
        parameter's shape as its rows, any other whole (runtime/owned.py's [Note: owned
        state in state dicts])."""
        out = 0
        for t in self.tensors:
            for shape, nbytes in t.state:
                out += nbytes * t.rows_of(self.world, rank) // t.shape[0] \
                    if shape == t.shape and t.shape else nbytes
        return out

    def balance(self) -> str:
        """Each owner's share: its parameters and its part of the update's work (for Muon
        Newton-Schulz's flops), and the busiest rank over the mean."""
        total = sum(self.load) or 1.0
        mean = total / self.world
        kinds = "/".join(dict.fromkeys(t.optimizer for t in self.tensors))
        lines = [f"owned ({kinds}): {len(self.tensors)} parameters, each stepped whole by "
                 f"one owner under ZeRO (by every rank under DDP); the update's work "
                 f"(Newton-Schulz's flops for a matrix, else its elements) by owner, the "
                 f"busiest {max(self.load) / mean:.2f}x the mean:"]
        for r in range(self.world):
            mine = self.of(r)
            lines.append(f"  rank {r}: {self.load[r] / total:.1%} of the work, {len(mine)} "
                         f"parameters, {sum(t.numel for t in mine):,} elements")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dict(world=self.world, load=list(self.load),
                    owners={t.name: t.owner for t in self.tensors})


def members(optimizers) -> tuple:
    """An optimizer or a sequence of them (as the transforms take them), as a tuple."""
    return tuple(optimizers) if isinstance(optimizers, (list, tuple)) else (optimizers,)


def owned_of(model: nn.Module, optimizers, world: int) -> Owned | None:
    """The owned parameters of ``optimizers`` (over ``model``'s parameters, a meta model's
    too) at ``world`` ranks, or None where no member steps whole tensors."""
    ms = members(optimizers)
    pairs = [(m, p) for m, p in whole_params(ms) if p.requires_grad]
    if not pairs:
        return None
    name_of = {p: n for n, p in model.named_parameters()}
    missing = [type(m).__name__ for m, p in pairs if p not in name_of]
    if missing:
        raise ValueError(f"{missing[0]} holds a parameter that is not the model's: give "
                         "zf.plan the optimizers built over this model's parameters.")
    owner, load = owners([tuple(p.shape) for _, p in pairs], world)
    state: dict = {}
    ranks = [_measure_all(ms, [p for (_, p), o in zip(pairs, owner) if o == r], state)
             for r in range(world)]
    work_all, flops_all = _measure_all(ms, [p for _, p in pairs], {})
    tensors = tuple(OwnedTensor(name_of[p], tuple(p.shape), o, type(m).__name__, state[p])
                    for (m, p), o in zip(pairs, owner))
    return Owned(world, tensors, tuple(load), tuple(w for w, _ in ranks), work_all,
                 tuple(f for _, f in ranks), flops_all)


def elementwise_problems(optimizers) -> list[str]:
    """What the plan cannot count: it counts Adam's state (two fp32 moments and a step
    counter) for every parameter no whole-tensor optimizer holds."""
    return [f"zf.plan counts Adam's state for the parameters a whole-tensor optimizer does "
            f"not hold, and {type(m).__name__} holds some: give them to Adam or AdamW, or "
            f"plan without optimizers= (Adam over every parameter)."
            for m in members(optimizers)
            if not is_whole(m) and type(m).__name__ not in ("Adam", "AdamW")]


class _Counted(TorchDispatchMode):
    """Counts the matmul flops of the ops under it by dtype (torch's own ``flop_registry``,
    as ``FlopCounterMode`` counts them), and answers a value read (``.item()``:
    Adafactor reads its parameter's norm) with 1.0: fake tensors carry no values, and
    what the step allocates and computes does not depend on them."""

    def __init__(self):
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0
        out = func(*args, **(kwargs or {}))
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops[NAMES.get(out.dtype, "fp32")] += count(*args, **(kwargs or {}),
                                                             out_val=out)
        return out


def _measure_all(members_: tuple, params: list, state: dict) -> tuple[int, dict[str, int]]:
    """Each member's step on the ``params`` it holds, one after another as the owner's
    step runs them (each freeing its buffers on return): the largest work buffers' peak,
    and the flops of them all."""
    work, flops = 0, defaultdict(int)
    for m in members_:
        w, f = _measure(m, params, state)
        work = max(work, w)
        for k, v in f.items():
            flops[k] += v
    return work, dict(flops)


def _measure(member, params: list, state: dict) -> tuple[int, dict[str, int]]:
    """``member``'s own step on fake whole fp32 stand-ins of ``params`` (of those it holds;
    each in its own group, its state table set aside), as an owner's step runs it: the
    bytes its work buffers take at their peak beyond what it leaves, and its matmul flops
    by dtype. Each parameter's state, as ``(shape, bytes)`` per tensor, goes into
    ``state``."""
    held = {p for g in member.param_groups for p in g["params"]}
    params = [p for p in params if p in held]
    if not params:
        return 0, {}
    saved, table = [list(g["params"]) for g in member.param_groups], member.state
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = {p: torch.empty(p.shape, dtype=torch.float32, device="cpu") for p in params}
        for f in fakes.values():
            f.grad = torch.empty_like(f)
        tracker = MemTracker()
        tracker.track_external(*fakes.values(), *(f.grad for f in fakes.values()))
        try:
            member.state = defaultdict(dict)
            for g, held in zip(member.param_groups, saved):
                g["params"][:] = [fakes[p] for p in held if p in fakes]
            counted = _Counted()
            with warnings.catch_warnings():
                # (the tracker warns of each in-place op's None result, which holds nothing)
                warnings.filterwarnings("ignore", "Expected a tensor", UserWarning)
                with tracker, counted:
                    step_without_hooks(member)
                    peak, left = _live(tracker, "peak"), _live(tracker, "current")
            state.update((p, tuple((tuple(v.shape), v.nbytes) for v in member.state[f].values()
                                   if torch.is_tensor(v))) for p, f in fakes.items())
        finally:
            for g, params in zip(member.param_groups, saved):
                g["params"][:] = params
            member.state = table
    return peak - left, dict(counted.flops)


def _live(tracker: MemTracker, kind: str) -> int:
    return sum(v["Total"] for v in tracker.get_tracker_snapshot(kind).values())

