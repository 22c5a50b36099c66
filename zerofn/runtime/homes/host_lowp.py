"""offload("cpu", state_dtype=..., master_dtype=...): the host offload with Adam's moments
in bf16 or 8-bit codes and, optionally, bf16 masters.

[Note: stored form, fp32 face] The step reads and writes the state in its stored form, in
one pass of the C++ kernel (dequantize, update, requantize). Everywhere else the state
is fp32, as torch.optim's Adam keeps it: outside the step the optimizer's tensors for it
are stand-ins, and ``materialize`` (every state-dict access starts with it) decodes the
state into fp32 tensors and points them there; the next step or ``recast`` encodes what
they hold back (a load may have written into them) and lets them go. So state dicts,
checkpoints and FSDP2 see fp32 whatever the stored form, and a checkpoint moves between
stored forms and world sizes.

Encoding back is exact for state the step wrote (a bf16 value is an fp32 value; an
8-bit code times its block's scale decodes and encodes to the same code), so a state
dict access changes nothing; fp32 state loaded from elsewhere rounds to nearest.

Under int8, parameters of fewer than 4096 elements keep fp32 moments (zerofn.optim.lowp,
MIN_8BIT_NUMEL), as bitsandbytes' and torchao's 8-bit optimizers do.

[Note: rounding streams] bf16 state rounds stochastically in the kernel, from a
counter-based stream keyed by (seed, parameter, shard rank, step): a run and its resume
round alike, HSDP's replicas of a shard round alike, and no thread count changes it.

The stored parts and their codec are stored.py's, shared with the NVMe offload.
"""
from __future__ import annotations

import torch

from .base import HostArena, decoupled_weight_decay, point_at, stand_in
from .host import HostHome, per_unit_groups
from .stored import StoredForm


