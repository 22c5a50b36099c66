"""The line a runtime logs at set-up (logger ``zerofn``, rank 0): the plan as it was laid
out, its dtypes included, so a run says what it trains with before it trains."""
from __future__ import annotations

import logging

import torch

from ..core.plan import HOMES

log = logging.getLogger("zerofn")


def _name(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _dtypes(units, field: str) -> str:
    return "/".join(sorted({_name(getattr(u, field)) for u in units if u.slots}))


def _homes(rt) -> str:
    """Where the units' state lives: "on the device", "on the host", or a count per home
    ("2 units on the device, 5 on the host, 3 in nvme")."""
    count = {home: 0 for home in HOMES}
    for u in rt.units:
        if u.slots:
            count[rt.home_of(u)] += 1
    count = {home: n for home, n in count.items() if n}
    if len(count) == 1:
        return {"device": "on the device", "host": "offloaded to cpu",
                "nvme": "offloaded to nvme"}[next(iter(count))]
    return "in homes: " + ", ".join(f"{n} on the {h}" if h != "nvme" else f"{n} in nvme"
                                    for h, n in count.items())


def plan_line(rt) -> str:
    """``ZeRO-3 over 2 ranks: 5 units, compute bf16, masters and optimizer state fp32, ...``"""
    units = rt.units
    policy = rt.plan.offload
    where = _homes(rt) + (" (parameters too)" if policy.params else "")
    stored = [f"{k} stored as {_name(v)}" for k, v in (("masters", policy.master_dtype),
                                                         ("moments", policy.state_dtype))
              if policy.device is not None and v != torch.float32]
    n = sum(1 for u in units if u.slots)
    return (f"ZeRO-{rt.plan.stage} over {rt.world} rank{'s' * (rt.world != 1)}: "
            f"{n} unit{'s' * (n != 1)}, compute {_dtypes(units, 'compute_dtype')}, "
            f"masters and optimizer state {_dtypes(units, 'master_dtype')} {where}"
            + "".join(f", {s}" for s in stored))


def announce(rt, global_rank: int) -> None:
    """Log the plan on global rank 0: INFO, or WARNING where the masters are narrower than
    fp32 without mixed precision asking for it (a bf16 model keeps torch.optim's bf16
    state, which a user who expected fp32 masters must hear of)."""
    if global_rank != 0:
        return
    narrow = [u.master_dtype for u in rt.units if u.slots
              and u.master_dtype in (torch.bfloat16, torch.float16)]
    if rt.plan.precision.param_dtype is None and narrow:
        log.warning("zerofn: %s. The model's parameters are %s and no mixed_precision was "
                    "applied, so the masters and Adam's moments keep that dtype, as "
                    "torch.optim would; add zf.mixed_precision(%s) for fp32 masters and "
                    "state.", plan_line(rt), _dtypes(rt.units, "dtype"), narrow[0])
    else:
        log.info("zerofn: %s.", plan_line(rt))
