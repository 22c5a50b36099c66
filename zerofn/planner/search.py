"""``zf.plan``: every candidate way to train a model at a world size, its predicted peak
bytes per place and step time, those that fit the budgets sorted by time, and the choice
with what binds it; ``zf.auto`` applies the choice.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerofn.core.plan import HOMES

from . import activations as acts_mod
from . import calibration, libraries, memory, step_time
from .candidates import DTYPES, Candidate
from .owned import Owned, elementwise_problems, members, owned_of
from zerofn.runtime.memory import proc_bytes
from zerofn.runtime.owned import is_whole

from .probe import Machine, load_or_probe

GB = 1e9
# Predicted peaks must fit their budgets with this share to spare: the memory model's
# largest under-prediction measured on this machine, 5.4 % (DDP at four ranks), with room
# for saves outside the grid's (docs/plan.md; tests/test_plan.py checks it against the
# tables there).
MARGIN = 0.10


@dataclass
class Row:
    candidate: Candidate
    peak: dict[str, int]          # place -> bytes
    seconds: dict[str, float]
    fits: bool
    over: dict[str, int]          # place -> bytes above its budget (and the margin)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)   # phase -> place -> bytes

    def to_json(self) -> dict:
        return dict(candidate=self.candidate.to_json(), describe=self.candidate.describe(),
                    peak=self.peak, phases=self.phases, seconds=self.seconds, fits=self.fits,
                    over=self.over)


@dataclass
class PlanResult:
    """The plan: ``rows`` (every candidate, fitting ones first, each group by time),
    ``choice`` (the fastest that fits, or None) and ``reason``; for the loop, the chosen
    ``micro_batch`` and ``accum`` and the rank's batch split into them
    (``micro_batches``); ``owned``: the parameters whole-tensor optimizers hold and
    the balance of their owners (owned.py), or None."""

    rows: list[Row]
    budgets: dict[str, float | None]
    machine: str
    choice: Candidate | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    owned: Owned | None = None

    def fitting(self) -> list[Row]:
        return [r for r in self.rows if r.fits]

    @property
    def micro_batch(self) -> int:
        """Sequences each forward and backward takes on a rank (the choice's)."""
        return self.choice.micro_batch

    @property
    def accum(self) -> int:
        """Micro-batches each optimizer step accumulates (the choice's)."""
        return self.choice.accum

    def micro_batches(self, model: nn.Module, *batch: torch.Tensor):
        """The rank's batch (tensors whose first dimension is its ``micro_batch × accum``
        rows) as the choice's micro-batches: ``(tensors, context)`` pairs, each backward to
        run inside its context. Under DDP and ZeRO-1, which hold whole gradients through
        backward anyway, every micro-batch but the last skips the reduction
        (``model.no_sync()``); ZeRO-2 and ZeRO-3 reduce each one, keeping only gradient
        shards, as the plan's memory counts them. Divide each loss by ``accum``."""
        rows = {t.shape[0] for t in batch}
        if rows != {self.micro_batch * self.accum}:
            raise ValueError(
                f"a batch of {sorted(rows)} rows: the plan's is {self.micro_batch * self.accum} "
                f"({self.micro_batch} x {self.accum}) on each rank, every tensor alike; "
                f"give micro_batches the rank's whole batch for one optimizer step.")
        hold = self.choice.stage <= 1 and hasattr(model, "no_sync")
        for i in range(self.accum):
            part = tuple(t[i * self.micro_batch:(i + 1) * self.micro_batch] for t in batch)
            last = i == self.accum - 1
            yield part, contextlib.nullcontext() if last or not hold else model.no_sync()

    def table(self, limit: int | None = 20) -> str:
        head = f"{'#':>3} {'plan':<58}{'device GB':>10}{'host GB':>9}{'nvme GB':>9}" \
               f"{'step s':>9}  fits"
        out = [head, "-" * len(head)]
        for i, r in enumerate(self.rows[:limit]):
            p = r.peak
            out.append(f"{i + 1:>3} {r.candidate.describe():<58}{p['device'] / GB:>10.2f}"
                       f"{p['host'] / GB:>9.2f}{p['nvme'] / GB:>9.2f}"
                       f"{r.seconds['total']:>9.3f}  {'yes' if r.fits else 'no'}")
        if limit and len(self.rows) > limit:
            out.append(f"... {len(self.rows) - limit} more (--all, or --json)")
        owned = [] if self.owned is None else ["", self.owned.balance()]
        return "\n".join(out + owned + ["", self.reason])

    def to_json(self) -> dict:
        return dict(machine=self.machine, budgets=self.budgets,
                    choice=None if self.choice is None else self.choice.to_json(),
                    reason=self.reason, rows=[r.to_json() for r in self.rows],
                    owned=None if self.owned is None else self.owned.to_json())


class NoPlanFits(ValueError):
    """No candidate fits the budgets; the message names the smallest budgets that would."""


def candidates(batch: int, precision: str = "fp32", nvme: bool = True,
               checkpointing: bool = True, to_owner: bool = False) -> list[Candidate]:
    """Every configuration the plan weighs for ``batch`` sequences per rank per step;
    ``to_owner``: ZeRO-3's with ``reduce_to_owner`` too, where a whole-tensor optimizer
    owns parameters (the runtime refuses it with NVMe)."""
    offloads = [None, "cpu"] + ["nvme"] * nvme
    splits = [(m, batch // m) for m in _divisors(batch)][-3:]
    out = []
    for stage, off, ck, (mb, acc) in itertools.product(range(4), offloads,
                                                       (False, True)[:1 + checkpointing],
                                                       splits):
        homes = [dict()] if off is None else \
            [dict(ratio=1.0), dict(ratio=0.5)] + [dict(params=True)] * (stage == 3)
        stored = [dict()] if off is None or precision == "fp32" else \
            [dict(), dict(state_dtype="bf16")]
        owners = (False, True) if to_owner and stage == 3 and off != "nvme" else (False,)
        for home, st, own in itertools.product(homes, stored, owners):
            c = Candidate(stage=stage, precision=precision, offload=off, checkpoint=ck,
                          micro_batch=mb, accum=acc, to_owner=own, **home, **st)
            if not c.problems(2) and not (stage == 0 and precision != "fp32"):
                out.append(c)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(model: nn.Module, example_batch, *, world: int | None = None, group=None,
         batch: int | None = None,
         precision: str | None = None, device_budget: float | None = None,
         host_budget: float | None = None, disk_budget: float | None = None,
         machine: Machine | None = None, on_gpu: bool | None = None, nvme: bool = True,
         only: list[Candidate] | None = None, margin: float = MARGIN,
         saves: str | None = "sync", optimizers=None) -> PlanResult:
    """Every candidate for ``model`` at ``world`` ranks, predicted and sorted.

    Args:
        model: the model, real or on the meta device (only shapes are read).
        example_batch: one rank's micro-batch of inputs, as the model is called
            (a tensor or a tuple); its first dimension is the sequences.
        world: ranks the model trains on (data-parallel ranks).
        group: the data-parallel ranks as the transforms take them (``group=``): a
            ProcessGroup or a 1-D DeviceMesh; ``world`` is its size. Required for a model
            tensor parallelism split (``mesh["dp"]``): each rank's bytes are then its
            local tensors' over the data-parallel ranks, and its activations are not
            counted (``notes`` says so).
        batch: sequences per rank per optimizer step (default: the example's); split
            into micro-batch × accumulation.
        precision: compute dtype, "fp32" or "bf16" (default bf16 on a GPU, else fp32).
        device_budget, host_budget, disk_budget: bytes per rank (host: per machine
            share, as the probe measures free memory); None: unbounded.
        machine: the probe's rates (default: this machine's, probed once and cached).
        on_gpu: whether the device is a GPU (default: whether this machine has one).
        only: weigh these candidates instead of every one.
        margin: a candidate fits where its predicted device and host peaks, this share
            above them, are within the budgets (the memory model's error; NVMe's bytes
            are the swap files' own sizes, exact).
        saves: how the run saves checkpoints: "sync" (``save_checkpoint``), "async"
            (``async_save=True``: copies within the default ``staging_bytes``, held
            beside the steps that follow the call) or None (it does not).
        optimizers: the run's optimizer, or its sequence (Muon and AdamW), built over the
            model's parameters (a meta model's too); None: AdamW over every parameter.
            A whole-tensor optimizer's parameters (Muon, Adafactor, ``zf.whole_tensors``)
            are given the runtime's owners: each rank's bytes count the state and whole
            masters it owns, where its unit's home keeps the masters' rows, and the step's
            whole gradients (``owned``, printed with the table); every other parameter is
            counted as Adam's. ZeRO-3 is weighed with ``shard_params(reduce_to_owner=True)``
            beside it (not with NVMe, which the runtime refuses there): the owners hold
            their whole gradients from backward to the step, and the traffic is +1x the
            owned bytes, not +2x. Low-precision offloaded state is not planned beside
            them, as set-up refuses it (``notes`` says so).

    Raises:
        NoPlanFits: no candidate fits; names the smallest budgets that would.
    """
    if saves not in memory.SAVES:
        raise ValueError(f"saves={saves!r}: one of {memory.SAVES} (how the run saves "
                         f"checkpoints: save_checkpoint, async_save=True, or not at all).")
    problems = [] if optimizers is None else elementwise_problems(optimizers)
    if problems:
        raise ValueError(problems[0])
    split = _split_parameter(model)
    world = _data_parallel_world(world, group, split)
    owned = None if optimizers is None else owned_of(model, optimizers, world)
    inputs = example_batch if isinstance(example_batch, tuple) else (example_batch,)
    rows_in = inputs[0].shape[0]
    batch = batch or rows_in
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    precision = precision or ("bf16" if on_gpu else "fp32")
    machine = machine or load_or_probe()
    pool = only or candidates(batch, precision, nvme, to_owner=owned is not None)
    notes = [] if split is None else [_TP_NOTE]
    if owned is not None and any(not _owned_plans(c) for c in pool):
        pool = [c for c in pool if _owned_plans(c)]
        notes.append(_OWNED_NOTE)
    # each rank's layout: rank 0 holds the most rows, an owner its whole-tensor state
    shapes = [memory.shape_of(model, world, r, owned) for r in range(world if owned else 1)]
    shape = shapes[0]
    profile = _ActivationProfile(model, inputs) if split is None else _NoActivations()
    # the process: torch, zerofn and a process group (the probe's), and the libraries the
    # model comes from; the allocator's overhead from the probe's calibration
    process = memory.Process(base=int(machine.process["base"]) + libraries.resident_bytes(model),
                             overhead=calibration.of(machine))
    work = step_time.Work(tokens=batch * _tokens_per_sequence(inputs),
                          attention_flops=_attention_flops(model, inputs),
                          width=_config(model, "width", "hidden_size"))
    budgets = dict(device=device_budget, host=host_budget, nvme=disk_budget)
    rows = []
    for c in pool:
        phases = _busiest([memory.peaks(c, s, profile.at(c), process, device_is_host=not on_gpu,
                                        saves=saves) for s in shapes])
        peak = memory.largest(phases)
        if not on_gpu:
            peak["device"] = peak["host"]    # the device is this memory
        over = {p: int(need - b) for p, b in budgets.items()
                if b is not None and (need := _needed(peak, p, margin)) > b}
        rows.append(Row(c, peak, step_time.step_seconds(c, shape, work, machine, on_gpu),
                        not over, over, phases))
    rows.sort(key=lambda r: (not r.fits, r.seconds["total"], r.peak["device"], r.peak["host"]))
    result = PlanResult(rows, budgets, machine.device, notes=notes, owned=owned)
    fitting = result.fitting()
    if not fitting:
        raise NoPlanFits(" ".join([_refusal(rows, budgets, margin)] + notes))
    result.choice = fitting[0].candidate
    result.reason = " ".join([_reason(fitting[0], rows, margin)] + notes)
    return result


# What a plan of a model tensor parallelism split leaves out, in its notes and reason.
_TP_NOTE = ("(Tensor parallelism: the peaks count each rank's model state and buffer pool "
            "over the data-parallel ranks, its step's temporaries and the process, not its "
            "activations, which the planner does not model under tensor or sequence "
            "parallelism: leave room for them in the budgets. Nor does the step time count "
            "tensor parallelism's collectives.)")


# What a plan beside a whole-tensor optimizer leaves out, in its notes and reason.
_OWNED_NOTE = ("(Beside a whole-tensor optimizer the plan does not weigh low-precision "
               "offloaded state (state_dtype, master_dtype): zerofn's CPU Adam steps that "
               "form, and set-up refuses it beside Muon or Adafactor. docs/optimizers.md.)")


def _owned_plans(c: Candidate) -> bool:
    """Whether a run can take ``c`` beside a whole-tensor optimizer: any candidate but
    low-precision offloaded state, which set-up refuses there (runtime/homes/__init__.py's
    ``optimizer_problems``: zerofn's CPU Adam steps the stored form, and only Adam)."""
    return (c.state_dtype, c.master_dtype) == ("fp32", "fp32")


def _busiest(by_rank: list[dict]) -> dict[str, dict[str, int]]:
    """Each phase and place's largest bytes over the ranks' ``memory.peaks``."""
    return {ph: {place: max(r[ph][place] for r in by_rank) for place in by_rank[0][ph]}
            for ph in by_rank[0]}


def _needed(peak: dict[str, int], place: str, margin: float) -> int:
    """The budget ``place`` needs for a predicted ``peak``: the margin above it."""
    return peak[place] if place == "nvme" else int(peak[place] * (1 + margin))


def _tokens_per_sequence(inputs) -> int:
    first = inputs[0]
    return int(first.shape[1]) if first.dim() > 1 else 1


def _attention_flops(model: nn.Module, inputs) -> int:
    """Forward flops per token of attention's two context-long matmuls, where the model's
    config says its width and layers (zerofn.nanogpt, transformers' configs)."""
    width = _config(model, "width", "hidden_size")
    layers = _config(model, "layers", "num_hidden_layers")
    if not (width and layers):
        return 0
    return 4 * _tokens_per_sequence(inputs) * width * layers


def _config(model: nn.Module, *names):
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), None)


class _ActivationProfile:
    """Activations per (precision, checkpointing, micro-batch): measured at micro-batch 1
    and 2 and extended in a line, as every term of a transformer's activations grows with
    the sequences in it (the gradients' part does not)."""

    def __init__(self, model, inputs):
        self.model, self.inputs = model, inputs
        self._measured: dict = {}

    def _measure(self, precision: str, checkpoint: bool, rows: int):
        key = (precision, checkpoint, rows)
        if key not in self._measured:
            sliced = tuple(_rows(t, rows) for t in self.inputs)
            self._measured[key] = acts_mod.measure(self.model, sliced, DTYPES[precision],
                                                   checkpoint)
        return self._measured[key]

    def at(self, c: Candidate) -> acts_mod.Activations:
        one = self._measure(c.precision, c.checkpoint, 1)
        if c.micro_batch == 1:
            return one
        two = self._measure(c.precision, c.checkpoint, 2)
        m = c.micro_batch
        return acts_mod.Activations(**{
            f: getattr(one, f) + (m - 1) * (getattr(two, f) - getattr(one, f))
            for f in ("forward", "saved", "backward_kept", "backward_dropped", "grads")})


def _rows(t, n: int):
    if not torch.is_tensor(t) or t.dim() == 0:
        return t
    return torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta")


def _reason(best: Row, rows: list[Row], margin: float) -> str:
    faster = [r for r in rows if not r.fits and r.seconds["total"] < best.seconds["total"]]
    parts = [f"chosen: {best.candidate.describe()}: peak "
             + ", ".join(f"{p} {best.peak[p] / GB:.2f} GB" for p in HOMES
                         if best.peak[p]) + f"; step {best.seconds['total']:.3f} s"]
    terms = {k: v for k, v in best.seconds.items() if k != "total"}
    slowest = max(terms, key=terms.get)
    bound = {"compute": "compute", "comm": "the network (collectives)",
             "step": "the optimizer step" + (" (host Adam)" if best.candidate.offload else ""),
             "copies": "the host/NVMe copies (PCIe, disk)"}[slowest]
    parts.append(f"its time is bound by {bound} ({terms[slowest]:.3f} s of the step)")
    if faster:
        r = min(faster, key=lambda r: r.seconds["total"])
        place = max(r.over, key=r.over.get)
        parts.append(f"the fastest candidate, {r.candidate.describe()} "
                     f"({r.seconds['total']:.3f} s), needs "
                     f"{_needed(r.peak, place, margin) / GB:.2f} GB of {place} memory "
                     f"(its peak and a {margin:.0%} margin): {place} memory binds")
    return "; ".join(parts) + "."


def _refusal(rows: list[Row], budgets: dict, margin: float) -> str:
    """The smallest budget of each bound place that, with the others as given, fits."""
    set_budgets = {p: b for p, b in budgets.items() if b is not None}
    lines = ["no candidate fits " + ", ".join(f"{p} {b / GB:.2f} GB"
                                               for p, b in set_budgets.items()) + "."]
    for place in set_budgets:
        others_fit = [r for r in rows if all(p == place or p not in r.over for p in r.over)]
        if others_fit:
            r = min(others_fit, key=lambda r: r.peak[place])
            lines.append(f"the smallest {place} budget that fits (the others as given) is "
                         f"{_needed(r.peak, place, margin) / GB:.2f} GB (a {margin:.0%} "
                         f"margin over the predicted peak): {r.candidate.describe()}")
    r = min(rows, key=lambda r: sum(r.over.values()))
    lines.append("the nearest candidate, " + r.candidate.describe() + ", needs " + ", ".join(
        f"{p} {_needed(r.peak, p, margin) / GB:.2f} GB" for p in set_budgets) + ".")
    return " ".join(lines)


def _split_parameter(model: nn.Module) -> str | None:
    """The name of a parameter tensor parallelism split (a DTensor), or None."""
    return next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)


