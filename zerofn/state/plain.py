"""Models no transform sharded, as ``zf.auto`` hands back its stage 0: DDP over the world,
or the model itself on a single rank. zerofn's state functions (state dicts, checkpoints,
clipping, loss scaling) serve them through torch's own helpers, in the format they give
sharded models (parameter names, optimizer state by name), so one loop and one checkpoint
serve every stage: a checkpoint of either loads into the other."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state

from ..runtime import is_transformed


def plain_model(model) -> nn.Module | None:
    """``model`` where zerofn's functions serve it without a runtime (DDP's wrapper, or a
    model on a single rank of an initialized process group), else None: a transformed model
    has a runtime, and any other model is one zerofn does not know how to save whole."""
    if not isinstance(model, nn.Module) or is_transformed(model):
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    if isinstance(model, nn.parallel.DistributedDataParallel) or dist.get_world_size() == 1:
        return model
    return None


def group_of(model) -> dist.ProcessGroup:
    """Every rank that holds the plain model: DDP's group, else the world."""
    return getattr(model, "process_group", None) or dist.group.WORLD


def _options(full: bool) -> dcp_state.StateDictOptions:
    return dcp_state.StateDictOptions(full_state_dict=full)


def _placed(sd: dict, device) -> dict:
    """``sd``'s tensors on ``device`` (None: where they are), nested dicts followed."""
    if device is None:
        return sd
    return {k: _placed(v, device) if isinstance(v, dict)
            else v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in sd.items()}


def get_state_dict(model, optimizer, full: bool, device) -> tuple[dict, dict]:
    msd, osd = dcp_state.get_state_dict(model, optimizer, options=_options(full))
    return _placed(msd, device), _placed(osd, device)


def get_model_state_dict(model, full: bool, device) -> dict:
    return _placed(dcp_state.get_model_state_dict(model, options=_options(full)), device)


def set_state_dict(model, optimizer, msd: dict, osd: dict) -> None:
    dcp_state.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def set_model_state_dict(model, msd: dict) -> None:
    dcp_state.set_model_state_dict(model, msd)


def clip_grad_norm_(model, max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
    """DDP's gradients are the same on every rank once reduced: torch's own clip."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type,
                                          error_if_nonfinite)
