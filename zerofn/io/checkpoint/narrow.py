"""State that offload stores in bf16 goes into a checkpoint in bf16.

``offload(state_dtype=torch.bfloat16)`` and ``master_dtype=torch.bfloat16`` keep Adam's
moments and the masters in bf16; state dicts show them in fp32 (every bf16 value is one),
and a checkpoint written from those would hold twice the bytes it needs. So the save
casts them back to bf16, which loses nothing, and a load reads them into whatever the
reader's tensors are (DCP casts on load, exactly from bf16 to fp32): an fp32 run, FSDP2,
or another stored form. 8-bit moments stay fp32: a code times its block's scale is an
fp32 value that bf16 would round, and blocks do not survive resharding, so codes cannot
be saved either; fp32 is what every reader and every world size takes exactly.
"""
from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def narrowed(rt, msd: dict, osd: dict) -> None:
    """Cast, in ``msd`` and ``osd`` (state dicts of ``rt``'s model and optimizer), the
    masters and moments ``rt``'s homes store in bf16 to bf16."""
    names: dict = {}
    for name, slot in rt.slots_by_name().items():
        names.setdefault(slot, []).append(name)
    state = osd.get("state", {})
    for unit in rt.units:
        master, moments = rt.exact_dtypes(unit)
        for slot in unit.slots:
            for name in names.get(slot, ()):
                _narrow(msd, name, master)
                for key in MOMENTS:
                    _narrow(state.get(name, {}), key, moments)


def saved_dtype(shown: torch.dtype, exact: torch.dtype) -> torch.dtype:
    """What a checkpoint holds of state shown in ``shown`` and held exactly in ``exact``."""
    return exact if shown == torch.float32 and exact == torch.bfloat16 else shown


def _narrow(table: dict, key: str, dtype: torch.dtype) -> None:
    t = table.get(key)
    if t is not None and saved_dtype(t.dtype, dtype) != t.dtype:
        table[key] = t.to(dtype)
