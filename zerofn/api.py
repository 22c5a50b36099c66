"""The public transforms: each is a factory of a ``Transform`` that edits a plan.

Above the runtime and the observers: applying a transform builds the runtime from the
combined plan (``apply_plan``), with the failure watch and the TensorBoard monitor as the
kinds of observer it asks (``OBSERVERS``), named here rather than registered by imports.

A ``Transform`` is a callable ``(model, optimizer) -> (model, optimizer)`` holding only its
options. Applying one to a model that an earlier transform already sharded rebuilds the
runtime from the combined plan, so ``t2(*t1(m, o))`` equals ``compose(t1, t2)(m, o)``
once ``t1`` shards: a transform that shards nothing by itself (mixed_precision, offload,
tensorboard) raises on an untransformed model, where ``compose`` takes any order.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
from typing import Callable

import torch
from torch import nn

from .core.plan import (MONITOR_OPTIONS, NONFINITE_RULES, OFFLOAD_OPTIONS, PARAM_OPTIONS,
                        PRECISION_OPTIONS, SHARED_OPTIONS, Plan)
from .core.paths import local_only
from .observe.failures import Watch
from .observe.tensorboard import Monitor
from .runtime import apply_plan

Edit = Callable[[Plan], Plan]
PROFILE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")   # torch.profiler.schedule's


# The kinds of observer every runtime is built with ([Note: observers] in runtime/events.py).
OBSERVERS = (Watch, Monitor)


class Transform:
    """A composable transform: ``model = transform(model)``, then build the optimizer over
    ``model.parameters()`` (FSDP2's order: zerofn binds it at its first step), or
    ``model, optimizer = transform(model, optimizer)`` with one built before."""

    def __init__(self, name: str, edits: tuple[Edit, ...]):
        self.name = name
        self._edits = edits

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        model = apply_plan(model, optimizer, self._edits, OBSERVERS)
        return model if optimizer is None else (model, optimizer)

    def edit(self, plan):
        """``plan`` as this transform leaves it (no model needed: config.py checks a
        configuration so)."""
        for edit in self._edits:
            plan = edit(plan)
        return plan

    def __repr__(self) -> str:
        return f"zerofn.{self.name}"


def _stage_transform(name: str, stage: int, allowed: tuple[str, ...], options: dict) -> Transform:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"zerofn.{name}() got unknown option(s) {unknown}{_meant(unknown, allowed)}; "
                        f"it accepts {sorted(allowed)}.")
    check_values(name, options)
    return Transform(f"{name}()", (lambda plan: plan.with_transform(name, stage, options),))


def _meant(unknown, allowed) -> str:
    """``" (did you mean 'params'?)"`` for the first unknown name close to an allowed one."""
    for name in unknown:
        close = difflib.get_close_matches(name, allowed, n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


def keywords_named(fn):
    """``fn``, whose unknown keyword arguments raise a TypeError that names what it accepts
    and the closest (Python's own names only the stranger)."""
    accepted = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TypeError(f"zerofn.{fn.__name__}() got unknown option(s) {unknown}"
                            f"{_meant(unknown, accepted)}; it accepts {accepted}.")
        return fn(*args, **kwargs)
    return checked


def _whole(low: int, high: int | None = None):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v
            and (high is None or v <= high),
            f"a whole number from {low}" + (f" to {high}" if high is not None else " up"))


def _positive(none: bool = False, high: float = math.inf):
    return (lambda v: (none and v is None) or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
        and v <= high), "a finite number above 0" + (f", at most {high:g}" if high < math.inf
                                                      else "") + (" (or None)" if none else ""))