def _data_parallel_world(world: int | None, group, split: str | None) -> int:
    """The data-parallel ranks ``plan`` lays the model out over, from ``world`` or
    ``group``; a split model needs ``group``, so that ``world`` cannot be read as every
    rank (data- and tensor-parallel) of the job."""
    if group is None:
        if split is not None:
            raise ValueError(
                f"parameter {split!r} is a DTensor (the model was split by "
                "parallelize_module): give zf.plan the data-parallel ranks as the transforms "
                "take them, group=mesh['dp'], not world=; the plan lays out each rank's local "
                "tensors over them.")
        if world is None:
            raise ValueError("zf.plan needs world= (the ranks the model trains on) or group= "
                             "(a ProcessGroup or 1-D DeviceMesh of them).")
        return world
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"zf.plan models one data-parallel dimension; group= is a {group.ndim}-D "
                "DeviceMesh (hybrid sharding is not planned yet): pass a 1-D mesh, "
                "mesh['dp'].")
        size = group.size()
    else:
        size = dist.get_world_size(group)
    if world is not None and world != size:
        raise ValueError(f"world={world} but group= has {size} ranks: give one of them.")
    return size


class _NoActivations:
    """A split model's activations: not counted (``_TP_NOTE``). The planner's measure runs
    the model on fake plain tensors, and a split model's forward takes DTensors and runs
    tensor parallelism's collectives."""

    def at(self, c: Candidate) -> acts_mod.Activations:
        return acts_mod.Activations(0, 0, 0, 0, 0)


