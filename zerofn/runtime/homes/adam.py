"""The host step: zerofn's CPU Adam over a unit's rows of flat master and state buffers,
parameter by parameter, with each parameter's group hyperparameters and own step count."""
from __future__ import annotations

import torch

from ...optim import adam_step
from ..timing import UNTIMED
from ...core.units import Unit


def groups_by_param(optimizer) -> dict:
    return {p: g for g in optimizer.param_groups for p in g["params"]}


def adam_unit(optimizer, group_of: dict, unit: Unit, grads: dict, master, exp_avg, exp_avg_sq,
              adamw_mode: bool, lowp=None, grad_scale: float = 1.0, timing=UNTIMED,
              options=None, torch_math: bool = False, *, table) -> list:
    """zerofn's CPU Adam over each of the unit's parameters that has a gradient, on the
    rows of flat master and state buffers, with that parameter's group hyperparameters
    and its own step count (as torch.optim keeps them); each gradient times
    ``grad_scale`` as it is read. Returns the slots whose rows it wrote (into ``lowp``
    too, in its dtype, where given). ``options(slot)``, where given, adds the kernel's
    keywords for state stored in fewer bits (scales, the rounding seed). ``torch_math``:
    in torch's arithmetic, not the kernel's (which differs from it in the last bit), as
    beside a whole-tensor optimizer: Muon's bf16 Newton-Schulz magnifies any difference in
    the parameters AdamW steps (nvme.py). ``table``: the runtime's parameter state, whose
    ``opt_param`` the optimizer keys each slot's group and state on (param_table.py)."""
    with timing.span("cpu_adam", "cpu_adam", unit.name):   # profiles show it against copies
        return _adam_slots(optimizer, group_of, unit, grads, master, exp_avg, exp_avg_sq,
                           adamw_mode, lowp, grad_scale, options, torch_math, table)


def _adam_slots(optimizer, group_of, unit, grads, master, exp_avg, exp_avg_sq, adamw_mode,
                lowp, grad_scale, options, torch_math, table) -> list:
    written = []
    for s in unit.trainable:
        g, group = grads.get(s), group_of.get(table[s].opt_param)
        if g is None or group is None:
            continue
        state = optimizer.state[table[s].opt_param]
        # Counted where this rank holds no rows too, as torch.optim counts an empty
        # parameter's steps: every rank's count, and every checkpoint's, is the same.
        state["step"] += 1
        if not s.local_numel:
            continue
        written.append(s)
        # The C++ kernel steps host rows (bf16 masters the user chose round stochastically
        # in it); a bf16 model's own masters, and ``torch_math``'s, step as torch.optim
        # steps them.
        kernel = adam_step if not torch_math and (master.dtype == torch.float32 or options) \
            else _torch_adam_step
        beta1, beta2 = group["betas"]
        extra = options(s) if options else {}     # (may name the slot's own moments)
        m = extra.pop("exp_avg", None)
        v = extra.pop("exp_avg_sq", None)
        kernel(s.shard_of(master).view(-1), g.reshape(-1),
               s.shard_of(exp_avg).view(-1) if m is None else m,
               s.shard_of(exp_avg_sq).view(-1) if v is None else v,
               step=int(state["step"]), lr=float(group["lr"]),
               beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
               adamw_mode=adamw_mode, grad_scale=grad_scale,
               out=None if lowp is None else s.shard_of(lowp).view(-1), **extra)
    return written


def cast_the_rest(rows: torch.Tensor, master: torch.Tensor, written: list) -> None:
    """Cast ``master`` into ``rows`` (flat, of one unit) outside the ``written`` slots: the
    rows the kernel did not write are the masters' current values too."""
    at = 0
    for start, end in sorted((s.offset, s.offset + s.local_numel) for s in written) + \
            [(rows.numel(), rows.numel())]:
        if start > at:
            rows[at:start].copy_(master[at:start])
        at = max(at, end)


@torch.no_grad()
def _torch_adam_step(params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                     grad_scale: float = 1.0, out=None) -> None:
    """``adam_step`` for masters the C++ kernel does not take (fp64, or bf16 without mixed
    precision): torch.optim's single-tensor Adam/AdamW (what it runs on CPU tensors),
    in the masters' dtype."""
    g = grads.to(params.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw_mode:
            params.mul_(1 - lr * weight_decay)
        else:
            g = g.add(params, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    if out is not None:
        out.copy_(params)