_BOOL = (lambda v: isinstance(v, bool), "True or False")
# What each option of the transforms takes, by the name it is given as: checked when the
# transform is made, so a wrong value is named there, not met deep in the runtime.
TAKES = {
    "bucket_size": _whole(1), "sync_module_states": _BOOL, "timeout": _positive(none=True, high=1e9),   # (seconds: 31 years; torch's limit is in ms)
    "stall_warning": _positive(none=True, high=1e9),
    "on_nonfinite": (lambda v: v is None or v in NONFINITE_RULES,
                     " or ".join(map(repr, NONFINITE_RULES)) + " (the default: 'skip')"),
    "units": (lambda v: v is None or isinstance(v, (list, tuple)) or _whole(1)[0](v),
              "None, a list of submodules or their names, or a whole number from 1 up"),
    "init": (lambda v: v is None or callable(v), "None or a function of a module"),
    "prefetch": _whole(0), "reshard_after_forward": _BOOL, "persist_below": _whole(0),
    "reduce_to_owner": _BOOL,
    "cast_forward_inputs": _BOOL, "loss_scale": _positive(none=True),
    "initial_scale_power": _whole(0, 64), "loss_scale_window": _whole(1),
    "hysteresis": _whole(1), "consecutive_hysteresis": _BOOL, "min_loss_scale": _positive(),
    "params": _BOOL, "units_in_flight": _whole(1), "seed": _whole(0), "overlap_step": _BOOL,
    "path": (lambda v: v is None or isinstance(v, (str, os.PathLike)), "None or a directory"),
}


def check_values(name: str, options: dict) -> None:
    """A ValueError naming the first of ``options`` (given to ``zerofn.name``) whose value
    is not what it takes (``TAKES``)."""
    for key, value in options.items():
        test, words = TAKES.get(key, (None, None))
        if test is not None and not test(value):
            raise ValueError(f"zerofn.{name}({key}={value!r}): {key} takes {words}.")


def shard_optimizer(**options) -> Transform:
    """ZeRO-1: each rank keeps and steps only its shard of the optimizer state.

    The options below are shared by all stages; give each at most once.

    Options:
        group: a ProcessGroup or 1-D DeviceMesh to shard over (default: the world), or a
            2-D DeviceMesh for hybrid sharding (HSDP): shard over its "shard" dim and
            average gradients over its "replicate" dim (dims named so, else dim 0
            replicates and dim 1 shards, as FSDP2 reads a mesh; see docs/multinode.md).
        groups: a dict of module names or fnmatch patterns to 1-D DeviceMeshes: the
            parameters of each module named shard over that mesh instead of ``group``,
            as FSDP2 takes a mesh per module. For the experts of a mixture of experts
            that expert parallelism split (each rank runs its own): ``{"blocks.*.moe.
            experts": mesh["edp"]}``, the expert-data-parallel ranks holding the same
            experts, from the same ``init_device_mesh`` as ``group``. Each module named
            becomes a unit (it must run: have a forward); its gradients are summed over
            its mesh and divided by the whole data-parallel size, as expert parallelism's
            all-to-all already brought it the other ranks' tokens (docs/parallelism.md).
        units: how parameters are grouped for collectives: None (one unit per child of a
            ModuleList not inside another such child, e.g. a transformer's blocks but not
            the experts inside one, plus one for the rest), a list of submodules or their names
            (modules that run: a ModuleList itself never does, so it is refused), or an
            int (a module becomes a unit once it holds that many parameters).
        bucket_size: elements of collective buffers allowed in flight at once (default
            4M). A collective larger than that still runs; on a device the two newest
            stay in flight whatever their size, on the host (gloo) older ones are waited
            for as soon as a new buffer would exceed the bound (runtime/comm.py).
        sync_module_states: broadcast rank 0's parameters and buffers at set-up (like DDP);
            for a model built on the meta device, check instead that every rank's random
            generators agree, so every rank initializes the same weights.
        init: how a model built under ``torch.device("meta")`` is initialized as the
            transforms materialize it (only this rank's rows are kept, one unit at a time):
            None calls each module's ``reset_parameters()``; a function ``init(module)`` is
            applied like ``model.apply(init)`` (children first, the same order and RNG
            stream), e.g. Hugging Face's ``model._init_weights``. Parameters or buffers no
            init writes are an error naming them. Unused for a model not on meta.
        timeout: seconds any collective may wait for the slowest rank (None: the process
            group's own, from ``init_process_group(timeout=...)``). Past it, or as soon as
            another rank raises or dies, every rank stops with ``zerofn.RankFailure``
            naming that rank and its phase (docs/multinode.md).
        stall_warning: seconds a rank may wait in one of zerofn's collectives before it
            logs which one (the unit's gather, the step's vote), in which phase, and that
            every rank must take part: under ZeRO-3 an evaluation or ``generate`` on one
            rank alone waits in the first gather for ranks that never come (default 60;
            None: never). The wait goes on until ``timeout``.
        on_nonfinite: what a step whose gradients hold inf or nan on any rank does:
            ``"skip"`` (the default) skips it on every rank, leaving masters, moments and
            the optimizer's step count as they were; ``"raise"`` raises
            ``zerofn.NonFiniteGradient`` on every rank, naming the step and a parameter,
            before anything is stepped; ``"ignore"`` checks nothing and costs nothing (the
            step takes the values, as plain PyTorch would). Under fp16 loss scaling the
            scaler's rule applies (skip, and lower the scale), and only "skip" is taken;
            under ``offload(overlap_step=True)`` the default is "raise" and "skip" is
            refused (the host steps units before the verdict). The check reads every
            gradient once and the vote back, a wait for the device each step
            (docs/transforms.md, "Non-finite gradients").

    Example:
        >>> model, opt = zerofn.shard_optimizer()(model, opt)

        Building on the meta device (nothing is allocated until the transforms run):

        >>> with torch.device("meta"):
        ...     model = MyTransformer(cfg)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> torch.manual_seed(0)       # the same on every rank
        >>> model, opt = zerofn.compose(zerofn.shard_params(init=my_init), ...)(model, opt)
    """
    return _stage_transform("shard_optimizer", 1, SHARED_OPTIONS, options)


