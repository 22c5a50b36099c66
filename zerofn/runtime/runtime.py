"""The runtime a plan becomes: the composition root of the parts that make it, and the
public surface the rest of zerofn uses (``RuntimeView``, view.py).

It lives on the model (``model._zerofn``); the transforms themselves stay stateless.

One step through the parts: forward's hooks (forward.py) gather each ZeRO-3 unit
(params.py); backward's tracker (backward.py) tells the reducer (grads.py) when each unit
is complete, whose reduced shard goes to its landing (step_grads.py) and, at the end, onto
``p.grad`` (visible.py); ``optimizer.step()`` runs the stepper (stepper.py): the step's
gradients and one vote (step_grads.py), then each unit's home (homes/) steps its rows and the
shards (shards.py) bring the compute rows up to date.
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
from ..core.units import build_units, set_dtypes
from . import finder
from .agree import agree_or_raise, gather
from .attach import attach, detach, is_transformed, runtime_of, unwrap
from .comm import Comm, device_problems
from .context import RuntimeContext
from .copies import CopyStreams
from .describe import announce
from .overlap import overlap_problems
from .events import Observers
from .forward import ForwardHooks
from .grads import GradReducer
from .materialize import meta_state, rng_digest, target_device
from .memory import model_state_bytes
from .mesh import groups_of, model_parallel, own_groups, with_timeout
from .homes import (HomeSpec, auto_problems, cpu_adam_steps, make_homes, offload_problems,
                      optimizer_problems)
from .chain import OptimizerChain, members_of
from .optimizer import check_optimizer, signature
from .owned import overlap_whole, reduce_to_owner_problems
from .param_table import ParamTable
from .params import ParamGatherer
from .pool import BufferPool
from .shards import Shards
from .landing import Landing
from .stepper import Stepper, early_steps
from .subclass import rewrap_hooked, subclass_problems, unwrap_hooked
from .visible import VisibleGrads


def apply_plan(model: nn.Module, optimizer, edits, observer_kinds=()):
    """The transforms' work: ``edits`` applied to the model's plan (a new one, or the one
    an earlier transform left), and a runtime built from it, asking ``observer_kinds``
    ([Note: observers] in events.py) whether to watch it. ``optimizer``: the one to bind
    now, or None ([Note: finding the optimizer] in optimizer.py). Returns the model the
    user holds (a compiled one stays compiled; its inner module is transformed)."""
    held, model = model, unwrap(model)
    refuse_wrapped(held, model)
    old = runtime_of(model) if is_transformed(model) else None
    optimizer = chained(optimizer, old.optimizer if old is not None else None)
    plan = old.plan if old is not None else Plan()
    for edit in edits:
        plan = edit(plan)
    problems = plan.problems()     # (the plan's own rules: every rank finds the same)
    if problems:
        raise ValueError(" ".join(problems))
    if old is not None:
        bound = old.optimizer
        if optimizer is not None and bound is not None and bound is not optimizer:
            raise ValueError("This model was transformed with another optimizer; pass the "
                             "optimizer the earlier transform returned.")
        optimizer = optimizer or bound
        old.restore()
    Runtime(model, optimizer, plan, observer_kinds)
    return held


def chained(optimizer, bound):
    """The optimizer to bind: the one given, or a sequence of them as one chain (chain.py;
    the one already bound where it chains the same optimizers)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    members = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else None
    if not members or not all(isinstance(m, torch.optim.Optimizer) for m in members):
        raise TypeError(f"zerofn transforms take (model), (model, optimizer) or (model, "
                        f"(optimizer, ...)); got {type(optimizer).__name__} as the optimizer.")
    if len(members) == 1:
        return members[0]
    if isinstance(bound, OptimizerChain) and bound.members == members:
        return bound
    return OptimizerChain(members)


