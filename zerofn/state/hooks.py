"""A module's own ``state_dict()`` and ``load_state_dict()``, every hook they run included,
over zerofn's tensors rather than the compute parameters.

[Note: the module's own machinery] A module may reshape its state dict: hooks
(``register_state_dict_pre_hook``, ``register_state_dict_post_hook`` and the private
``_register_state_dict_hook``; ``register_load_state_dict_pre_hook``,
``_register_load_state_dict_pre_hook`` and ``register_load_state_dict_post_hook``) or an
override of ``_save_to_state_dict`` / ``_load_from_state_dict``. torchtitan's fused QKV
projection saves its ``wqkv`` as ``wq``/``wk``/``wv`` and merges them back on load; a
renamed parameter accepts its old name. Rather than re-implement each kind, zerofn lends
every parameter registration one of its own tensors for the length of one call of torch's
machinery, then puts the registrations back:

- to save, the masters: this rank's rows as ``Shard(0)`` DTensors (as FSDP2 registers
  its parameters, so a hook that splits or concatenates one along dim 0 works as it does
  under FSDP2), or full tensors for a full state dict;
- to load, placeholders (the masters' DTensors) that ``load_state_dict(assign=True)``
  replaces with what the hooks hand it; they are read back before the registrations are
  restored, and only then does anything reach the masters.

So the hooks' keys are the state dict's keys, and no hook sees a compute copy.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.units import ParamSlot

_SAVE_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks")
_LOAD_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def module_state(rt, module: nn.Module, param_value, prefix: str = "") -> dict:
    """``module.state_dict(prefix=prefix)`` with each parameter of it ``param_value(slot)``
    (called once per parameter, in the runtime's slot order on every rank, so it may
    gather); buffers are the live ones, as torch gives them."""
    with _lent(rt, module, param_value):
        return module.state_dict(prefix=prefix)


@dataclass
class Taken:
    """What ``load_state_dict`` would give a module's registrations, and the keys it found
    missing or unexpected (after the hooks, which may rename or merge them)."""

    params: list = field(default_factory=list)     # (ParamSlot, value), registration order
    buffers: list = field(default_factory=list)    # (live buffer, value)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)


def take_state(rt, module: nn.Module, state_dict: dict, strict: bool = True) -> Taken:
    """Run ``module.load_state_dict(state_dict, strict=strict)`` without changing
    ``module``: return what each registration would be given. Raises what torch raises
    (a size mismatch; with ``strict``, missing or unexpected keys)."""
    # A Parameter, so that assign=True hands the registration a Parameter in turn.
    master = (lambda s: nn.Parameter(s.as_dtensor(rt.master_rows(s), rt.mesh, rt.placements),
                                     requires_grad=False))
    # torch.__future__'s swap would swap a placeholder's contents rather than replace it,
    # and the value given could not be told from the placeholder.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        with _lent(rt, module, master) as lent:
            keys = module.load_state_dict(state_dict, strict=strict, assign=True)
            taken = lent.taken()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    taken.missing, taken.unexpected = list(keys.missing_keys), list(keys.unexpected_keys)
    return taken


def hooked_modules(model: nn.Module, load: bool) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose state dict their own code shapes (``load``: on load,
    else on save), by name: a module registered under two names comes once per name."""
    hooks, method = (_LOAD_HOOKS, "_load_from_state_dict") if load \
        else (_SAVE_HOOKS, "_save_to_state_dict")
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        own = any(getattr(m, h) for h in hooks) or \
            getattr(type(m), method) is not getattr(nn.Module, method)
        if own and not any(within(name, outer) for outer, _ in out):
            out.append((name, m))
    return out


def plain_keys(model: nn.Module) -> list[str]:
    """The keys ``model.state_dict()`` gives where no hook or override changes them, in its
    order, without running it: each parameter and persistent buffer under every name."""
    out = []
    for prefix, m in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out += [dot + n for n, p in m._parameters.items() if p is not None]
        out += [dot + n for n, b in m._buffers.items()
                if b is not None and n not in m._non_persistent_buffers_set]
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds, by name, each once (as ``named_buffers`` gives
    them), without running ``state_dict()`` and its hooks."""
    out, seen = {}, set()
    for prefix, m in model.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out[f"{prefix}.{n}" if prefix else n] = b
    return out


def within(name: str, prefix: str) -> bool:
    """Whether the state-dict key or module name ``name`` lies under the module ``prefix``
    ("" being the root)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


class _Lent:
    """The registrations lent out: what they held, and what was put there."""

    def __init__(self):
        self.params: list[tuple[ParamSlot, dict, str, torch.Tensor]] = []
        self.buffers: list[tuple[dict, str, torch.Tensor]] = []

    def taken(self) -> Taken:
        """The values a load put in place of what was lent (assign=True replaces them)."""
        out = Taken()
        for slot, table, name, lent in self.params:
            if table[name] is not lent:
                out.params.append((slot, table[name]))
        for table, name, live in self.buffers:
            if table[name] is not live:
                out.buffers.append((live, table[name]))
        return out


@contextlib.contextmanager
def _lent(rt, module: nn.Module, param_value):
    modules = set(module.modules())
    held = [(m, table, dict(table)) for m in modules for table in (m._parameters, m._buffers)]
    lent = _Lent()
    try:
        for slot in rt.slot_of.values():    # the same order on every rank
            owners = [(m, n) for m, n in slot.owners if m in modules]
            if owners:
                value = param_value(slot)
                for m, n in owners:
                    m._parameters[n] = value
                    lent.params.append((slot, m._parameters, n, value))
        for m in modules:
            for n, buf in m._buffers.items():
                if buf is not None:
                    lent.buffers.append((m._buffers, n, buf))
        yield lent
    finally:
        for _, table, before in held:
            table.clear()
            table.update(before)