def shard_grads(**options) -> Transform:
    """ZeRO-2: gradients are reduce-scattered during backward; each rank keeps its shard.

    Implies ``shard_optimizer()`` (a gradient shard is only useful to an optimizer shard).
    Takes the shared options of ``shard_optimizer``.
    """
    return _stage_transform("shard_grads", 2, SHARED_OPTIONS, options)


def shard_params(**options) -> Transform:
    """ZeRO-3: parameters are sharded too and gathered per unit only while it runs.

    Implies ``shard_grads()`` and ``shard_optimizer()``. Between steps the model's
    parameters are ``DTensor`` objects with ``Shard(0)``, as FSDP2's are.

    Takes the shared options of ``shard_optimizer``, and these.

    Options:
        prefetch: how many units ahead to gather while one computes (default 1).
        reshard_after_forward: free a unit's full parameters after its forward and gather
            them again in backward (default True; False trades memory for one all-gather).
        persist_below: parameters with fewer elements stay whole on every rank (like
            DeepSpeed's ``stage3_param_persistence_threshold``): no gather in forward or
            backward, their optimizer state still sharded (default 0: none).
        reduce_to_owner: a whole-tensor optimizer's parameters (Muon's matrices,
            Adafactor's: docs/optimizers.md) have their gradient reduced whole to the rank
            that steps them, in place of their share of the reduce-scatter, and only the
            updated rows come back: +1x their bytes per step over AdamW's traffic, where
            the default is +2x. Their ``p.grad`` then holds no values on any rank: reading
            or editing it raises, naming the owner; ``zf.clip_grad_norm_``, the
            non-finite guard and accumulation work as before. Not with
            ``offload("nvme")`` (default False).
    """
    return _stage_transform("shard_params", 3, SHARED_OPTIONS + PARAM_OPTIONS, options)