def refuse_wrapped(held: nn.Module, model: nn.Module) -> None:
    """A model another data-parallel wrapper already holds cannot be sharded again: refused
    before any collective, naming the wrapper."""
    if not isinstance(held, nn.Module):
        raise TypeError(f"zerofn transforms take (model) or (model, optimizer); got "
                        f"{type(held).__name__} as the model.")
    wrapper = next((type(m).__name__ for m in (held, model)
                    if isinstance(m, (nn.parallel.DistributedDataParallel,
                                      nn.parallel.DataParallel))), None)
    if wrapper is not None:
        raise ValueError(f"zerofn: this model is wrapped in {wrapper}, which reduces "
                         "gradients itself; zerofn does that (and shards): give the "
                         f"transform the module inside ({wrapper}.module), not the wrapper.")
    fsdp = next((type(m).__name__ for m in model.modules() if _sharded_by_fsdp(m)), None)
    if fsdp is not None:
        raise ValueError(f"zerofn: this model holds {fsdp}, which FSDP already shards; "
                         "apply zerofn's transforms to a model FSDP has not wrapped (one or "
                         "the other, not both).")


def _sharded_by_fsdp(module: nn.Module) -> bool:
    """FSDP2's ``fully_shard`` (its class mixes in ``FSDPModule``) or FSDP1's wrapper."""
    names = {c.__name__ for c in type(module).__mro__}
    return bool(names & {"FSDPModule", "FullyShardedDataParallel"})