class LowpHostHome(HostHome):
    """``HostHome`` with the state stored in fewer bits (see the module notes)."""

    def __init__(self, units, spec, per_unit: bool = False, ring: bool = False):
        policy = spec.policy
        self.form = StoredForm(policy.state_dtype, policy.master_dtype, policy.seed)
        self.state: dict = {}       # unit -> its UnitState (views of the arenas)
        self._unit_of = {s: u for u in units for s in u.slots}
        self.resident: dict = {}    # unit -> fp32 (master, exp_avg, exp_avg_sq) while decoded
        self._optimizer = None      # (bound later, where the transform was given none)
        super().__init__(units, spec, per_unit, ring)
        filler = HostArena([1], torch.float32)     # what undecoded tensors view
        self._arenas.append(filler)
        self._filler = filler.take(1)

    # -- storage -------------------------------------------------------------------------
    def _allocate_state(self) -> None:
        """Masters in their stored dtype (page-locked: with bf16 masters they are the rows
        the device reads), moments in theirs, and the fp32 extras (int8's block scales):
        three arenas for all units, or for each (ratio="auto" gives a moved unit's back)."""
        form = self.form
        self.master_dtype = {u: form.master_dtype for u in self.units}
        each = self._groups is per_unit_groups
        for units in [[u] for u in self.units] if each else [self.units]:
            sizes = [u.shard_numel for u in units]
            masters = HostArena(sizes, form.master_dtype, self.pin)
            moments = HostArena(sizes * 2, form.moments_dtype)
            extras = HostArena([form.extras_numel(u) for u in units], torch.float32)
            for u in units:
                self.master[u] = masters.take(u.shard_numel)
                self.exp_avg[u], self.exp_avg_sq[u] = (moments.take(u.shard_numel),
                                                       moments.take(u.shard_numel))
                self.state[u] = form.unit_state(u, self.master[u], self.exp_avg[u],
                                                self.exp_avg_sq[u],
                                                extras.take(form.extras_numel(u)))
                form.zero(self.state[u])
            for arena in (masters, moments, extras):
                self._keep(arena, units)

    def state_buffers(self) -> list[torch.Tensor]:
        masters = list(self.master.values()) if self.form.master_dtype != torch.float32 else []
        extras = [t for st in self.state.values()
                  for pair in (*st.scales.values(), *st.fp32.values()) for t in pair]
        return masters + list(self.exp_avg.values()) + list(self.exp_avg_sq.values()) + extras

    def exact_dtypes(self, unit) -> tuple[torch.dtype, torch.dtype]:
        return self.form.exact_dtypes()

    def kernel_options(self, slot) -> dict:
        return self.form.kernel_options(self.state[self._unit_of[slot]], slot)

    # -- set-up --------------------------------------------------------------------------
    def place_masters(self, unit, keep: bool) -> torch.Tensor:
        master = super().place_masters(unit, keep)
        if self.form.master_dtype != torch.float32:   # (the fp32 face stands in: the note)
            for s in unit.slots:
                self.table[s].opt_param = stand_in(s.local_shape, torch.float32)
        return master

    def bind(self, optimizer) -> None:
        """zerofn's CPU Adam steps the stored form (set-up refuses another optimizer: the
        runtime's ``offload_problems``); the optimizer's state tensors are stand-ins."""
        self.cpu_adam, self.decoupled = True, decoupled_weight_decay(optimizer)
        self.time_series = tuple(dict.fromkeys(self.time_series + ("cpu_adam",)))
        trainable = [s for u in self.units for s in u.trainable]
        self._steps = HostArena([1] * len(trainable), torch.float32)
        before = {}
        for s in trainable:
            before[s] = optimizer.state.get(self.table[s].opt_param, {})
            optimizer.state[self.table[s].opt_param] = {
                "step": self._steps.take(1).view(()),
                "exp_avg": stand_in(s.local_shape, torch.float32),
                "exp_avg_sq": stand_in(s.local_shape, torch.float32)}
        self._optimizer = optimizer
        if any(before.values()):          # state the optimizer had (e.g. loaded) moves in
            self.materialize(optimizer)
            for s, state in before.items():
                for k, v in state.items():
                    optimizer.state[self.table[s].opt_param][k].copy_(v)
            self.evict()

    def forget_state(self) -> None:
        self.evict()
        for st in self.state.values():
            self.form.zero(st)

    def release(self, units) -> None:
        for u in units:
            self.state.pop(u, None)
            self.resident.pop(u, None)
        super().release(units)

    # -- the fp32 face -------------------------------------------------------------------
    def materialize(self, optimizer) -> None:
        """Decode every unit's state into fp32 tensors and point the optimizer's at them."""
        if self.resident:
            return
        for u in self.units:
            self.resident[u] = torch.zeros(3, u.shard_numel)
            self.form.decode(u, self.state[u], self.resident[u], self._faced_masters)
        self._point(self.resident)

    def unread(self, unit) -> bool:
        return not self.resident

    def read_unit(self, unit):
        """The unit's state decoded into fp32 (the masters as they are, where fp32)."""
        flat = torch.zeros(3, unit.shard_numel)
        self.form.decode(unit, self.state[unit], flat, self._faced_masters)
        return (flat[0] if self._faced_masters else self.master[unit]), flat[1], flat[2]

    def evict(self) -> None:
        """Encode the decoded state back (it may have been loaded into) and let it go."""
        if not self.resident:
            return
        for u, flat in self.resident.items():
            self.form.encode(u, self.state[u], flat, self._faced_masters)
        self._point(None)
        self.resident = {}

    @property
    def _faced_masters(self) -> bool:
        """bf16 masters show an fp32 face; fp32 ones are the optimizer's own tensors."""
        return self.form.master_dtype != torch.float32

    def _point(self, flats) -> None:
        optimizer = self._optimizer
        for u in self.units:
            for s in u.slots:
                views = [s.shard_of(f) for f in flats[u]] if flats else [None] * 3
                if self._faced_masters:
                    point_at(self.table[s].opt_param, views[0], s.local_shape, self._filler)
                state = optimizer.state.get(self.table[s].opt_param) \
                    if optimizer is not None else None
                if state:
                    point_at(state["exp_avg"], views[1], s.local_shape, self._filler)
                    point_at(state["exp_avg_sq"], views[2], s.local_shape, self._filler)

    # -- the step ------------------------------------------------------------------------
    def steps_early(self, unit) -> bool:
        """(Not while a state dict has the state decoded: the step encodes it first.)"""
        return not self.resident and super().steps_early(unit)

    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        self.evict()
        super().step(optimizer, grads, after_unit, grad_scale, copies, early)

    def recast(self) -> None:
        """Loaded fp32 state goes back to its stored form first."""
        self.evict()
        super().recast()