def mixed_precision(param_dtype: torch.dtype = torch.bfloat16, reduce_dtype=None,
                    cast_forward_inputs: bool = True, **options) -> Transform:
    """Compute in ``param_dtype`` with fp32 master parameters and optimizer state.

    Composes with every stage (it shards nothing itself). Compute parameters and their
    all-gather are in ``param_dtype``; gradients are reduced (and, for ZeRO-2/3, held) in
    ``reduce_dtype`` (default ``param_dtype``); the optimizer steps fp32 masters, and the
    updated parameters are cast back once per step. The masters and the optimizer's state
    are fp32 whatever dtype the model was built or loaded in (a bf16 checkpoint included),
    as DeepSpeed's bf16 mode keeps them; ``offload(master_dtype=..., state_dtype=...)``
    stores them in fewer bits on purpose. (Without ``mixed_precision`` a bf16 model keeps
    torch's semantics: bf16 masters and state.)

    ``cast_forward_inputs`` (default True, as FSDP2's ``MixedPrecisionPolicy``): the
    floating-point tensors among the model's forward arguments are cast to ``param_dtype``
    on the way in, so a loop feeding fp32 data runs unchanged; False leaves them be.

    ``mixed_precision(torch.bfloat16, reduce_dtype=torch.float32)`` trains bit for bit as
    FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)``. The default reduces in bf16 instead: half the gradient
    traffic and memory, but the sums are rounded to bf16: close to FSDP2, not bit for bit.

    fp16 needs loss scaling: ``zf.scale_loss(model, loss).backward()`` (the same call
    returns the loss itself for bf16 and fp32, so one loop serves all).

    Options:
        loss_scale: None for dynamic scaling under fp16 (none under bf16), or a static scale.
        initial_scale_power: the dynamic scale starts at ``2 ** initial_scale_power``
            (default 16).
        loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale: DeepSpeed's,
            with its names and defaults (1000, 2, False, 1.0).

    An overflow (inf/nan in any rank's gradients) skips the step on every rank. The scaler's
    state rides in ``optimizer.state_dict()``.
    """
    if param_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"mixed_precision(): param_dtype must be torch.bfloat16, torch.float16 "
                        f"or torch.float32, got {param_dtype!r}.")
    if reduce_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"mixed_precision(): reduce_dtype must be a floating dtype or None, "
                        f"got {reduce_dtype!r}.")
    return _stage_transform("mixed_precision", 0, PRECISION_OPTIONS,
                            dict(options, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                 cast_forward_inputs=cast_forward_inputs))


