"""The runtime a plan becomes: units, buffers, hooks and the rewired optimizer, in one place.

It lives on the model (``model._zerofn``); the transforms themselves stay stateless.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..plan import Plan
from .attach import attach, detach, is_transformed, runtime_of
from .clip import clip_grads
from .comm import Comm, device_problems
from .copies import CopyStreams
from .events import Observers, kinds
from .grads import GradReducer, ZerofnUnitInputs
from .host_malloc import return_large_frees
from .materialize import Materializer, meta_state, rng_digest, target_device
from .memory import model_state_bytes
from .mesh import layout_of
from .offload import cpu_adam_steps, make_offload, offload_problems
from .optimizer import OptimizerWiring, check_optimizer
from .hooks import eager, in_backward, on_backward_begin
from .params import ParamGatherer
from .pool import BufferPool
from .precision import LossScaler
from .step import StepGrads
from .timing import UNTIMED
from .units import build_units, gather_from_ranks

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


class Runtime:
    """What a plan becomes on one model and optimizer: units, buffers, hooks and the
    rewired optimizer. Built by ``apply_plan`` (the transforms), found by ``runtime_of``,
    undone by ``restore`` (when another transform is applied on top); it lives on the
    model in between.

    What the rest of zerofn may use (everything else is its own):
        attributes: ``model``, ``optimizer``, ``plan``, ``device``, ``group`` (every rank
        of the layout), ``world`` and ``rank`` (of the shard group), ``replica_world``,
        ``backend``, ``units``, ``observers``;
        the step: ``step_skipped()``, ``loss_scale()`` and ``scaler`` (fp16's LossScaler,
        or None), ``comm_stats()``, ``model_state_bytes()``, ``time_series()``,
        ``clip_grad_norm(...)``, ``set_step(step)``,
        ``in_phase(name, fn, *args)``, ``observer(cls)``, ``no_sync()``;
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
            self._on_packed if self.stage == 3 else None, plan.precision.reduce_dtype,
            self.replicas,
            on_shard_ready=(lambda unit, shard: self.step_grads.shard_ready(unit, shard))
            if offloaded else None,
            before_shard_write=self.copies.before_device_write if offloaded else None,
            forward_order=(lambda g=self.gatherer: g.order) if self.gatherer else None,
            timing=timing, guard=guard)
        self.scaler = _loss_scaler(plan)
        self.step_grads = StepGrads(self.comm, self.pool, units, self.reducer, self.scaler,
                                    self.device, self.copies, self.offload, self.replicas,
                                    timing)
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
        slot_of = {s.param: s for u in units for s in u.slots}
        problems += check_optimizer(self.optimizer, slot_of)
        for kind in kinds():    # [Note: observers]
            problems += kind.preflight(self.plan, self.device, dist.get_rank(self.group),
                                       dist.get_world_size(self.group))
        problems += offload_problems(self.plan.offload, self.optimizer, units,
                                     self._offloaded_param_dtypes(units))
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

    @torch.no_grad()
    def _lay_out_shards(self) -> None:
        """Every unit's masters and compute params (see ``_lay_out_unit``). A meta-built
        model is materialized and initialized module by module on the way, each unit laid
        out as soon as its modules are initialized (runtime/materialize.py)."""
        self._flats = self._allocate_flats()
        if self.meta:
            self._materialize()
        else:
            for unit in self.units:
                self._lay_out_unit(unit)
        self.flats = [f for f in self._flats.values() if f.views]
        del self._flats
        if self.offload is not None:
            self.offload.recast()   # rows CPU Adam never steps (frozen) must be right too

    def _lay_out_unit(self, unit) -> None:
        """Masters (what the optimizer steps) and compute params of one unit, from its full
        parameters.

        The master is a flat buffer of this rank's rows, except in plain ZeRO-1/2 where this
        rank's rows of the full parameters serve (fp32 params are their own master). ZeRO-3
        computes on a flat shard (the master itself, or its cast copy) and registers it as
        Shard(0) DTensor parameters; the full parameters are then let go.
        """
        sharded = unit in self._sharded_params
        compute = self.plan.precision.param_dtype or unit.dtype
        master = self._place_masters(unit, sharded)
        if sharded:
            unit.shard = self._compute_shard(unit, compute, master)
        elif compute != unit.dtype:
            for s in unit.slots:
                s.param.data = s.param.data.to(compute)
        unit.dtype = compute
        # Under offload the masters are the offload's; its rows here are transient.
        unit.master = master if self.offload is None else None
        for s in unit.slots if sharded else ():
            s.sharded = nn.Parameter(s.as_dtensor(s.shard_of(unit.shard), self.mesh,
                                                 self.placements),
                                     requires_grad=s.requires_grad)
            s.param.data = self.gatherer.placeholder(s, unit)
            for module, name in s.owners:
                module._parameters[name] = s.sharded

    def _materialize(self) -> None:
        """Meta construction: initialize and lay out unit by unit; any rank's problem (an
        uninitialized parameter or buffer, an init that raised) is raised on every rank,
        with the model's meta tensors put back."""
        m = Materializer(self.model, self.units, self.plan.sharding.init, self.device)
        m.run(self._lay_out_unit)
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, m.problems, group=self.group)
        failed = next(((r, p) for r, p in enumerate(gathered) if p), None)
        if failed is not None:
            m.undo()
            raise ValueError(f"zerofn could not initialize the meta-built model (rank "
                             f"{failed[0]}): " + " ".join(failed[1]))
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [m.new_of.get(p, p) for p in group["params"]]
        for old, new in m.new_of.items():
            if old in opt.state:
                opt.state[new] = opt.state.pop(old)

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
                            self._offloaded_param_dtypes(units), self.plan.precision.param_dtype,
                            dist.get_rank(), self.timing)

    def _offloaded_param_dtypes(self, units) -> dict:
        """ZeRO-3 parameter offload: each sharded unit's compute dtype (what NVMe stores)."""
        if not self.plan.offload.params:
            return {}
        dtype = self.plan.precision.param_dtype
        return {u: dtype or u.dtype for u in units if u.slots and not u.replicated}

    def _place_masters(self, unit, sharded: bool) -> torch.Tensor | None:
        """The unit's master rows: the offload's, or the device's flat buffer, or (plain
        ZeRO-1/2, fp32) this rank's rows of the full parameters themselves (None)."""
        if self.offload is not None:
            return self.offload.place_masters(unit, keep=sharded)
        master = self._flats["master"].views.get(unit)
        for s in unit.slots:
            rows = s.rows_of(s.param.detach())
            s.opt_param = rows if master is None else s.shard_of(master).copy_(rows)
        return master

    def _compute_shard(self, unit, compute: torch.dtype, master) -> torch.Tensor:
        """ZeRO-3's flat compute shard: held by the offload under parameter offload (for
        NVMe, in the swap file, with a stand-in here); else the master itself where it is
        on the device in the compute dtype, or a cast copy of it."""
        if self.plan.offload.params:
            return self.offload.param_shard(unit, compute)
        if compute == unit.dtype and self.offload is None:
            return master
        return self._flats["compute"].views[unit].copy_(master)

    def _allocate_flats(self) -> dict[str, dict]:
        """The device's master rows (where they are not the full parameters' own) and
        ZeRO-3's compute shards (where they are not the masters), one allocation per kind
        and dtype, handed out per unit: many small long-lived blocks made while a meta
        model's transient full units come and go would fragment the host heap."""
        compute_of = {u: self.plan.precision.param_dtype or u.dtype for u in self.units}
        sharded = set(self._sharded_params)
        masters = {u: (u.dtype, u.shard_numel) for u in self.units if self.offload is None
                   and (u in sharded or compute_of[u] != u.dtype)}
        shards = {u: (compute_of[u], u.shard_numel) for u in sharded
                  if not self.plan.offload.params
                  and (compute_of[u] != u.dtype or self.offload is not None)}
        return {"master": FlatBuffers(masters, self.device),
                "compute": FlatBuffers(shards, self.device)}

    def _register_forward_hooks(self):
        """ZeRO-3 only: ZeRO-1/2 keep full parameters and gather them inside step()."""
        handles = []
        for unit in self.units if self.gatherer is not None else ():
            if unit.replicated:
                continue   # persistent params are whole: nothing to gather
            is_root = unit is self.root
            pre = self.observers.guard(self._pre_forward, unit.name)
            post = self.observers.guard(self._post_forward, unit.name)
            # [Note: hooks under torch.compile]
            handles.append(unit.module.register_forward_pre_hook(
                eager(lambda m, a, k, u=unit, r=is_root: pre(u, r, a, k)), prepend=True,
                with_kwargs=True))
            handles.append(unit.module.register_forward_hook(
                eager(lambda m, a, o, u=unit, r=is_root: post(u, r, o)), always_call=True))
        return handles

    def _register_model_hooks(self):
        """The observers' forward and backward events ([Note: observers]), for every stage.
        An observer hears of a forward before its first gather, and of backward once
        ZeRO-3 has gathered the root unit again: registered after the units' hooks, the
        backward hook on the outputs runs after theirs (so a rank waiting in that gather
        is still in forward to the failure watch, as it was before backward began)."""
        return [self.model.register_forward_pre_hook(eager(self._forward_begins),
                                                     prepend=True),
                self.model.register_forward_hook(eager(self._forward_ends), always_call=True)]

    def _forward_begins(self, module, args) -> None:
        if not in_backward():   # (a checkpointed recompute is part of backward)
            self.observers.forward_begin()

    def _forward_ends(self, module, args, output=None) -> None:
        if in_backward():
            return
        raised = sys.exc_info()[1]    # the forward raised: the hook runs anyway
        self.observers.forward_end(raised)
        if raised is None and torch.is_grad_enabled():
            heard = []

            def backward_begins(grad):
                if not heard:          # (once per forward, whatever its outputs)
                    heard.append(True)
                    self.observers.backward_begin()
            on_backward_begin(output, eager(backward_begins))

    # -- forward ---------------------------------------------------------------------
    def _pre_forward(self, unit, is_root: bool, args: tuple, kwargs: dict):
        """Gather the unit; returns its inputs as the reducer tracks them (grads.py's
        [Note: a unit's backward is done]), or None to leave them be."""
        self.gatherer.pre_forward(unit, is_root)
        # (also a recompute in backward: reentrant checkpointing ran the forward without
        # gradients and backpropagates the recompute; a non-reentrant one drops its graph)
        if torch.is_grad_enabled():
            return self.reducer.track_forward(unit, args, kwargs)
        return None

    def _post_forward(self, unit, is_root: bool, output) -> None:
        raised = sys.exc_info()[1]     # the forward raised: the hook runs anyway
        if raised is not None:
            _explain_in_place(raised, unit)
        self.gatherer.post_forward(unit, is_root, output)

    def _on_packed(self, unit) -> None:
        if unit is None:
            self.gatherer.end_backward()
        else:
            self.gatherer.free(unit)

    # -- optimizer step ----------------------------------------------------------------
    def before_step(self) -> None:
        skip = self.step_grads.settle()
        self._settle_copies()   # the step rewrites host rows the last step's copies read
        # Parameters without a gradient are left alone by torch.optim: that is how a
        # skipped step, and a step zerofn's CPU Adam already took, leave it nothing to do.
        on_host = self.offload is not None and self.offload.cpu_adam
        self._refreshed = not skip and (on_host or self._steps_per_unit())
        if self._refreshed and on_host:
            # Each unit's updated rows head back to the device as soon as CPU Adam is done
            # with the unit, overlapping the step of the next one; the kernel unscales and
            # clips the gradients as it reads them. Memory the offload reuses within the
            # step (NVMe's staging ring) waits for those copies (``copied``).
            self.offload.step(self.optimizer, self.step_grads.grads, self._refresh_unit,
                              self.step_grads.grad_scale, copied=self.copies.before_host_write)
            self._await_shards()
        elif self._refreshed:
            self._step_unit_by_unit()
        for s in self.slot_of.values():
            s.opt_param.grad = None if skip or self._refreshed else self.step_grads.grads.get(s)

    def _steps_per_unit(self) -> bool:
        """ZeRO-1/2 with the optimizer on the device: step one unit at a time, so each
        unit's all-gather runs while the optimizer steps the next."""
        return self.offload is None and self.stage < 3 and len(self.units) > 1

    def _step_unit_by_unit(self) -> None:
        """The user's optimizer over one unit's rows at a time (torch.optim leaves params
        without a gradient alone, and steps each param from its own state, so this is the
        same step), each unit's rows shared as soon as they are updated."""
        grads = self.step_grads.grads
        self.opt.bypass = True
        try:
            for unit in self.units:
                for s in unit.slots:
                    s.opt_param.grad = grads.get(s)
                self.optimizer.step()
                for s in unit.slots:
                    s.opt_param.grad = None
                self._refresh_unit(unit, self._updated_rows(unit))
        finally:
            self.opt.bypass = False

    def after_step(self) -> None:
        skipped = self.step_grads.overflow
        if self.scaler is not None:
            self.scaler.update(skipped)
        for s in self.slot_of.values():
            s.opt_param.grad = None
        self.step_grads.release()
        if not skipped and not self._refreshed:
            self._refresh_compute()   # torch.optim stepped the masters
        # [Note: no deferred gathers] The updated rows are all-gathered (units overlapping
        # one another) before step() returns: parameters are current whenever the user
        # looks, and no collective outlives the call, so none can outlive the process group.
        self.comm.drain()
        self.comm.end_step()
        if self.replicas is not None:
            self.replicas.end_step()
        self.observers.step_done()

    def _host_grad_dtype(self, unit) -> torch.dtype:
        """Gradients land on the host in the reduce dtype when CPU Adam reads them (scaled
        fp16 too: it unscales as it reads, step.py's [Note: deferred scaling]); in the
        master dtype when torch.optim steps them."""
        precision = self.plan.precision
        if cpu_adam_steps(self.optimizer):
            return precision.reduce_dtype or precision.param_dtype or unit.dtype
        return unit.dtype

    def zero_grad(self) -> None:
        self.step_grads.release()
        self.reducer.zero_grad()

    def _refresh_compute(self) -> None:
        """Compute params from the updated masters of every unit (after a torch.optim step
        or a load; CPU Adam refreshes each unit as it steps it)."""
        for unit in self.units:
            self._refresh_unit(unit, self._updated_rows(unit))
        self._await_shards()

    def _updated_rows(self, unit) -> torch.Tensor | None:
        """This rank's updated rows of ``unit`` in the compute dtype where one exists; None
        where the compute params' own rows are the ones the optimizer updated."""
        if self.offload is not None:
            return self.offload.updated_rows(unit)
        return unit.master

    @torch.no_grad()
    def _refresh_unit(self, unit, rows: torch.Tensor | None) -> None:
        """This rank's compute rows of ``unit`` from its updated ``rows``: copied into the
        ZeRO-3 shard, or copied into a send buffer and all-gathered into the full params."""
        if not unit.slots:
            return
        if unit in self._sharded_params:
            if rows is not None and rows is not unit.shard:
                self.copies.to_device(unit, unit.shard, rows)
            return
        # The rows go straight into this rank's slot of the gather buffer: an in-place
        # all-gather, with no separate send buffer.
        recv = self.pool.take(self.world * unit.shard_numel, unit.dtype, unit.device)
        send = recv.view(self.world, unit.shard_numel)[self.rank]
        if rows is not None:
            self.copies.to_device(unit, send, rows)
            self.copies.device_wait(unit)
        else:
            for s in unit.slots:
                send[s.offset:s.offset + s.local_numel].copy_(s.rows_of(s.param.detach()).reshape(-1))
        work = self.timing.issue("all_gather", "gather[step]", unit.name,
                                 lambda: self.comm.all_gather(recv, send, async_op=True),
                                 "gather_wait")
        self.comm.enqueue(work, recv.nbytes,
                          lambda u=unit, rv=recv, own=rows is None: self._params_arrived(u, rv, own))

    def _await_shards(self) -> None:
        """ZeRO-3's next forward gathers from the refreshed shards: device work from here on
        waits for their copies (the host does not)."""
        for unit in self._sharded_params:
            self.copies.device_wait(unit)

    def _settle_copies(self) -> None:
        """Block until every copy to the device has read its host rows, which the host is
        about to rewrite. Long done by the next step; a load may come sooner."""
        for unit in self.units:
            self.copies.before_host_write(unit)

    def _params_arrived(self, unit, recv, own_current: bool) -> None:
        """The gathered rows into the full params; this rank's own rows only where they are
        not the ones the optimizer updated in place (``own_current``)."""
        ranks = recv.view(self.world, unit.shard_numel)
        r = self.rank
        with torch.no_grad():
            for s in unit.slots:
                if not own_current:
                    gather_from_ranks(ranks[:, s.cols], s.param.detach())
                    continue
                full, width = s.param.detach().view(-1), s.chunk * s.inner
                gather_from_ranks(ranks[:r, s.cols], full[:r * width])
                gather_from_ranks(ranks[r + 1:, s.cols], full[(r + 1) * width:])
        self.pool.give(recv)

    def refresh_params(self) -> None:
        """Make the compute parameters equal the masters again (after a load). Collective."""
        if self.offload is not None:
            self.offload.recast()
        self._refresh_compute()
        self.comm.drain()
        self._settle_copies()   # NVMe's materialized rows are let go at the next step

    def prepare_state_dict(self) -> None:
        """Bring NVMe-resident state into memory (until the next step), so the optimizer's
        tensors hold values. Every state dict access starts here."""
        self._settle_copies()   # a load may write host rows a copy to the device still reads
        if self.gatherer is not None:   # nor may a gather started before the load be used
            self.gatherer.discard_pending()
        if self.offload is not None:
            self.offload.materialize(self.optimizer)

    def full_tensor(self, slot, local: torch.Tensor, device=None) -> torch.Tensor:
        """Gather a tensor sharded like ``slot`` (this rank's rows) into a new full tensor on
        ``device`` (default: where ``local`` is). Collective.

        The gather runs on the runtime's device whatever ``local``'s: under offload the rows
        live on the host, and NCCL gathers only device tensors.
        """
        width = slot.chunk * slot.inner
        out = torch.empty(self.world * width, dtype=local.dtype, device=self.device)
        mine = out.view(self.world, width)[self.rank]    # gathered in place
        mine[local.numel():].zero_()
        mine[:local.numel()].copy_(local.reshape(-1))
        self.comm.all_gather(out, mine)
        return out[:slot.numel].view(slot.shape).to(device or local.device, copy=True)

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


class FlatBuffers:
    """``{key: (dtype, numel)}`` as zeroed views of one buffer per dtype (``views``), each
    starting ``align`` elements apart (256 bytes for fp32), as vector kernels like.
    ``holds`` tells accounting which storage they share (see ``accounting._extents``)."""

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


def _explain_in_place(exc: BaseException, unit) -> None:
    """Name the rule behind autograd's error when a ZeRO-3 unit modifies its inputs in
    place (grads.py's [Note: a unit's backward is done]), once, at the innermost unit."""
    lead = "zerofn: under ZeRO-3, as under FSDP2, a unit may not modify its inputs in place"
    if not (isinstance(exc, RuntimeError) and ZerofnUnitInputs.__name__ in str(exc)) \
            or not hasattr(exc, "add_note") \
            or any(n.startswith(lead) for n in getattr(exc, "__notes__", ())):
        return
    exc.add_note(f"{lead}, and unit {unit.name!r} (or a module inside it) did: write "
                 f"`x = x * s`, not `x *= s` (docs/design.md §3).")


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
