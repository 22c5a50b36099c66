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
"""
from __future__ import annotations

import zlib

import torch

from ...optim import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise, signed_code
from ...optim.lowp import moment_dtype
from ..timing import UNTIMED
from .base import HostArena, point_at, stand_in
from .host import HostOffload

INT8 = torch.int8   # (what the user names; stored as uint8 indices into the code)


class LowpHostOffload(HostOffload):
    """``HostOffload`` with the state stored in fewer bits (see the module notes)."""

    def __init__(self, units, grad_dtype_of, optimizer, compute_dtype=None, timing=UNTIMED,
                 *, state_dtype=torch.float32, master_dtype=torch.float32, seed: int = 0):
        self.state_dtype, self.master_store, self.seed = state_dtype, master_dtype, seed
        self.scales: dict = {}      # slot -> (exp_avg's scales, exp_avg_sq's) for int8
        self.fp32_moments: dict = {}  # slot -> (exp_avg, exp_avg_sq) of int8's small ones
        self.resident: dict = {}    # unit -> fp32 (master, exp_avg, exp_avg_sq) while decoded
        super().__init__(units, grad_dtype_of, optimizer, compute_dtype, timing)

    # -- storage -------------------------------------------------------------------------
    def _allocate_state(self) -> None:
        """Masters in their stored dtype (page-locked: with bf16 masters they are the rows
        the device reads), moments in theirs, and int8's block scales."""
        units = self._units
        sizes = [u.shard_numel for u in units]
        if self.master_store == torch.bfloat16:
            self.master_dtype = {u: torch.bfloat16 for u in units}
        masters = HostArena(sizes, self.master_store, self.pin)
        self.master.update({u: masters.take(u.shard_numel) for u in units})
        stored = torch.uint8 if self.state_dtype == INT8 else self.state_dtype
        moments = HostArena(sizes * 2, stored)
        for state in (self.exp_avg, self.exp_avg_sq):
            state.update({u: moments.take(u.shard_numel) for u in units})
        self._arenas += [masters, moments]
        if self.state_dtype == INT8:
            self._allocate_scales()

    def _allocate_scales(self) -> None:
        """int8's block scales; a small parameter's fp32 moments instead (MIN_8BIT_NUMEL)."""
        slots = [s for u in self._units for s in u.slots]
        small = [s for s in slots if moment_dtype(INT8, s.numel) == torch.float32]
        big = [s for s in slots if s not in small]
        blocks = [-(-s.local_numel // QUANT_BLOCK) for s in big]
        arena = HostArena(blocks * 2 + [s.local_numel for s in small] * 2, torch.float32)
        for s, n in zip(big, blocks):
            self.scales[s] = (arena.take(n), arena.take(n))
        for s in small:
            self.fp32_moments[s] = (arena.take(s.local_numel), arena.take(s.local_numel))
        zero = int(signed_code().abs().argmin())    # every moment starts at 0
        for u in self._units:          # (the unsigned code's 0 is its first: index 0)
            self.exp_avg[u].fill_(zero)
        self._arenas.append(arena)

    def state_buffers(self) -> list[torch.Tensor]:
        masters = list(self.master.values()) if self.master_store != torch.float32 else []
        pairs = [t for pair in (*self.scales.values(), *self.fp32_moments.values())
                 for t in pair]
        return masters + list(self.exp_avg.values()) + list(self.exp_avg_sq.values()) + pairs

    def kernel_options(self, slot) -> dict:
        """The stored form's keywords for ``adam_step``: block scales, the stream's seed."""
        options = {"seed": _stream_seed(self.seed, slot)}
        if slot in self.scales:
            options["exp_avg_scale"], options["exp_avg_sq_scale"] = self.scales[slot]
        if slot in self.fp32_moments:
            options["exp_avg"], options["exp_avg_sq"] = self.fp32_moments[slot]
        return options

    # -- set-up --------------------------------------------------------------------------
    def place_masters(self, unit, keep: bool) -> torch.Tensor:
        master = super().place_masters(unit, keep)
        if self.master_store != torch.float32:   # (the fp32 face stands in: see the note)
            for s in unit.slots:
                s.opt_param = stand_in(s.local_shape, torch.float32)
        return master

    def register_state(self, optimizer) -> None:
        trainable = [s for u in self._units for s in u.trainable]
        self._steps = HostArena([1] * (len(trainable) + 1), torch.float32)
        self._filler = self._steps.take(1)
        before = {}
        for s in trainable:
            before[s] = optimizer.state.get(s.opt_param, {})
            optimizer.state[s.opt_param] = {"step": self._steps.take(1).view(()),
                                            "exp_avg": stand_in(s.local_shape, torch.float32),
                                            "exp_avg_sq": stand_in(s.local_shape, torch.float32)}
        self._optimizer = optimizer
        if any(before.values()):          # state the optimizer had (e.g. loaded) moves in
            self.materialize(optimizer)
            for s, state in before.items():
                for k, v in state.items():
                    optimizer.state[s.opt_param][k].copy_(v)
            self.evict()

    # -- the fp32 face -------------------------------------------------------------------
    def materialize(self, optimizer) -> None:
        """Decode every unit's state into fp32 tensors and point the optimizer's at them."""
        if self.resident:
            return
        for u in self._units:
            flat = torch.zeros(3, u.shard_numel)
            if self.master_store != torch.float32:
                flat[0].copy_(self.master[u])
            for s in u.trainable:
                if s.local_numel:
                    s.shard_of(flat[1]).copy_(self._decode(s, u, 0))
                    s.shard_of(flat[2]).copy_(self._decode(s, u, 1))
            self.resident[u] = flat
        self._point(self.resident)

    def evict(self) -> None:
        """Encode the decoded state back (it may have been loaded into) and let it go."""
        if not self.resident:
            return
        for u, flat in self.resident.items():
            if self.master_store != torch.float32:
                self.master[u].copy_(flat[0])
            for s in u.trainable:
                if s.local_numel:
                    self._encode(s, u, 0, s.shard_of(flat[1]))
                    self._encode(s, u, 1, s.shard_of(flat[2]))
        self._point(None)
        self.resident = {}

    def _decode(self, slot, unit, which: int) -> torch.Tensor:
        if slot in self.fp32_moments:
            return self.fp32_moments[slot][which].view(slot.local_shape)
        stored = slot.shard_of((self.exp_avg, self.exp_avg_sq)[which][unit]).reshape(-1)
        if slot not in self.scales:
            return stored.float().view(slot.local_shape)
        flat = dequantize_blockwise(stored, self.scales[slot][which], signed=which == 0)
        return flat.view(slot.local_shape)

    def _encode(self, slot, unit, which: int, value: torch.Tensor) -> None:
        stored = slot.shard_of((self.exp_avg, self.exp_avg_sq)[which][unit])
        if slot in self.fp32_moments:
            stored = self.fp32_moments[slot][which].view(slot.local_shape)
        if slot not in self.scales:
            stored.copy_(value)
            return
        codes, scales = quantize_blockwise(value.reshape(-1), signed=which == 0)
        stored.view(-1).copy_(codes)
        self.scales[slot][which].copy_(scales)

    def _point(self, flats) -> None:
        optimizer = self._optimizer
        for u in self._units:
            for s in u.slots:
                views = [s.shard_of(f) for f in flats[u]] if flats else [None] * 3
                if self.master_store != torch.float32:
                    point_at(s.opt_param, views[0], s.local_shape, self._filler)
                state = optimizer.state.get(s.opt_param)
                if state:
                    point_at(state["exp_avg"], views[1], s.local_shape, self._filler)
                    point_at(state["exp_avg_sq"], views[2], s.local_shape, self._filler)

    # -- the step ------------------------------------------------------------------------
    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copied=None) -> None:
        self.evict()
        super().step(optimizer, grads, after_unit, grad_scale, copied)

    def recast(self) -> None:
        """Loaded fp32 state goes back to its stored form first."""
        self.evict()
        super().recast()


def _stream_seed(seed: int, slot) -> int:
    """One rounding stream per (seed, parameter, shard rank): replicas of a shard (HSDP)
    share it, and it does not depend on the parameter's place in the model's order."""
    key = (seed * 0x9E3779B97F4A7C15 + (zlib.crc32(slot.fqn.encode()) << 16) + slot.rank)
    return key & ((1 << 63) - 1)
