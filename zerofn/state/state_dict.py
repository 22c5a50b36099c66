"""State dicts in the format of torch.distributed.checkpoint.state_dict for FSDP2 models.

Model state: the keys the model's own ``state_dict()`` gives, its hooks included (a fused
projection saved as several tensors, a renamed parameter: hooks.py), each parameter a
DTensor with ``Shard(0)`` (the torch.chunk row split) on the data-parallel mesh (HSDP:
``(Replicate(), Shard(0))`` on its 2-D mesh) or what a hook made of one, buffers plain
tensors. Optimizer state: parameter FQN -> {torch.optim's state names -> DTensor shards or
plain scalars} plus ``param_groups`` whose ``params`` are FQNs, whatever the model's hooks
do, as torch's ``get_optimizer_state_dict`` keys it. The sharded tensors are views of
zerofn's own buffers (but for what a hook made), so ``dcp.load`` writes straight into the
model and optimizer.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.units import ParamSlot
from ..runtime import chained, runtime_of
from ..runtime.agree import agree_or_raise
from ..runtime.optimizer import SCALER_KEY
from . import plain
from .hooks import module_state, take_state


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False,
                   device=None):
    """``(model_state_dict, optim_state_dict)``, sharded (default) or as full tensors.

    Call on every rank. ``full=True`` gathers plain full tensors on every rank: a
    snapshot, sharing no memory with the model or optimizer.

    [Note: where state dict tensors lie] Each tensor lies where zerofn keeps it: parameters
    and their optimizer state on the model's device, or on the host under offload (the
    masters and Adam's moments live there); buffers on the model's device; step counters
    where torch.optim keeps them. So under offload a full state dict mixes devices. Pass
    ``device`` (with ``full=True``) to have every parameter, buffer and per-parameter state
    tensor on one device, as to compare with a model of your own; scalar state (Adam's
    ``step``) stays where torch.optim wants it.

    Args:
        model, optimizer: what a zerofn transform returned (or, as ``zf.auto`` returns its
            stage 0, a DDP model or one on a single rank: torch's own state dict, plain
            replicated tensors, in the same names; plain.py).
        full: plain full tensors (a gather) rather than Shard(0) DTensors over zerofn's own
            buffers.
        device: where the full tensors go (None: where each lies).

    Example:
        >>> msd, osd = zf.get_state_dict(model, opt, full=True, device="cuda")
    """
    _check_device(full, device)
    if plain.plain_model(model) is not None:
        return plain.get_state_dict(model, optimizer, full, device)
    rt = runtime_of(model)
    model = rt.model     # (the module itself, where torch.compile wraps it)
    optimizer = _ready(rt, optimizer, read=True)
    return (get_model_state_dict(model, full=full, device=device),
            _optim_state(rt, optimizer, full, device))


def get_model_state_dict(model: nn.Module, *, full: bool = False, device=None) -> dict:
    """The model half of ``get_state_dict``; leaves the optimizer untouched.

    The model's own ``state_dict()`` makes it, its hooks included (hooks.py), over the
    masters: the keys are the ones the hooks give, the values never the compute copies.
    """
    _check_device(full, device)
    if plain.plain_model(model) is not None:
        return plain.get_model_state_dict(model, full, device)
    rt = runtime_of(model)
    model = rt.model     # (the module itself, where torch.compile wraps it)
    rt.prepare_state_dict()
    if full:
        msd = module_state(rt, model, lambda s: rt.full_tensor(s, rt.master_rows(s), device))
        live = {b.untyped_storage().data_ptr() for b in model.buffers()}
        return {k: _owned(v, live, device) for k, v in msd.items()}
    return module_state(rt, model, lambda s: _export(rt, s, rt.master_rows(s), False))


def unread_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict``'s sharded dicts with the state a home keeps out of memory (a file,
    fewer bits) left there: those tensors are stand-ins of one element, which a save
    replaces and reads a unit at a time (io/checkpoint/streamed.py). A zerofn model only."""
    rt = runtime_of(model)
    optimizer = _ready(rt, optimizer, read=False)
    msd = module_state(rt, rt.model, lambda s: _export(rt, s, rt.master_rows(s), False))
    return msd, _optim_state(rt, optimizer, False)