def auto(model: nn.Module, optimizer, example_batch, *, world: int | None = None,
         nvme_path: str | None = None, init=None, quiet: bool = False, **plan_kw):
    """Plan, apply the choice, say it: ``(model, optimizer, plan_result)``. The choice's
    micro-batch × accumulation is the loop's to follow: ``plan_result.micro_batches(model,
    *batch)`` splits each step's batch so (docs/plan.md shows the loop). A budget not
    given is what is free now (``free_budgets``): the choice fits this machine."""
    split = _split_parameter(model)
    if split is not None:
        raise ValueError(
            f"zf.auto does not apply a plan to a model tensor parallelism split (parameter "
            f"{split!r} is a DTensor): the planner does not model its activations, so a "
            "choice that fits by the plan may not. Plan it with zf.plan(model, batch, "
            "group=mesh['dp']), leave room for the activations, and apply the stage by "
            "hand with group=mesh['dp'] (docs/parallelism.md).")
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    if plan_kw.get("on_gpu") is None:
        plan_kw["on_gpu"] = torch.cuda.is_available()
    for place, free in free_budgets(plan_kw["on_gpu"]).items():
        if plan_kw.get(f"{place}_budget") is None:
            plan_kw[f"{place}_budget"] = free
    # (a whole-tensor optimizer's owners are planned; any other is planned as Adam)
    whole = any(is_whole(m) for m in members(optimizer))
    result = plan(model, example_batch, world=world, nvme=nvme_path is not None,
                  optimizers=optimizer if whole else None, **plan_kw)
    model, optimizer = result.choice.apply(model, optimizer, nvme_path, init)
    if not quiet and (not dist.is_initialized() or dist.get_rank() == 0):
        balance = "" if result.owned is None else "\n" + result.owned.balance()
        print(f"zerofn plan: {result.reason}{balance}", file=sys.stderr, flush=True)
    return model, optimizer, result


def free_budgets(on_gpu: bool) -> dict[str, int]:
    """What a rank may use where no budget is given: this machine's available host memory
    shared by its ranks (torchrun's ``LOCAL_WORLD_SIZE``), and on a GPU the device's free
    memory now."""
    import os
    out = {"host": proc_bytes("MemAvailable", "/proc/meminfo")
           // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    if on_gpu:
        out["device"] = torch.cuda.mem_get_info()[0]
    return out


def dumps(result: PlanResult) -> str:
    return json.dumps(result.to_json(), indent=1)
