"""The runtime a plan becomes: units, buffers, hooks and the rewired optimizer, in one place.

It lives on the model (``model._zerofn``); the transforms themselves stay stateless.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core.plan import Plan
from .attach import attach, detach, is_transformed, runtime_of
from .clip import clip_grads
from .comm import Comm, device_problems
from .copies import CopyStreams
from .describe import announce
from .events import Observers, kinds
from .forward import ForwardHooks
from .grads import GradReducer
from .host_malloc import return_large_frees
from .layout import FlatBuffers, Layout
from .materialize import meta_state, rng_digest, target_device
from .memory import model_state_bytes
from .mesh import layout_of
from .early_step import EarlySteps, overlap_problems
from .offload import auto_problems, make_offload, offload_problems
from .placement import AutoPlacement
from .optimizer import OptimizerWiring, check_optimizer
from .params import ParamGatherer
from .pool import BufferPool
from .precision import LossScaler
from .refresh import Refresh
from .step import StepGrads
from .stepping import Stepping
from .timing import UNTIMED
from .visible import VisibleGrads
from ..core.units import build_units, set_dtypes

def apply_plan(model: nn.Module, optimizer, edits):
    if not isinstance(model, nn.Module):
        raise TypeError(f"zerofn transforms take (model, optimizer); got {type(model).__name__} "
                        "as the model.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"zerofn transforms take (model, optimizer); got "
                        f"{type(optimizer).__name__} as the optimizer.")
    old = runtime_of(model) if is_transformed(model) else None
    plan = old.plan if old is not None else Plan()
    for edit in edits:
        plan = edit(plan)
    if plan.stage == 0:
        raise ValueError(f"{plan.applied[-1]}() shards nothing by itself: compose it with a "
                         "sharding transform, e.g. zerofn.compose(zerofn.shard_optimizer(), "
                         f"zerofn.{plan.applied[-1]}(...)).")
    if plan.offload.params and plan.stage < 3:
        raise ValueError("offload(params=True) offloads parameter shards, which only ZeRO-3 "
                         "has: add zerofn.shard_params(), or drop params=True.")
    if old is not None:
        if old.optimizer is not optimizer:
            raise ValueError("This model was transformed with another optimizer; pass the "
                             "optimizer the earlier transform returned.")
        old.restore()
    Runtime(model, optimizer, plan)
    return model, optimizer


class Runtime(Layout, ForwardHooks, Stepping, Refresh):
    """What a plan becomes on one model and optimizer: units, buffers, hooks and the
    rewired optimizer. Built by ``apply_plan`` (the transforms), found by ``runtime_of``,
    undone by ``restore`` (when another transform is applied on top); it lives on the
    model in between.

    What the rest of zerofn may use (everything else is its own):
        attributes: ``model``, ``optimizer``, ``plan``, ``device``, ``group`` (every rank
        of the layout), ``world`` and ``rank`` (of the shard group), ``replica_world``,
        ``backend``, ``mesh`` and ``placements`` (what sharded state is a DTensor over),
        ``units``, ``slot_of`` (parameter to its ParamSlot), ``observers``;
        the step: ``step_skipped()``, ``loss_scale()`` and ``scaler`` (fp16's LossScaler,
        or None), ``comm_stats()``, ``model_state_bytes()``, ``units_on_device()``,
        ``placement_reason()``, ``param_order()``, ``time_series()``,
        ``clip_grad_norm(...)``, ``set_step(step)``, ``in_phase(name, fn, *args)``,
        ``observer(cls)``, ``no_sync()``;
        state: ``slots_by_name()``, ``full_tensor(...)``, ``gather_unit(...)``,
        ``prepare_state_dict()``, ``refresh_params()``, ``init_optimizer_state()``.
    """

    def __init__(self, model: nn.Module, optimizer, plan: Plan):
        self.model, self.optimizer, self.plan = model, optimizer, plan
        sharding = plan.sharding
        layout, self.device = _resolve_group(sharding.group, model)
        self.comm = Comm(layout.shard, sharding.bucket_size, self.device)
        # Raised here, before any collective: on a device the group does not serve, the
        # first one would fail or hang.
        current = torch.cuda.current_device() if self.device.type == "cuda" else None
        problems = device_problems(self.device, self.comm.backend, current)
        if problems:
            raise ValueError("zerofn set-up: " + " ".join(problems))
        if self.device.type == "cpu":
            return_large_frees()     # [Note: mmap threshold] in host_malloc.py
        self.mesh, self.placements, self.group = layout.mesh, layout.placements, layout.everyone
        self.groups = (layout.shard, layout.replicate)    # the groups collectives run on
        # HSDP: the replicate dimension, over which the reduced shards are averaged.
        self.replicas = None if layout.replicate is None \
            else Comm(layout.replicate, sharding.bucket_size, self.device)
        self.replica_world = 1 if self.replicas is None else self.replicas.world
        self.rank, self.world = self.comm.rank, self.comm.world
        self.backend = self.comm.backend
        self.meta = meta_state(model) is True      # built on the meta device: materialize
        units, problems = self._build_units()
        self._agree_across_ranks(problems)
        # [Note: observers] in events.py
        self.observers = Observers([o for kind in kinds() if (o := kind.attach(self))])
        self.timing = self.observers.timing or UNTIMED
        if sharding.sync_module_states and not self.meta:
            self._broadcast_module_states()
        self._build(units)
        attach(model, self)
        announce(self, dist.get_rank())

    def _build(self, units) -> None:
        """The parts, each given the timing and guard the observers offer."""
        timing, guard, plan = self.timing, self.observers.guard, self.plan
        self.units = units
        self.root = units[-1]
        self.pool = BufferPool()
        self.stage = plan.stage
        # A unit without parameters (the root, when every parameter persists or lives in
        # a block) has no rows to shard: it keeps its hooks, but gets no compute shard.
        self._sharded_params = [u for u in units
                                if self.stage == 3 and not u.replicated and u.slots]
        self.offload = self._make_offload(units)
        self.copies = CopyStreams(self.device, units, self.offload is not None, timing)
        self._refreshed = False     # the step refreshed each unit's compute params
        self.gatherer = self._make_gatherer()
        self.flats: list[FlatBuffers] = []    # the device's flat masters and shards
        self._lay_out_shards()
        self.slot_of = {s.param: s for u in units for s in u.slots}
        offloaded = self.offload is not None
        self.reducer = GradReducer(
            self.comm, self.pool, units, self.stage,
            VisibleGrads(units, self.mesh, self.placements, self.pool),
            self._on_packed if self.stage == 3 else None, plan.precision.reduce_dtype,
            self.replicas,
            on_shard_ready=(lambda unit, shard: self.step_grads.shard_ready(unit, shard))
            if offloaded else None,
            before_shard_write=self.copies.before_device_write if offloaded else None,
            forward_order=(lambda g=self.gatherer: g.order) if self.gatherer else None,
            timing=timing, guard=guard)
        self.scaler = _loss_scaler(plan)
        # [Note: the host step during backward] (early_step.py)
        self.early = EarlySteps(self.offload, self.optimizer, self.copies, self.reducer) \
            if plan.offload.overlap_step else None
        if self.early is not None:
            self.offload.attach_early(self.early)
        self.step_grads = StepGrads(self.comm, self.pool, units, self.reducer, self.scaler,
                                    self.device, self.copies, self.offload, self.replicas,
                                    timing, self.early)
        # [Note: placing by the first step] (placement.py)
        self.placement = AutoPlacement(self, plan.offload.device_budget) \
            if offloaded and plan.offload.ratio == "auto" else None
        self.opt = OptimizerWiring(self.optimizer, self.slot_of, self.before_step,
                                   self.after_step, self.zero_grad, self.scaler,
                                   guard, self.observers.step_begin)
        if offloaded:
            self.offload.register_state(self.optimizer)
        self._hooks = self._register_forward_hooks() + self._register_model_hooks()

    # -- set-up ----------------------------------------------------------------------
    def _build_units(self):
        if meta_state(self.model) is None:
            return [], ["some of the model's parameters are on the meta device and some are "
                        "not; build the whole model under torch.device('meta') (the transforms "
                        "then materialize it), or none of it."]
        problems = []
        try:
            persist = self.plan.sharding.persist_below if self.plan.stage == 3 else 0
            units = build_units(self.model, self.plan.sharding.units, self.world, self.rank,
                                persist, self.device)
        except ValueError as e:
            return [], [str(e)]
        compute = self.plan.precision.param_dtype
        set_dtypes(units, compute, mixed=compute is not None)
        slot_of = {s.param: s for u in units for s in u.slots}
        problems += check_optimizer(self.optimizer, slot_of)
        for kind in kinds():    # [Note: observers]
            problems += kind.preflight(self.plan, self.device, dist.get_rank(self.group),
                                       dist.get_world_size(self.group))
        problems += overlap_problems(self.plan, self.optimizer)
        problems += auto_problems(self.plan.offload, self.device, self.replicas is not None)
        problems += offload_problems(self.plan.offload, self.optimizer, units,
                                     self._offloaded_param_dtypes(units),
                                     self.plan.precision.param_dtype, self.param_order())
        return units, problems

    def _signature(self) -> list[str]:
        lines = self.plan.describe() + [type(self.optimizer).__name__]
        lines += [f"{n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}"
                  for n, p in self.model.named_parameters()]
        lines += [f"group {i}: {len(g['params'])} params"
                  for i, g in enumerate(self.optimizer.param_groups)]
        return lines

    def _agree_across_ranks(self, problems: list[str]) -> None:
        """One small collective: every rank raises the same error, or none does."""
        sig = self._signature()
        digest = hashlib.sha256("\n".join(sig).encode()).hexdigest()
        # A meta-built model is initialized on every rank, not broadcast: the ranks' random
        # generators must agree, or each would keep rows of a different model.
        rng = rng_digest(self.device) if self.meta and self.plan.sharding.sync_module_states \
            else None
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (digest, problems, sig, rng), group=self.group)
        for rank, (_, probs, _, _) in enumerate(gathered):
            if probs:
                raise ValueError(f"zerofn set-up failed on rank {rank}: " + " ".join(probs))
        if len({g[3] for g in gathered}) > 1:
            raise ValueError(
                "The ranks' random generators differ, so initializing the meta-built model "
                "would give each rank rows of a different model: call torch.manual_seed(seed) "
                "with the same seed on every rank before applying the transforms (or pass "
                "sync_module_states=False if the init draws no random numbers).")
        for rank, (other, _, other_sig, _) in enumerate(gathered):
            if other != gathered[0][0]:
                diff = next((f"rank 0 has {a!r}, rank {rank} has {b!r}"
                             for a, b in zip(gathered[0][2], other_sig) if a != b),
                            f"rank 0 has {len(gathered[0][2])} entries, rank {rank} {len(other_sig)}")
                raise ValueError("Ranks disagree on the model, optimizer or plan: " + diff +
                                 ". Build the same model and transforms on every rank.")

    def _broadcast_module_states(self) -> None:
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                local = t.data if not isinstance(t, DTensor) else t.to_local()
                self.comm.broadcast(local)
                if self.replicas is not None:   # then replica 0's, which has shard rank 0's
                    self.replicas.broadcast(local)

    def _make_gatherer(self) -> ParamGatherer | None:
        if self.stage != 3:
            return None
        return ParamGatherer(self.comm, self.pool, self.units, self.plan.sharding.prefetch,
                             self.plan.sharding.reshard_after_forward, self.copies,
                             staged=self.plan.offload.params,
                             reader=self.offload.param_reader if self.offload else None,
                             timing=self.timing, guard=self.observers.guard)

    def _make_offload(self, units):
        return make_offload(self.plan.offload, units, self.optimizer, self._host_grad_dtype,
                            self._offloaded_param_dtypes(units), dist.get_rank(), self.timing,
                            self.param_order(), self.device)

    def param_order(self) -> dict:
        """Each of the model's parameters' place in ``model.parameters()`` (which units
        offload's ratio keeps on the device: offload/split.py)."""
        return {p: i for i, p in enumerate(self.model.parameters())}

    def zero_grad(self) -> None:
        self.step_grads.release()
        self.reducer.zero_grad()

    # -- the public surface (see the class docstring) ---------------------------------
    def step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow on any rank)."""
        return self.step_grads.overflow

    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def comm_stats(self) -> Counter:
        """``zf.comm_stats``: the shard dimension's counts of the last step, HSDP's
        replicate dimension's as ``replicate.<kind>``."""
        out = Counter(self.comm.last_step)
        if self.replicas is not None:
            out.update({f"replicate.{k}": v for k, v in self.replicas.last_step.items()})
        return out

    def model_state_bytes(self) -> dict[str, dict[str, int]]:
        """``zf.model_state_bytes``, measured (runtime/memory.py)."""
        return model_state_bytes(self)

    def units_on_device(self) -> list:
        """Under offload's ``ratio``: the units that keep their optimizer state on the
        device (none where everything is offloaded, or nothing is)."""
        return self.offload.staying() if self.offload is not None else []

    def placement_reason(self) -> str | None:
        """Under offload's ``ratio="auto"``, once the first step not skipped placed the units:
        what it measured and what moved (placement.py). None before then, and otherwise."""
        placed = self.placement is not None and self.placement.placed
        return self.placement.reason if placed else None

    def time_series(self) -> tuple[str, ...]:
        """The timing series the offload's work fills, beyond every run's."""
        return self.offload.time_series if self.offload is not None else ()

    def slots_by_name(self) -> dict:
        """Every state-dict name of every parameter: a module under two parents (or two
        names) lends its parameters each of its names."""
        names: dict[nn.Module, list[str]] = {}
        for n, m in self.model.named_modules(remove_duplicate=False):
            names.setdefault(m, []).append(n)
        out = {}
        for slot in self.slot_of.values():
            for module, pname in slot.owners:
                for prefix in names[module]:
                    out[f"{prefix}.{pname}" if prefix else pname] = slot
        return out

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> torch.Tensor:
        """``zf.clip_grad_norm_`` (runtime/clip.py); the observers hear of the norm."""
        return clip_grads(self, max_norm, norm_type, error_if_nonfinite)

    def set_step(self, step: int) -> None:
        """The next optimizer step is number ``step`` (a resumed run's own count)."""
        self.observers.set_step(step)

    def in_phase(self, name: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` as a phase of the job's own between steps (a checkpoint
        save): the observers record it, and its errors pass through their guards."""
        self.observers.phase(name)
        return self.observers.guard(fn)(*args, **kwargs)

    def observer(self, cls):
        """This runtime's observer of class ``cls``, or None."""
        return self.observers.find(cls)

    @contextlib.contextmanager
    def no_sync(self):
        """``model.no_sync()``: backward reduces nothing inside."""
        before, self.reducer.no_sync = self.reducer.no_sync, True
        try:
            yield
        finally:
            self.reducer.no_sync = before

    def init_optimizer_state(self) -> None:
        """Create the optimizer's state (a zero step) where it has none yet, so a load
        has tensors to load into."""
        self.opt.init_state()

    # -- teardown ----------------------------------------------------------------------
    def restore(self) -> None:
        """Undo this runtime: full parameters and full optimizer state, no hooks.

        Used when another transform is applied on top, so the combined plan is built afresh.
        """
        self.observers.close()
        self.prepare_state_dict()
        self.step_grads.prepare()
        self.step_grads.release()
        for h in self._hooks:
            h.remove()
        self.reducer.remove_hooks()
        for unit in self.units:
            for s in unit.slots:
                s.param.data = self.full_tensor(s, s.opt_param.detach(), unit.device)
                for module, name in s.owners:
                    module._parameters[name] = s.param
        slot_of_opt = {s.opt_param: s for s in self.slot_of.values()}
        # Optimizer state goes where torch.optim keeps it: with the parameter.
        self.opt.restore(lambda shard, v: self.full_tensor(slot_of_opt[shard], v, self.device)
                         if torch.is_tensor(v) and v.shape == shard.shape and v.dim() > 0 else v)
        detach(self.model)
        self.pool.clear()


def _loss_scaler(plan: Plan) -> LossScaler | None:
    """DeepSpeed's rule: dynamic scaling for fp16 unless a static scale is given."""
    p = plan.precision
    if p.loss_scale is not None:
        return LossScaler(dynamic=False, scale=p.loss_scale)
    if p.param_dtype != torch.float16:
        return None
    return LossScaler(dynamic=True, scale=2.0 ** p.initial_scale_power,
                      window=p.loss_scale_window, min_scale=p.min_loss_scale,
                      hysteresis=p.hysteresis, consecutive_hysteresis=p.consecutive_hysteresis)


def _resolve_group(group, model: nn.Module):
    """``(layout, device)``: the groups ``group=`` asks for (runtime/mesh.py), and the
    device the model computes on: its parameters', or for a meta-built model the mesh's,
    else the current CUDA device, else the CPU."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "zerofn needs torch.distributed: call torch.distributed.init_process_group() "
            "first (torchrun sets up the environment it reads; use backend 'gloo' on CPU, "
            "'nccl' on GPUs). A single process works too, with world_size=1.")
    mesh = group if isinstance(group, DeviceMesh) else None
    real = next((p.device for p in model.parameters() if not p.is_meta), None)
    device = real or target_device(mesh.device_type if mesh is not None else None)
    return layout_of(group, device.type), device
