"""FSDP2 (``fully_shard``), the reference zerofn's layouts, checkpoints and mixed precision
are held to."""
from __future__ import annotations

import copy

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict


def fsdp2_full(model, opt):
    """Full tensors; copied, since torch's shares Adam's step counters with the optimizer."""
    return copy.deepcopy(get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
