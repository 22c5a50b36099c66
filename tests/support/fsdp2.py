"""The parity model under FSDP2 (``fully_shard``): the reference zerofn's layouts,
checkpoints and mixed precision are held to."""
from __future__ import annotations

import copy

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from .models import make_models, make_optimizer


def fsdp2_parity(mesh, seed: int = 0, policy=None, frozen: bool = True):
    """The parity model (the second of ``make_models(seed)``) under FSDP2 on ``mesh`` (1-D,
    or 2-D for HSDP), each block and then the root, with MixedPrecisionPolicy ``policy``
    (None: FSDP2's default); and its AdamW."""
    _, model = make_models(seed=seed, frozen=frozen)
    mp = {} if policy is None else {"mp_policy": policy}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model, make_optimizer("adamw", model.parameters())


def fsdp2_full(model, opt):
    """Full tensors; copied, since torch's shares Adam's step counters with the optimizer."""
    return copy.deepcopy(get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
