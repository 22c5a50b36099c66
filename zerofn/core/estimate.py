"""Model-state memory per rank before building anything, and where offload puts it
(``zerofn estimate``'s formulas; its command line is zerofn/planner/cli.py).

The formulas are those of docs/design.md (section 4), the same accounting
``zf.model_state_bytes`` measures on a live model: Ψ parameters, N ranks, compute dtype of
c bytes, masters and optimizer state in fp32.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .plan import HOMES, OffloadPolicy, Plan
from .units import build_units

HOMES = HOMES
HOST_RING_DEPTH = 3    # offload("cpu")'s ring slots (runtime/homes/ring.py)
ROLES = ("params", "grads", "optimizer")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP32 = torch.float32.itemsize


def estimate_model_state_bytes(params: int | nn.Module, world: int, stage: int,
                               param_dtype: torch.dtype = torch.bfloat16,
                               master_dtype: torch.dtype = torch.float32,
                               optimizer_states: int = 2) -> dict[str, float]:
    """Bytes of params, grads and optimizer state one rank holds, and their total.

    Args:
        params: a parameter count, or a module whose parameters are counted.
        world: ranks the state is sharded over.
        stage: 0 (replicated, like DDP), 1, 2 or 3.
        param_dtype: compute dtype of params and grads.
        master_dtype: dtype of master params and optimizer state; when it equals
            ``param_dtype`` the params are their own master.
        optimizer_states: tensors of state per param (Adam: 2, SGD momentum: 1).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes.

    Example (7B params on 8 ranks, bf16 + Adam, in GB):
        >>> [estimate_model_state_bytes(7e9, 8, s)["total"] / 1e9 for s in range(4)]
        [112.0, 38.5, 26.25, 14.0]
    """
    placed = estimate_placement(params, world, stage, param_dtype, master_dtype,
                                optimizer_states)
    out = {role: placed["device"][role] for role in ROLES}
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class Layout:
    """What the model-state formulas read of one rank's share of a model, in elements.
    ``Layout.of`` makes it from a parameter count or a module (docs/design.md's Ψ/N: an
    even share, every row trains); the planner gives rank 0's exact rows, padding, frozen
    parameters and step counters included (planner/memory.py).

    Attributes:
        whole: every parameter whole (what stages 0-2 hold).
        rows: the rank's rows of every parameter.
        whole_trainable: of ``whole``, the parameters that train (stage 0's moments).
        trainable: of ``rows``, those that train (a frozen row has masters only: no
            moments, no gradient).
        grads: gradient elements the rank keeps on the device whatever the home (ZeRO-1's
            whole gradients where ``Layout.of`` counts them, else the reduced shards).
        counters: 4-byte step counters the optimizer keeps (one per trainable tensor).
        largest: the rank's rows of the largest unit (offload's rings); 0 where unknown.
        ring_slots: offload("cpu")'s host ring's slots.
        ring_written: of ``largest``, the rows the gradients write into a ring slot (where
            the device is the CPU, a slot's rows never written are never resident).
    """

    whole: float
    rows: float
    whole_trainable: float
    trainable: float
    grads: float
    counters: int = 0
    largest: float = 0
    ring_slots: int = HOST_RING_DEPTH
    ring_written: float | None = None

    @classmethod
    def of(cls, params: int | nn.Module, world: int, stage: int,
           largest_unit: int | None = None) -> "Layout":
        n = count_params(params)
        return cls(whole=n, rows=n / world, whole_trainable=n, trainable=n / world,
                   grads=n if stage <= 1 else n / world,
                   largest=_largest_share(params, world, largest_unit),
                   ring_slots=_ring_slots(params))


def estimate_placement(params: int | nn.Module | Layout, world: int, stage: int,
                       param_dtype: torch.dtype = torch.bfloat16,
                       master_dtype: torch.dtype = torch.float32, optimizer_states: int = 2,
                       *, reduce_dtype: torch.dtype | None = None, offload: str | None = None,
                       offload_params: bool = False,
                       units_in_flight: int = OffloadPolicy.units_in_flight,
                       largest_unit: int | None = None, state_dtype: torch.dtype | None = None,
                       ratio: float = 1.0, host_ring: bool = True) -> dict[str, dict[str, float]]:
    """Model-state bytes one rank holds, by place and role, as zerofn lays them out.

    Without offload everything is on the device. ``offload("cpu")`` moves the fp32
    masters and optimizer state to host memory (masters there even in fp32: the device
    keeps its own compute copy). With Adam the gradients come down, and the updated rows
    in the compute dtype go up, through a host ring of three units' rows
    (``HOST_RING_DEPTH`` times, or once per unit where there are fewer, a rank's share of
    the largest unit, in the reduce dtype,
    plus the compute dtype where the two differ; counted where the largest unit is
    known). Another optimizer, steps on the host from a gradient landing buffer per
    unit in the masters' dtype; under mixed precision the host also keeps a copy of the
    rows in the compute dtype, which goes to the device from there;
    ``params=True`` (ZeRO-3) moves the compute shards to the host too, where for
    ``offload("cpu")`` they are those rows (the masters themselves when the compute
    dtype is theirs), no further copy. ``offload("nvme")``
    keeps masters and optimizer state (and with ``params=True`` the compute shards) in the
    swap file; host memory then holds the gradient landing buffer plus a staging ring of
    ``units_in_flight`` buffers, each a rank's share of the largest unit's swap block
    (master, two moments and, under mixed precision or ``params=True``, the compute rows):
    its compute-shard part counts as ``params``, the rest as ``optimizer``, as
    ``zf.model_state_bytes`` counts them. It is left out where the largest unit is unknown.

    Adam/AdamW (``optimizer_states=2``) steps in zerofn's C++ kernel, which reads the
    gradients in the reduce dtype; other optimizers step fp32 gradients on the host.
    Shards are rounded up to whole rows per rank, which this ignores.

    Args:
        params, world, stage, param_dtype, master_dtype, optimizer_states: as for
            ``estimate_model_state_bytes``; ``params`` may also be a ``Layout``.
        reduce_dtype: dtype gradients are reduced and held in (default ``param_dtype``).
        offload: None, "cpu" or "nvme".
        offload_params: ZeRO-3 only: offload the parameter shards too.
        units_in_flight: NVMe staging buffers, as ``offload`` takes it.
        state_dtype: how the optimizer's moments are stored (default ``master_dtype``);
            ``torch.int8`` is 8-bit codes with an fp32 scale per 256 (1.016 bytes).
            ``offload("cpu" | "nvme", state_dtype=..., master_dtype=...)`` stores them
            so; bf16 masters under a bf16 compute dtype are the rows the device reads, no
            copy.
        host_ring: whether offload("cpu") passes the gradients and rows through its host
            ring (False under ``overlap_step`` or ``ratio="auto"``, where each unit has a
            landing buffer and, under mixed precision, a compute copy).
        ratio: offload's share of the optimizer state (default all): the rest stays on
            the device in fp32 (and, under ``offload_params``, its parameter shards),
            stepped from the reduced gradients where they lie.
        largest_unit: parameters of the largest unit (e.g. one transformer block, or the
            root's embeddings and head), for NVMe's staging ring and offload("cpu")'s host
            ring; by default found from
            ``params`` when it is a module (zerofn's default units: each module of an
            outermost ``ModuleList``, and the root for the rest), else the ring is not
            counted. (A ``Layout`` carries its own.)

    Returns:
        ``{place: {"params", "grads", "optimizer", "total"}}`` in bytes for every place in
        ("device", "host", "nvme"), zeros where nothing goes.

    Example (7B, 8 ranks, bf16, ZeRO-3 with the optimizer offloaded to the host, in GB):
        >>> p = estimate_placement(7e9, 8, 3, offload="cpu")
        >>> {place: p[place]["total"] / 1e9 for place in p}
        {'device': 3.5, 'host': 10.5, 'nvme': 0.0}

    (The host ring is left out there: a count says nothing of the largest unit.)
    """
    _check(stage, offload, offload_params)
    lay = params if isinstance(params, Layout) else \
        Layout.of(params, world, stage, largest_unit)
    c, m = param_dtype.itemsize, master_dtype.itemsize
    states = optimizer_states * moment_bytes(state_dtype or master_dtype)
    r = (reduce_dtype or param_dtype).itemsize
    share, n = lay.rows, lay.whole
    out = {place: dict.fromkeys(ROLES, 0.0) for place in HOMES}
    params_bytes = c * (share if stage == 3 else n)
    off = "nvme" if offload == "nvme" else "host"
    out[off if offload_params else "device"]["params"] = params_bytes * (
        ratio if offload_params else 1)
    out["device"]["params"] += params_bytes * (1 - ratio) * offload_params
    # ZeRO-1 keeps the full gradients until the step (as Layout.of counts them); ZeRO-2/3
    # the reduced shard.
    out["device"]["grads"] = (c if stage <= 1 else r) * lay.grads
    if offload is None:
        master = 0 if master_dtype == param_dtype else m
        out["device"]["optimizer"] = master * (share if stage else n) + FP32 * lay.counters \
            + states * (lay.trainable if stage else lay.whole_trainable)
    else:
        # offload("cpu", params=True) computes on the rows the step writes: the masters
        # themselves in the compute dtype (counted as params, as without offload), else
        # the compute-dtype copy below, which offload("cpu") keeps in any case.
        shard_is_rows = offload == "cpu" and offload_params
        master = 0 if shard_is_rows and c == m else m
        # (a frozen row has masters but no moments; the home's step keeps the counters)
        out[off]["optimizer"] = (master * share + states * lay.trainable) * ratio \
            + FP32 * lay.counters
        landing = r if optimizer_states == 2 else m
        if offload == "cpu" and not offload_params and optimizer_states == 2 and host_ring:
            ring = lay.ring_slots * lay.largest
            written = lay.largest if lay.ring_written is None else lay.ring_written
            out["host"]["grads"] = r * lay.ring_slots * written
            if c not in (m, r):    # the rows go up from their own part of each slot
                out["host"]["params"] += c * ring
        else:
            out["host"]["grads"] = landing * share * ratio
            if offload == "cpu" and c != m and not shard_is_rows:   # the rows sent up
                out["host"]["params"] += c * share * ratio
        # ratio < 1: the device's share keeps fp32 masters and moments; it steps from the
        # reduced gradients where they lie (runtime/homes/device.py: no landing buffer)
        out["device"]["optimizer"] += FP32 * (share + optimizer_states * lay.trainable) \
            * (1 - ratio)
        if offload == "nvme":
            ring = units_in_flight * lay.largest
            shard = c if offload_params else 0
            rows = c if c != m and not offload_params else 0
            out["host"]["params"] += ring * shard
            out["host"]["optimizer"] += ring * (m + states + rows)
    for place in out.values():
        place["total"] = sum(place[role] for role in ROLES)
    return out


def moment_bytes(dtype: torch.dtype) -> float:
    """Bytes a parameter's optimizer moment takes in ``dtype``; int8 codes carry an fp32
    scale per block of 256 (zerofn.optim.QUANT_BLOCK)."""
    return 1 + 4 / 256 if dtype == torch.int8 else dtype.itemsize


def count_params(params: int | nn.Module) -> int:
    return sum(p.numel() for p in params.parameters()) if isinstance(params, nn.Module) \
        else params


def _largest_share(params, world: int, largest_unit: int | None) -> float:
    """A rank's rows of the largest unit: from ``largest_unit``, else from the module's
    units as zerofn forms them by default (0 where neither is known)."""
    if largest_unit is not None:
        return largest_unit / world
    if not isinstance(params, nn.Module):
        return 0
    return max(u.shard_numel for u in build_units(params, None, world, 0))


def _ring_slots(params) -> int:
    """The host ring's slots: one per unit up to ``HOST_RING_DEPTH``."""
    if not isinstance(params, nn.Module):
        return HOST_RING_DEPTH
    return max(1, min(HOST_RING_DEPTH, sum(bool(u.slots) for u in build_units(params, None,
                                                                               1, 0))))


def _check(stage: int, offload: str | None, offload_params: bool) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}.")
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}.")
    if offload_params and offload is None:
        raise ValueError("offload_params needs offload='cpu' or 'nvme': it offloads the "
                         "parameter shards too.")
    plan = Plan(stage, ("offload",) if offload else (),     # as the transforms would make it
                {"offload": offload, "offload_params": offload_params})
    if plan.problems():
        raise ValueError(" ".join(plan.problems()))


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: ``7e9``, ``7B``, ``1.3b``, ``350M``, ``125_000``.

    Example:
        >>> parse_count("1.3B"), parse_count("7e9"), parse_count("350m")
        (1300000000, 7000000000, 350000000)
    """
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*",
                         text.lower())
    if not match:
        raise ValueError(f"{text!r} is not a parameter count; write e.g. 7e9, 7B, 1.3B or 350M.")
    value = float(match.group(1).replace("_", "")) * _SUFFIX[match.group(2)]
    if value < 1:
        raise ValueError(f"{text!r}: a model has at least one parameter.")
    return round(value)


def table(params: int | nn.Module, world: int, stages, param_dtype: torch.dtype,
          optimizer_states: int = 2, offload: str | None = None, offload_params: bool = False,
          **more) -> str:
    """The estimate as a text table: one row per stage and place that holds bytes, in GB.
    ``more``: ``estimate_placement``'s keywords (the stored dtypes, NVMe's ring)."""
    header = f"{'stage':<8}{'place':<8}" + "".join(f"{h:>11}" for h in ROLES + ("total",))
    rows = [header, "-" * len(header)]
    for stage in stages:
        placed = estimate_placement(params, world, stage, param_dtype,
                                    optimizer_states=optimizer_states, offload=offload,
                                    offload_params=offload_params, **more)
        for place in HOMES:
            if place == "device" or placed[place]["total"]:
                rows.append(f"{'ZeRO-' + str(stage):<8}{place:<8}" + "".join(
                    f"{placed[place][k] / 1e9:>11,.2f}" for k in ROLES + ("total",)))
    return "\n".join(rows)