@keywords_named
def offload(device: str = "cpu", *, params: bool = False, path: str | None = None,
            units_in_flight: int = 2, state_dtype: torch.dtype = torch.float32,
            master_dtype: torch.dtype = torch.float32, seed: int = 0,
            ratio: float | str = 1.0, overlap_step: bool = False,
            device_budget: int | float | None = None, host_budget: int | None = None,
            placement: dict | None = None) -> Transform:
    """Keep master parameters and optimizer state off the accelerator, and step there.

    ``offload("cpu")`` (ZeRO-Offload) holds them in host memory, pinned when an accelerator
    exists; Adam and AdamW step in zerofn's C++ CPU Adam, other optimizers in torch on
    the host. Composes with every stage.

    ``offload("nvme", path=...)`` (ZeRO-Infinity) keeps master parameters and Adam state in
    a swap file per rank under ``path`` and streams them through host memory one unit at
    a time; host memory for them stays within ``units_in_flight`` units. Adam/AdamW only.
    With ``params=True`` each unit's compute shard lives in the file too and is read into
    the same staging buffers just before its all-gather, ahead of use.

    Args:
        device: "cpu" or "nvme".
        params: ZeRO-3 only: keep the parameter shards on the host (or, for "nvme", in
            the swap file) too, copied to the device just before each unit's all-gather.
        path: for "nvme", a directory on the drive (checked at set-up: exists, writable,
            room for the swap file). Swap files go when the process exits.
        units_in_flight: NVMe staging buffers (2: one unit steps while the next is read;
            with ``params=True`` also how many parameter shards are read ahead).
        state_dtype: how Adam's moments are stored (host or swap file): ``torch.float32``
            (default), ``torch.bfloat16`` (stochastic rounding) or ``torch.int8`` (8-bit
            blockwise dynamic codes, a scale per 256 elements). Adam/AdamW only.
        master_dtype: how the master rows are stored: ``torch.float32`` (default) or
            ``torch.bfloat16`` (stochastic rounding; needs a bf16 compute dtype, whose rows
            the masters then are). State dicts and checkpoints hold fp32 either way.
        seed: the stochastic rounding's random stream: a run and its resume round alike.
        See docs/offload.md ("Low-precision host state") for bytes and accuracy.
        ratio: the share of the optimizer state (masters and moments) offloaded, from 0 to
            1 (default: all). The units first in the model's parameter order keep theirs
            on the device, up to 1 - ratio of the parameters, and step there while the
            host steps the rest (docs/offload.md, "A share on the device").
            ``"auto"``: after the first step, as many units as fit ``device_budget`` move
            to the device, first in parameter order; then the placement stays.
        device_budget: ratio="auto": the device memory the run may use, in bytes, or as a
            share of the memory free at set-up (default 0.9; CUDA devices only).
        host_budget: ratio="auto" with ``offload("nvme", path=...)``: the host memory the
            offloaded state may take, in bytes; the units first in parameter order fill it,
            the rest live in the swap file (and the device takes the first of the host's
            after the first step).
        placement: each unit's home chosen by name: ``{"blocks.0": "device",
            "blocks.[30-39]": "nvme", "<root>": "host"}`` (unit names, fnmatch patterns, and
            ``[a-b]`` for a range of numbers; the first pattern a unit matches decides);
            the units no pattern names go where ``device`` says. "nvme" needs ``path``.
            ``zf.runtime_of(model)``'s units list the names (docs/offload.md, "Every unit
            its home").
        overlap_step: ZeRO-2/3 with offload("cpu"): the host steps each unit as soon as
            its gradients are reduced, during the rest of backward. The same step, on
            conditions (each checked): no clipping, no fp16 scaling, and one reducing
            backward per step (accumulate under ``model.no_sync()``). A backward then
            commits to its step (docs/offload.md, "The host step during backward").
    """
    if device not in ("cpu", "nvme"):
        raise ValueError(f"offload({device!r}): the device is 'cpu' or 'nvme'.")
    check_values("offload", dict(params=params, path=path, units_in_flight=units_in_flight,
                                 seed=seed, overlap_step=overlap_step))
    if path is not None:       # (swap files are read and written by the OS, not fsspec)
        local_only(path, 'offload("nvme", path=...)')
    if state_dtype not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"offload(state_dtype={state_dtype!r}): Adam's moments are stored as "
                         "torch.float32, torch.bfloat16 or torch.int8.")
    if ratio != "auto" and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                            or not 0 <= ratio <= 1):
        raise ValueError(f"offload(ratio={ratio!r}): the share of the optimizer state to "
                         "offload is a number from 0 (none) to 1 (all, the default), or "
                         "'auto'.")
    if device_budget is not None and (ratio != "auto" or isinstance(device_budget, bool) or
                                      not isinstance(device_budget, (int, float)) or
                                      device_budget <= 0 or
                                      (isinstance(device_budget, float) and device_budget > 1)):
        raise ValueError(f"offload(device_budget={device_budget!r}): give ratio='auto' a "
                         "number of bytes (an int), or a share of the free memory in (0, 1].")
    if master_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"offload(master_dtype={master_dtype!r}): master rows are stored as "
                         "torch.float32 or torch.bfloat16.")
    if placement is not None and not isinstance(placement, dict):
        raise ValueError(f"offload(placement={placement!r}): placement takes a dict of unit "
                         "names or patterns to 'device', 'host' or 'nvme'.")
    if host_budget is not None and (ratio != "auto" or device != "nvme" or isinstance(
            host_budget, bool) or not isinstance(host_budget, int) or host_budget < 0):
        raise ValueError(f"offload(host_budget={host_budget!r}): give offload('nvme', "
                         "ratio='auto') the host bytes its state may take (an int >= 0).")
    return _stage_transform("offload", 0, OFFLOAD_OPTIONS,
                            dict(offload=device, offload_params=params, offload_path=path,
                                 units_in_flight=units_in_flight, state_dtype=state_dtype,
                                 master_dtype=master_dtype, offload_seed=seed,
                                 offload_ratio=ratio if ratio == "auto" else float(ratio),
                                 overlap_step=overlap_step, device_budget=device_budget,
                                 host_budget=host_budget,
                                 offload_placement=dict(placement) if placement else None))


