"""Masters and Adam's moments stored in fewer bits (offload's ``state_dtype`` and
``master_dtype``): the parts of one unit's stored state, and the codec between them and
the fp32 the optimizer shows. The host offload (host_lowp.py) keeps them in arenas, the
NVMe offload (nvme.py) in its swap file's blocks; both step and decode them alike.

A unit's stored state: its masters (fp32 or bf16), both moments (fp32, bf16, or uint8
codes of the 8-bit maps), and fp32 extras: under int8 each parameter's block scales, or,
for a parameter under 4096 elements, its fp32 moments (zerofn.optim.lowp.MIN_8BIT_NUMEL).

Decoding and encoding back is exact (zerofn/optim/lowp.py says why), so state dicts,
which decode, change nothing they do not load.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from ...optim import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise, signed_code
from ...optim.lowp import moment_dtype

_SLICE = 1024 * QUANT_BLOCK     # elements decoded at a time (a whole number of blocks)


@dataclass
class UnitState:
    """Views of one unit's stored state: flat masters and moments, and per slot the
    extras (``scales``: int8's block scales; ``fp32``: a small parameter's moments)."""
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    scales: dict = field(default_factory=dict)
    fp32: dict = field(default_factory=dict)


class StoredForm:
    """How masters and moments are stored, and the codec to fp32."""

    def __init__(self, state_dtype=torch.float32, master_dtype=torch.float32, seed: int = 0):
        self.state_dtype, self.master_dtype, self.seed = state_dtype, master_dtype, seed
        self.moments_dtype = torch.uint8 if state_dtype == torch.int8 else state_dtype
        self.lowp = (state_dtype, master_dtype) != (torch.float32, torch.float32)
        # Where each part starts: on a cache line for the vector kernels; fp32 parts
        # follow each other, master | exp_avg | exp_avg_sq as one (3, shard) tensor.
        self.align = 64 if self.lowp else 4
        self._seeds: dict = {}                   # slot -> its rounding stream's seed

    def exact_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """``(masters, moments)`` in the narrowest dtypes that hold them exactly: bf16 where
        stored in bf16; 8-bit moments decode to fp32 values (a code times its scale)."""
        return self.master_dtype, torch.bfloat16 if self.state_dtype == torch.bfloat16 \
            else torch.float32

    # -- layout --------------------------------------------------------------------------
    def _extras(self, unit) -> list[tuple]:
        """``(slot, "scales" | "fp32", numel)`` of each slot with extras, in order."""
        if self.state_dtype != torch.int8:
            return []
        return [(s, "fp32", s.local_numel) if moment_dtype(torch.int8, s.numel) == torch.float32
                else (s, "scales", -(-s.local_numel // QUANT_BLOCK)) for s in unit.slots]

    def extras_numel(self, unit) -> int:
        return 2 * sum(n for _, _, n in self._extras(unit))

    def parts(self, unit) -> list[tuple[torch.dtype, int]]:
        """``(dtype, numel)`` of masters, exp_avg, exp_avg_sq and the fp32 extras."""
        n, master, moments = unit.shard_numel, self.master_dtype_of(unit), self.moments_dtype
        if not self.lowp:
            moments = master
        return [(master, n), (moments, n), (moments, n), (torch.float32, self.extras_numel(unit))]

    def master_dtype_of(self, unit) -> torch.dtype:
        """Full precision is the unit's master dtype: fp32 under mixed precision, else the
        parameters' own (a bf16 model trained without mixed precision keeps bf16 masters
        and Adam state, as torch.optim does; fewer bits are for fp32 masters only)."""
        if self.lowp:
            return self.master_dtype
        return unit.master_dtype or torch.float32

    def state_bytes(self, unit) -> int:
        return sum(self._aligned(n * dtype.itemsize) for dtype, n in self.parts(unit))

    def views(self, unit, buf: torch.Tensor) -> UnitState:
        """The parts as views of ``buf`` (contiguous, at least ``state_bytes`` long)."""
        raw, at, out = buf.view(torch.uint8), 0, []
        for dtype, n in self.parts(unit):
            out.append(raw[at:at + n * dtype.itemsize].view(dtype))
            at += self._aligned(n * dtype.itemsize)
        return self.unit_state(unit, *out)

    def unit_state(self, unit, master, exp_avg, exp_avg_sq, extras) -> UnitState:
        """The state of ``unit`` over the given parts (its extras carved from ``extras``)."""
        st, at = UnitState(master, exp_avg, exp_avg_sq), 0
        for slot, kind, n in self._extras(unit):
            getattr(st, kind)[slot] = (extras[at:at + n], extras[at + n:at + 2 * n])
            at += 2 * n
        return st

    def zero(self, st: UnitState) -> None:
        """Moments at 0 (in 8-bit codes, the code of 0: the unsigned code's is its first)."""
        st.exp_avg.fill_(int(signed_code().abs().argmin()) if self.state_dtype == torch.int8
                         else 0)
        st.exp_avg_sq.zero_()
        for pair in (*st.scales.values(), *st.fp32.values()):
            for t in pair:
                t.zero_()

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    # -- the step ------------------------------------------------------------------------
    def kernel_options(self, st: UnitState, slot) -> dict:
        """``adam_step``'s keywords for ``slot``: block scales, a small parameter's own fp32
        moments, the rounding stream's seed."""
        if slot not in self._seeds:          # (a hash of the name: once, not every step)
            self._seeds[slot] = stream_seed(self.seed, slot)
        options = {"seed": self._seeds[slot]}
        if slot in st.scales:
            options["exp_avg_scale"], options["exp_avg_sq_scale"] = st.scales[slot]
        if slot in st.fp32:
            options["exp_avg"], options["exp_avg_sq"] = st.fp32[slot]
        return options

    # -- the codec -----------------------------------------------------------------------
    def decode(self, unit, st: UnitState, flat: torch.Tensor, masters: bool) -> None:
        """fp32 masters (where ``masters``) and moments of ``unit`` into ``flat`` (3, shard).
        (The host shows fp32 masters as they are, so it leaves them out.)"""
        if masters:
            flat[0].copy_(st.master)
        for s in unit.trainable:
            if s.local_numel:
                for which in (0, 1):
                    self._decode_into(s, st, which, s.shard_of(flat[1 + which]).view(-1))

    def encode(self, unit, st: UnitState, flat: torch.Tensor, masters: bool) -> None:
        """The stored form of ``flat`` (3, shard), as ``decode`` left it or a load wrote it."""
        if masters:
            st.master.copy_(flat[0])
        for s in unit.trainable:
            if s.local_numel:
                for which in (0, 1):
                    self._encode(s, st, which, s.shard_of(flat[1 + which]).reshape(-1))

    def _decode_into(self, slot, st: UnitState, which: int, out: torch.Tensor) -> None:
        """``slot``'s moment ``which`` in fp32 into ``out`` (flat), int8 codes ``_SLICE``
        elements at a time: decoding a whole slot at once took 16 bytes an element of scratch (int64
        codes, the spread scales, the product), which glibc's heap kept after a save's
        read (docs/checkpoints.md, "One tensor's copy at a time")."""
        if slot in st.fp32:
            out.copy_(st.fp32[slot][which].reshape(-1))
            return
        stored = slot.shard_of((st.exp_avg, st.exp_avg_sq)[which]).reshape(-1)
        if slot not in st.scales:          # (bf16: copy_ widens exactly, with no scratch)
            out.copy_(stored)
            return
        for start in range(0, stored.numel(), _SLICE):
            end = min(start + _SLICE, stored.numel())
            scales = st.scales[slot][which][start // QUANT_BLOCK:-(-end // QUANT_BLOCK)]
            out[start:end].copy_(dequantize_blockwise(stored[start:end], scales,
                                                      signed=which == 0))

    def _encode(self, slot, st: UnitState, which: int, value: torch.Tensor) -> None:
        if slot in st.fp32:
            st.fp32[slot][which].copy_(value)
            return
        stored = slot.shard_of((st.exp_avg, st.exp_avg_sq)[which]).reshape(-1)
        if slot not in st.scales:
            stored.copy_(value)
            return
        codes, scales = quantize_blockwise(value, signed=which == 0)
        stored.copy_(codes)
        st.scales[slot][which].copy_(scales)


def stream_seed(seed: int, slot) -> int:
    """One rounding stream per (seed, parameter, shard rank): replicas of a shard (HSDP)
    share it, and it does not depend on the parameter's place in the model's order."""
    key = (seed * 0x9E3779B97F4A7C15 + (zlib.crc32(slot.fqn.encode()) << 16) + slot.rank)
    return key & ((1 << 63) - 1)