class Runtime:
    """What a plan becomes on one model and optimizer. Built by ``apply_plan`` (the
    transforms), found by ``runtime_of``, undone by ``restore`` (when another transform is
    applied on top); it lives on the model in between. What the rest of zerofn may use is
    ``RuntimeView`` (view.py); everything else is its own."""

    def __init__(self, model: nn.Module, optimizer, plan: Plan, observer_kinds=()):
        # What it sits on, and over which ranks (before any collective: a bad device or
        # timeout is raised on every rank alike). The optimizer is bound at the end, or
        # when found ([Note: finding the optimizer] in optimizer.py).
        self.model, self.plan, self.optimizer = model, plan, None
        self._group_names = (None, [])     # group_names' (optimizer, names), made once
        groups, self.device = _resolve_group(plan.sharding.group, model)
        # groups=: modules with a data-parallel group of their own (core/units.py's [Note:
        # a module's own group]), each pattern's collectives counted apart.
        self._own = own_groups(plan.sharding.groups, model, groups, plan.sharding.init)
        groups = with_timeout(groups, plan.sharding.timeout, self._own)
        comm = Comm(groups.shard, plan.sharding.bucket_size, self.device)
        own_comms = {g.pattern: (Comm(g.shard, plan.sharding.bucket_size, self.device),
                                 g.dp_world) for g in self._own.values()}
        _check_device(self.device, comm)
        # HSDP: the replicate dimension, over which the reduced shards are averaged.
        replicas = None if groups.replicate is None \
            else Comm(groups.replicate, plan.sharding.bucket_size, self.device)
        self.group = groups.everyone         # every rank of the layout
        self.mesh, self.placements = groups.mesh, groups.placements
        self.rank, self.world, self.backend = comm.rank, comm.world, comm.backend
        self.replica_world = 1 if replicas is None else replicas.world
        # The units, agreed on by every rank, then the observers the caller asked for.
        units, problems = self._build_units(observer_kinds, optimizer)
        # Tensor parallelism's DTensors join the layout (every rank of both meshes agrees).
        problems += model_parallel(groups, [s.spec for u in units for s in u.slots if s.spec])
        self.group = groups.everyone
        self._agree_across_ranks(problems, optimizer)
        unwrap_hooked(units)     # ([Note: gathered by a subclass's hooks], subclass.py)
        self.units = units
        self.table = ParamTable()    # what set-up makes for each slot and unit (param_table.py)
        self.observers = Observers([o for kind in observer_kinds if (o := kind.attach(self))])
        order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        # Every unit's home (homes/): where its masters and optimizer state live.
        self.homes = self._make_homes(units, order, optimizer)
        crosses = any(self.homes.home_of(u) != "device" for u in units if u.slots)
        ctx = RuntimeContext(self.device, plan, groups, comm, replicas, BufferPool(),
                             CopyStreams(self.device, units, crosses, self.observers.timing),
                             self.observers, tuple(units), order, own_comms, table=self.table)
        self.ctx = ctx
        if plan.sharding.sync_module_states and not meta_state(model):
            self._broadcast_module_states()
        # The parts, each given the context: shards hold the rows, the reducer the
        # gradients, the stepper the step, the hooks what forward does.
        self.gatherer = ParamGatherer(ctx, self.homes.param_reader) if plan.stage == 3 else None
        self.shards = Shards(ctx, model, self.homes, self.gatherer)
        self.shards.lay_out(optimizer)
        self.slot_of = {s.param: s for u in units for s in u.slots}   # (after meta's new params)
        # What an optimizer may hold for each parameter: the whole one, or ZeRO-3's DTensor.
        table = self.table
        self.param_index = {**self.slot_of, **{table[s].sharded: s for s in self.slot_of.values()
                                                if table[s].sharded is not None},
                            **{a: s for s in self.slot_of.values() for a in s.aliases}}
        visible = VisibleGrads(units, self.mesh, self.placements, ctx.pool, ctx.table)
        landing = Landing(ctx, self.homes, visible, early_steps(ctx, self.homes, optimizer))
        self.reducer = GradReducer(ctx, visible, landing, self.gatherer)
        self.stepper = Stepper(ctx, self.homes, self.shards, self.reducer, self.gatherer)
        self.forward = ForwardHooks(ctx, model, self.gatherer, self.reducer, self.stepper)
        attach(model, self)
        if optimizer is not None:     # (its problems were agreed on with the plan's)
            self._bind(optimizer)
        finder.watch(self)
        announce(self, dist.get_rank())

    # -- the optimizer ---------------------------------------------------------------
    def bind(self, optimizer, takeover: bool = False) -> None:
        """Step with ``optimizer`` from now on ([Note: finding the optimizer] in
        optimizer.py): its problems, agreed on every rank, are raised on every rank before
        anything changes. Collective: every rank calls it, at the optimizer's first step or
        a state-dict access. Where another optimizer is bound, ``takeover`` (a new
        optimizer's first step) lets this one take the parameters over, with fresh state,
        and retires the other; else it is refused."""
        if optimizer is self.optimizer:
            return
        name = type(optimizer).__name__
        problems = self._optimizer_problems(optimizer, takeover)
        gathered = gather((problems, signature(optimizer)), self.group)
        for rank, (probs, _) in enumerate(gathered):
            if probs:
                raise ValueError(f"zerofn cannot step this model with this {name} (rank "
                                 f"{rank}): " + " ".join(probs))
        differ = next((r for r, (_, sig) in enumerate(gathered) if sig != gathered[0][1]), None)
        if differ is not None:
            raise ValueError(f"zerofn: the ranks' optimizers differ (rank 0: "
                             f"{gathered[0][1]}, rank {differ}: {gathered[differ][1]}); build "
                             "the same optimizer on every rank.")
        old = self.optimizer
        if old is not None:
            self._retire(old, optimizer)
        self._bind(optimizer)

    def _optimizer_problems(self, optimizer, takeover: bool) -> list[str]:
        """What stops ``optimizer`` stepping this model (checked on every rank)."""
        problems = check_optimizer(optimizer, self.param_index)
        problems += overlap_problems(self.plan, optimizer) + overlap_whole(self.plan, optimizer)
        problems += reduce_to_owner_problems(self.plan, optimizer)
        nvme = any(self.homes.home_of(u) == "nvme" for u in self.units if u.slots)
        problems += optimizer_problems(self.plan.offload, optimizer, nvme)
        old = self.optimizer
        if old is None or problems:
            return problems
        binding = self.stepper.binding
        held = {self.param_index[p] for g in optimizer.param_groups for p in g["params"]}
        if not takeover:
            problems.append(f"it is not the {type(old).__name__} that steps this model; "
                            "pass that one (the optimizer the transform returned, or the "
                            "one stepped first).")
        elif not any(binding.holds(s) for s in held):
            problems.append(f"zerofn steps one optimizer per model, and "
                            f"{_a(type(old).__name__)} already steps its other parameters; "
                            "put all of them in one optimizer (param groups may differ), or "
                            "give the transform every optimizer as a sequence, as Muon "
                            "beside AdamW needs: model, (muon, adamw) = "
                            "transform(model, (muon, adamw)).")
        return problems

    def _retire(self, old, new) -> None:
        """``new`` takes over from ``old``: ``old``'s state goes (the homes' with it), and
        stepping ``old`` again raises."""
        self.prepare_state_dict()
        self.stepper.binding.retire(self.reducer.visible.param_of)
        self.homes.forget_state()
        finder.retire(old, f"zerofn: this {type(old).__name__} no longer steps its model: "
                           f"{_a(type(new).__name__)} built later took its parameters over at "
                           "its first step (with fresh state, as a new torch.optim optimizer "
                           "starts). Step that one only.")

    def _bind(self, optimizer) -> None:
        self.stepper.bind(optimizer, self.param_index)
        self.optimizer = optimizer
        for m in members_of(optimizer):
            finder.bound(m)

    # -- set-up ----------------------------------------------------------------------
    def _build_units(self, observer_kinds, optimizer):
        if meta_state(self.model) is None:
            return [], ["some of the model's parameters are on the meta device and some are "
                        "not; build the whole model under torch.device('meta') (the transforms "
                        "then materialize it), or none of it."]
        plan = self.plan
        try:
            persist = plan.sharding.persist_below if plan.stage == 3 else 0
            units = build_units(self.model, plan.sharding.units, self.world, self.rank,
                                persist, self.device, self._own)
        except ValueError as e:
            return [], [str(e)]
        compute = plan.precision.param_dtype
        set_dtypes(units, compute, mixed=compute is not None)
        problems = [] if optimizer is None else \
            check_optimizer(optimizer, {s.param: s for u in units for s in u.slots})
        for kind in observer_kinds:    # [Note: observers]
            problems += kind.preflight(plan, self.device, dist.get_rank(self.group),
                                       dist.get_world_size(self.group))
        problems += overlap_problems(plan, optimizer) + overlap_whole(plan, optimizer)
        problems += reduce_to_owner_problems(plan, optimizer)
        problems += subclass_problems(plan, units, self.mesh, self.replica_world > 1)
        problems += auto_problems(plan.offload, self.device, self.replica_world > 1)
        order = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        problems += offload_problems(plan.offload, optimizer, units,
                                     _param_dtypes(units, plan), order)
        return units, problems

    def _signature(self, optimizer) -> list[str]:
        lines = self.plan.describe() + ([] if optimizer is None else signature(optimizer))
        # groups='s modules hold other experts on other expert-parallel ranks, under other
        # names: compared by their pattern, and their parameters' shapes.
        own = {p: g.pattern for m, g in self._own.items() for p in m.parameters()}
        lines += [f"{own.get(p, n)} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}"
                  for n, p in self.model.named_parameters()]
        return lines

    def _agree_across_ranks(self, problems: list[str], optimizer) -> None:
        """One small collective: every rank raises the same error, or none does."""
        sig = self._signature(optimizer)
        digest = hashlib.sha256("\n".join(sig).encode()).hexdigest()
        # A meta-built model is initialized on every rank, not broadcast: the ranks' random
        # generators must agree, or each would keep rows of a different model.
        rng = rng_digest(self.device) if meta_state(self.model) and \
            self.plan.sharding.sync_module_states else None
        gathered = gather((digest, problems, sig, rng), self.group)
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
        ctx = self.ctx
        # An expert's parameters and buffers: over its own group (other ranks of the data-
        # parallel group hold other experts).
        comm_of = {t: ctx.own[g.pattern][0] for m, g in self._own.items()
                   for t in [*m.parameters(), *m.buffers()]}
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                local = t.data if not isinstance(t, DTensor) else t.to_local()
                comm_of.get(t, ctx.comm).broadcast(local)
                if ctx.replicas is not None:   # then replica 0's, which has shard rank 0's
                    ctx.replicas.broadcast(local)

    def _make_homes(self, units, order: dict, optimizer):
        plan = self.plan
        sharded = {u for u in units if plan.stage == 3 and not u.replicated and u.slots}
        per_unit = plan.stage < 3 and len(units) > 1   # (each all-gather overlaps a step)
        spec = HomeSpec(plan.offload, plan.precision.reduce_dtype, self.device,
                        dist.get_rank(), self.observers.timing, _param_dtypes(units, plan),
                        adam=optimizer is None or cpu_adam_steps(optimizer), table=self.table)
        if plan.offload.device is None:
            return make_homes(spec, units, order, sharded, per_unit)
        # Ranks sharing one drive reserve their swap files' space at once: the free space
        # each saw at the check may hold one rank's file but not every rank's, and a rank
        # refused there must not leave the others waiting in the first collective.
        try:
            homes, problems = make_homes(spec, units, order, sharded, per_unit), []
        except OSError as e:
            homes, problems = None, [str(e)]
        try:
            agree_or_raise(problems, self.group, "zerofn set-up failed")
        except ValueError:
            self.observers.close()
            raise
        return homes

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()`` and ``model.zero_grad()``: the shards start over."""
        self.stepper.zero_grad()

    # -- the public surface (RuntimeView, view.py) --------------------------------------
    @property
    def scaler(self):
        """fp16's LossScaler, or None."""
        return self.stepper.scaler

    def step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped: an inf or nan in any rank's
        gradients, under fp16's loss scaling or ``on_nonfinite="skip"``."""
        return self.stepper.grads.overflow

    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def owned_load(self) -> list[float]:
        """Each rank's share of the whole-tensor optimizers' work (owned.py's ``cost`` of
        the parameters it owns); empty without one."""
        owned = self.stepper.owned
        return list(owned.load) if owned is not None and owned.slots else []

    def comm_stats(self) -> Counter:
        """``zf.comm_stats``: the shard dimension's counts of the last step, HSDP's
        replicate dimension's as ``replicate.<kind>``, and those of each ``groups=``
        pattern's own group as ``<pattern>.<kind>``."""
        out = Counter(self.ctx.comm.last_step)
        for pattern, (comm, _) in self.ctx.own.items():    # groups=: by each pattern
            out.update({f"{pattern}.{k}": v for k, v in comm.last_step.items()})
        if self.ctx.replicas is not None:
            out.update({f"replicate.{k}": v for k, v in self.ctx.replicas.last_step.items()})
        return out

    def model_state_bytes(self) -> dict[str, dict[str, int]]:
        """``zf.model_state_bytes``, measured (memory.py), after the loop's ``zero_grad``
        (optimizer.py's [Note: zero_grad without a patch])."""
        self.stepper.follow_zero_grad()
        owned = self.stepper.owned
        return model_state_bytes(self.ctx, self.optimizer, self.homes, self.shards, self.reducer,
                                 owned.masters.values() if owned is not None else ())

    def units_on_device(self) -> list:
        """The units whose masters and optimizer state live on the device: every unit
        without offload, those ``ratio``, ``placement`` or ``ratio="auto"`` keep there,
        none where everything is offloaded."""
        return self.homes.on_device()

    def home_of(self, unit) -> str:
        """Where ``unit``'s masters and optimizer state live: "device", "host" or "nvme"."""
        return self.homes.home_of(unit)

    def host_ring(self) -> bool:
        """Whether gradients and rows cross through the host ring (homes/ring.py)."""
        return self.homes.ring is not None

    def exact_dtypes(self, unit) -> tuple[torch.dtype, torch.dtype]:
        """``(masters, moments)``: the narrowest dtypes holding ``unit``'s exactly, for
        checkpoints (bf16 where a home stores them in bf16)."""
        return self.homes.exact_dtypes(unit)

    def placement_reason(self) -> str | None:
        """Under offload's ``ratio="auto"``, once the first step not skipped placed the units:
        what it measured and what moved (placement.py). None before then, and otherwise."""
        placement = self.stepper.placement
        return placement.reason if placement is not None and placement.placed else None

    def time_series(self) -> tuple[str, ...]:
        """The timing series the homes' work fills, beyond every run's."""
        return self.homes.time_series

    # -- parameter state: the rest of zerofn reads and writes masters through these
    def master_rows(self, slot) -> torch.Tensor:
        """This rank's rows of ``slot``'s master, what the optimizer steps (detached)."""
        return self.table[slot].opt_param.detach()

    def write_master_rows(self, slot, rows: torch.Tensor) -> None:
        """Copy ``rows``, this rank's rows of ``slot``'s master, in (a load: it calls
        ``refresh_params`` once every slot is written)."""
        with torch.no_grad():
            self.table[slot].opt_param.copy_(rows)

    def slot_of_stepped(self) -> dict:
        """What the optimizer steps (its params) -> the slot each is the master of."""
        return {self.table[s].opt_param: s for s in self.slot_of.values()}

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

    def group_names(self, optimizer) -> list[list[str]]:
        """The names of each param group's parameters, as a checkpoint lists them: this
        rank's; with ``groups=``, every rank's (each expert-parallel rank holds other
        experts, and a checkpoint's groups must name them all, once). Collective then,
        once per optimizer."""
        slot_of_opt = self.slot_of_stepped()
        mine = [[slot_of_opt[p].fqn for p in g["params"]] for g in optimizer.param_groups]
        if not self._own:
            return mine
        key = (id(optimizer), tuple(map(len, mine)))
        if self._group_names[0] != key:
            ranks = gather(mine, self.group)
            self._group_names = (key, [list(dict.fromkeys(n for names in ranks for n in names[i]))
                                       for i in range(len(mine))])
        return self._group_names[1]

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> torch.Tensor:
        """``zf.clip_grad_norm_`` (runtime/clip.py); the observers hear of the norm."""
        return self.stepper.clip_grad_norm(max_norm, norm_type, error_if_nonfinite)

    def set_step(self, step: int) -> None:
        """The next optimizer step is number ``step`` (a resumed run's own count)."""
        self.stepper.set_step(step)
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

    def full_tensor(self, slot, local: torch.Tensor, device=None) -> torch.Tensor:
        """A tensor sharded like ``slot`` gathered whole (shards.py). Collective."""
        return self.shards.full_tensor(slot, local, device)

    def gather_unit(self, unit) -> torch.Tensor:
        """Every rank's master rows of ``unit``, rank-major (shards.py). Collective."""
        return self.shards.gather_unit(unit)

    def prepare_state_dict(self, read: bool = True) -> None:
        """Bring every home's state into memory (until the next step), so the optimizer's
        tensors hold values. Every state dict access starts here (after the loop's
        ``zero_grad``, optimizer.py's [Note: zero_grad without a patch]). ``read=False``
        (a save that reads a unit at a time: ``read_unit``) leaves state in a file or in
        fewer bits where it is."""
        self.stepper.follow_zero_grad()
        self.shards.settle_copies()  # a load may write host rows a copy to the device reads
        if self.gatherer is not None:   # nor may a gather started before the load be used
            self.gatherer.discard_pending()
        if read:
            self.homes.materialize(self.optimizer)

    def unread(self, unit) -> bool:
        """Whether ``unit``'s state is out of memory now (a file, fewer bits: its optimizer
        tensors are stand-ins), for ``read_unit``."""
        return self.homes.unread(unit)

    def hold_state(self, guard) -> None:
        """Change no unit's state (the next step, a step during backward) before
        ``guard.before_change`` lets it: a background save is reading it
        (io/checkpoint/unit_copies.py)."""
        self.ctx.saves.add(guard)

    def checkpoint_waits(self) -> tuple[int, float]:
        """``(steps, seconds)``: the steps that waited for a background save to write
        what they change, and how long they waited, since set-up."""
        return self.ctx.saves.waits, self.ctx.saves.waited_s

    def read_unit(self, unit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An unread ``unit``'s flat (master, exp_avg, exp_avg_sq), read into new memory."""
        return self.homes.read_unit(unit)

    def refresh_params(self) -> None:
        """Make the compute parameters equal the masters again (after a load). Collective."""
        if self.stepper.owned is not None:
            self.stepper.owned.stale()     # (a load wrote the masters' rows)
        self.homes.recast()
        self.shards.refresh_compute()
        for comm in self.ctx.comms:
            comm.drain()
        self.shards.settle_copies()   # NVMe's materialized rows are let go at the next step

    def init_optimizer_state(self) -> None:
        """Create the bound optimizer's state (a zero step) where it has none yet, so a
        load has tensors to load into."""
        if self.stepper.binding is not None:
            if not self.stepper.binding.stepped:
                self.stepper.owned.make_state()
            self.stepper.binding.init_state()

    def spread_owned_state(self) -> None:
        """Whole-tensor optimizers' state in rows on every rank, as a state dict shows it
        (owned.py's [Note: owned state in state dicts]). Collective."""
        if self.stepper.owned is not None:
            self.stepper.owned.spread_out()

    def forget_made_state(self, loaded: set) -> None:
        """After a load: drop the state ``init_optimizer_state`` made where the checkpoint
        held none (``loaded``: the optimizer's params it held state for)."""
        if self.stepper.binding is not None:
            self.stepper.binding.forget_made_state(loaded)

    # -- teardown ----------------------------------------------------------------------
    def restore(self) -> None:
        """Undo this runtime: full parameters and full optimizer state, no hooks.

        Used when another transform is applied on top, so the combined plan is built afresh.
        """
        self.observers.close()
        self.prepare_state_dict()
        self.spread_owned_state()     # (restored as every other state: whole)
        self.stepper.restore()
        self.forward.remove()
        self.reducer.remove_hooks()
        for unit in self.units:
            for s in unit.slots:
                s.param.data = self.full_tensor(s, self.table[s].opt_param.detach(), unit.device)
                if s.hooks is not None:
                    rewrap_hooked(s)
                for module, name in s.owners:
                    module._parameters[name] = s.param
        slot_of_opt = self.slot_of_stepped()
        # Optimizer state goes where torch.optim keeps it: with the parameter.
        if self.stepper.binding is not None:
            self.stepper.binding.restore(
                lambda shard, v: self.full_tensor(slot_of_opt[shard], v, self.device)
                if torch.is_tensor(v) and v.shape == shard.shape and v.dim() > 0 else v)
            for m in members_of(self.optimizer):
                finder.unbound(m)
        finder.forget(self)
        detach(self.model)
        self.ctx.pool.clear()


def _a(name: str) -> str:
    """``"an AdamW"``, ``"a SGD"``: the class name with its article."""
    return ("an " if name[:1].upper() in "AEIOU" else "a ") + name


def _param_dtypes(units, plan) -> dict:
    """ZeRO-3 parameter offload: each sharded unit's compute dtype (what its home holds)."""
    if not plan.offload.params:
        return {}
    return {u: u.compute_dtype for u in units if u.slots and not u.replicated}


def _check_device(device: torch.device, comm: Comm) -> None:
    """Raised before any collective: on a device the group does not serve, the first one
    would fail or hang."""
    current = torch.cuda.current_device() if device.type == "cuda" else None
    problems = device_problems(device, comm.backend, current)
    if problems:
        raise ValueError("zerofn set-up: " + " ".join(problems))


def _resolve_group(group, model: nn.Module):
    """``(groups, device)``: the groups ``group=`` asks for (mesh.py), and the device the
    model computes on: its parameters', or for a meta-built model the mesh's, else the
    current CUDA device, else the CPU."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "zerofn needs torch.distributed: call torch.distributed.init_process_group() "
            "first (torchrun sets up the environment it reads; use backend 'gloo' on CPU, "
            "'nccl' on GPUs). A single process works too, with world_size=1.")
    mesh = group if isinstance(group, DeviceMesh) else None
    real = next((p.device for p in model.parameters() if not p.is_meta), None)
    device = real or target_device(mesh.device_type if mesh is not None else None)
    return groups_of(group, device.type), device