@keywords_named
def tensorboard(logdir, *, every: int = 10, ranks="0", profile: dict | None = None,
                memory_snapshot: int = 0, csv=False) -> Transform:
    """Write what every step spends (time, communication, memory) and the values given to
    ``zf.log`` as TensorBoard event files; optionally torch.profiler traces.

    Composes with every other transform (it shards nothing itself). Every ``every``-th
    optimizer step is a logging step: the series of the interval are written then, with
    one device synchronization and one small collective; other steps never wait for the
    device. ``docs/profiling.md`` lists every series, its unit and how to read traces.

    Args:
        logdir: the directory for event files (``traces/`` and ``memory/`` go inside).
        every: optimizer steps per logging interval.
        ranks: which ranks write: ``"0"`` (default), ``"all"``, a rank, or several
            (``"0,3"`` or a list). Where more than one writes, each gets ``rank<r>/``.
            Every rank measures either way.
        profile: a ``torch.profiler.schedule``: ``dict(wait=, warmup=, active=, repeat=1,
            skip_first=0)`` in optimizer steps; the writing ranks trace those steps into
            ``logdir/traces/rank<r>.*.pt.trace.json.gz`` (Perfetto, Holistic Trace
            Analysis).
        memory_snapshot: on CUDA, record the caching allocator's last ``memory_snapshot``
            events (with Python stacks) from set-up and dump them at the first logging step
            to ``logdir/memory/rank<r>.pickle`` (pytorch.org/memory_viz). 0: off.
        csv: also write every series as CSV, one file per series in DeepSpeed's
            csv_monitor layout: True (next to the event files) or a directory.

    Example:
        >>> model, opt = zf.compose(zf.shard_params(), zf.tensorboard("runs/zero3"))(model, opt)
        >>> loss = model(x, y); loss.backward(); opt.step()
        >>> zf.log(model, loss=loss.detach(), tokens=x.numel())
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"tensorboard(every={every!r}): a positive number of steps.")
    if not isinstance(memory_snapshot, int) or memory_snapshot < 0:
        raise ValueError(f"tensorboard(memory_snapshot={memory_snapshot!r}): the number of "
                         f"allocator events to keep (0: off).")
    root = local_only(logdir, "zf.tensorboard(logdir)")
    return _stage_transform("tensorboard", 0, MONITOR_OPTIONS, dict(
        tensorboard=root, tensorboard_every=every, tensorboard_ranks=_ranks(ranks),
        tensorboard_csv=root if csv is True else (local_only(csv, "zf.tensorboard(csv=...)")
                                                  if csv else None),
        profile=_profile(profile), memory_snapshot=memory_snapshot))


def _ranks(ranks):
    """``"all"``, or the writing ranks as a sorted tuple."""
    if ranks == "all":
        return "all"
    try:
        parts = ranks.split(",") if isinstance(ranks, str) else \
            [ranks] if isinstance(ranks, int) else list(ranks)
        out = tuple(sorted({int(r) for r in parts}))
    except (TypeError, ValueError):
        out = ()
    if not out or min(out) < 0:
        raise ValueError(f"tensorboard(ranks={ranks!r}): \"all\", a rank, or ranks as \"0,3\" "
                         f"or a list of ints.")
    return out


def _profile(profile: dict | None) -> dict | None:
    """The torch.profiler schedule, checked; ``repeat`` defaults to one window (torch's own
    default, 0, would trace every window until the end)."""
    if profile is None:
        return None
    if not isinstance(profile, dict) or set(profile) - set(PROFILE_KEYS) or \
            not all(isinstance(v, int) and v >= 0 for v in profile.values()) or \
            profile.get("active", 0) < 1:
        raise ValueError(f"tensorboard(profile={profile!r}): a dict of non-negative step "
                         f"counts with keys from {PROFILE_KEYS}, active at least 1, e.g. "
                         f"dict(wait=1, warmup=1, active=2).")
    return {"wait": 0, "warmup": 0, "repeat": 1, **profile}


def compose(*transforms: Transform) -> Transform:
    """One transform applying all of ``transforms``; order does not matter.

    Example:
        >>> zero3 = zerofn.compose(zerofn.shard_optimizer(), zerofn.shard_grads(),
        ...                        zerofn.shard_params())
        >>> model, opt = zero3(model, opt)
    """
    if not transforms:
        raise TypeError("zerofn.compose() needs at least one transform, e.g. "
                        "zerofn.compose(zerofn.shard_optimizer(), zerofn.shard_grads()).")
    for t in transforms:
        if not isinstance(t, Transform):
            raise TypeError(f"zerofn.compose() takes transforms such as zerofn.shard_params(), "
                            f"got {t!r}.")
    edits = tuple(e for t in transforms for e in t._edits)
    return Transform("compose(" + ", ".join(t.name for t in transforms) + ")", edits)