def _check_device(full: bool, device) -> None:
    if device is not None and not full:
        raise ValueError("device= places a full state dict's tensors; a sharded one is made "
                         "of zerofn's own buffers where they lie. Pass full=True with device=, "
                         "or leave device out.")


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_state_dict: dict,
                   optim_state_dict: dict) -> None:
    """Load state in ``get_state_dict``'s format (sharded DTensors of any world size, or
    full tensors) into a zerofn model and optimizer. Call on every rank."""
    if plain.plain_model(model) is not None:
        return plain.set_state_dict(model, optimizer, model_state_dict, optim_state_dict)
    rt = runtime_of(model)
    model = rt.model     # (the module itself, where torch.compile wraps it)
    optimizer = _check_optimizer(rt, optimizer)
    rt.spread_owned_state()
    set_model_state_dict(model, model_state_dict)
    _load_optim_state(rt, optimizer, optim_state_dict)


def set_model_state_dict(model: nn.Module, model_state_dict: dict) -> None:
    """The model half of ``set_state_dict``; leaves the optimizer untouched.

    The model's own ``load_state_dict()`` reads it, its hooks included (hooks.py): a hook
    may merge or rename keys. Nothing is written unless every rank's state dict fits.
    """
    if plain.plain_model(model) is not None:
        return plain.set_model_state_dict(model, model_state_dict)
    rt = runtime_of(model)
    model = rt.model     # (the module itself, where torch.compile wraps it)
    rt.prepare_state_dict()
    try:
        taken, problems = take_state(rt, model, model_state_dict), []
    except Exception as e:  # a misfit on one rank must not leave the others in refresh_params
        taken, problems = None, [f"{type(e).__name__}: {e}"]
    agree_or_raise(problems, rt.group, "The model state dict does not fit this model")
    with torch.no_grad():
        for buffer, value in taken.buffers:
            buffer.copy_(_full_value(value))
        for slot, value in taken.params:   # this rank's rows of the master
            rt.write_master_rows(slot, _local_value(rt, slot, value))
    rt.refresh_params()   # the compute parameters from the masters


# -- conversions -------------------------------------------------------------------------
def _export(rt, slot: ParamSlot, local: torch.Tensor, full: bool, device=None):
    """A full tensor on ``device`` or where the caller keeps ``local`` (host under
    offload), or the Shard(0) DTensor over ``local`` itself: no copy, so DCP writes and
    loads zerofn's own buffers."""
    if full:
        return rt.full_tensor(slot, local, device)
    return slot.as_dtensor(local, rt.mesh, rt.placements)


def _snapshot(value, full: bool, device=None):
    """A full state dict is a snapshot: copy the tensors it would otherwise share with the
    live model (buffers, Adam's step counters), which training goes on changing in place."""
    if not (full and torch.is_tensor(value)):
        return value
    return value.to(device, copy=True) if device is not None else value.clone()


def _owned(value, live: set, device=None):
    """A full state dict's ``value`` on ``device``, copied if it shares memory with a live
    buffer (``live``: their storages), which training goes on changing in place."""
    if not torch.is_tensor(value):
        return value
    if value.untyped_storage().data_ptr() in live:
        return _snapshot(value, True, device)
    return value if device is None else value.to(device)


def _full_value(value, shape=None, name=""):
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if shape is not None and value.shape != shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} differs from the "
                         f"model's {tuple(shape)}.")
    return value


def _local_value(rt, slot: ParamSlot, value) -> torch.Tensor:
    """This rank's rows of ``value``, without a gather when it is already sharded our way."""
    mesh, placements = slot.layout(rt.mesh, rt.placements)
    if isinstance(value, DTensor) and value.shape == slot.global_shape \
            and tuple(value.placements) == placements \
            and tuple(value.device_mesh.shape) == tuple(mesh.shape):
        return value.to_local()
    return slot.rows_of(slot.piece_of(_full_value(value, slot.global_shape, slot.fqn)))


def _ready(rt, optimizer, read: bool):
    """Before a state dict: the optimizer bound (``_check_optimizer``), the state made
    current (``read``: offloaded state read into memory too), its state made where none
    is yet, and owned state spread as rows. Returns the optimizer."""
    optimizer = _check_optimizer(rt, optimizer)
    rt.prepare_state_dict(read=read)
    rt.init_optimizer_state()
    rt.spread_owned_state()
    return optimizer


def _check_optimizer(rt, optimizer):
    """The optimizer that steps the model (several given as a sequence: their chain, as
    the transform bound them): bound now where none is yet (an optimizer built after the
    transform), refused where another one steps it. Collective. Returns it."""
    optimizer = chained(optimizer, rt.optimizer)
    rt.bind(optimizer)
    return optimizer


def _is_sharded_state(master: torch.Tensor, value) -> bool:
    """Whether ``value`` (a state tensor of the optimizer's ``master``) has its rows."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape \
        and not isinstance(value, DTensor)


def _optim_state(rt, optimizer, full: bool, device=None) -> dict:
    slot_of_opt = rt.slot_of_stepped()
    state, groups = {}, []
    for group, fqns in zip(optimizer.param_groups, rt.group_names(optimizer)):
        for p in group["params"]:
            slot = slot_of_opt[p]
            if p in optimizer.state:
                state[slot.fqn] = {k: _export(rt, slot, v, full, device)
                                   if _is_sharded_state(p, v) else _snapshot(v, full)
                                   for k, v in optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    out = {"state": state, "param_groups": groups}
    if rt.scaler is not None:    # fp16 loss scaling: scale and counters ride along
        out[SCALER_KEY] = rt.scaler.state_dict()
    return out


def _load_optim_state(rt, optimizer, osd: dict) -> None:
    groups = osd.get("param_groups")
    if groups is None or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state dict has {len(groups or [])} param groups, the "
                         f"optimizer {len(optimizer.param_groups)}.")
    if rt.scaler is not None and SCALER_KEY in osd:
        rt.scaler.load_state_dict(osd[SCALER_KEY])
    slot_of_opt = rt.slot_of_stepped()
    loaded = set()
    with torch.no_grad():
        for group, saved, names in zip(optimizer.param_groups, groups,
                                       rt.group_names(optimizer)):
            # Compared as sets: FSDP2 lists a group's params in its own registration order.
            fqns = set(names)
            if set(saved["params"]) != fqns:
                raise ValueError(
                    f"optimizer param group differs from the checkpoint's: only here "
                    f"{sorted(fqns - set(saved['params']))}, only in the checkpoint "
                    f"{sorted(set(saved['params']) - fqns)}.")
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p in group["params"]:
                slot = slot_of_opt[p]
                if slot.fqn in osd["state"]:
                    optimizer.state[p] = _load_param_state(rt, slot, optimizer.state.get(p, {}),
                                                           osd["state"][slot.fqn])
                    loaded.add(p)
    rt.forget_made_state(loaded)


def _load_param_state(rt, slot: ParamSlot, current: dict, saved: dict) -> dict:
    out = {}
    for k, v in saved.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape == slot.global_shape:
            local = _local_value(rt, slot, v)
            if k in current and current[k].shape == local.shape:
                out[k] = current[k].copy_(local)
            else:
                out[k] = local.clone()
        elif torch.is_tensor(v):
            out[k] = current[k].copy_(v) if k in current and torch.is_tensor(current[k]) \
                and current[k].shape == v.shape else v.clone()
        else:
            out[k] = v
    return out
