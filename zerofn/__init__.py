"""zerofn: ZeRO as stateless, composable transforms over a plain nn.Module and optimizer.

    >>> zero3 = zerofn.compose(zerofn.shard_optimizer(), zerofn.shard_grads(),
    ...                        zerofn.shard_params())
    >>> model, opt = zero3(model, opt)
"""
from .accounting import comm_stats, model_state_bytes
from .checkpoint import PerRank, RNGState, load_checkpoint, save_checkpoint, wait_for_checkpoint
from .clip import clip_grad_norm_
from .deepspeed.config import from_deepspeed_config
from .estimate import estimate_model_state_bytes
from .failures import RankFailure
from .monitor import flush_logs, log, set_log_step
from .pretrained import load_pretrained, save_pretrained
from .state_dict import get_state_dict, set_state_dict
from .transforms import (Transform, compose, mixed_precision, offload, shard_grads,
                         shard_optimizer, shard_params, tensorboard)

__all__ = [
    "Transform", "compose", "shard_optimizer", "shard_grads", "shard_params", "mixed_precision",
    "offload", "tensorboard", "log", "flush_logs", "set_log_step",
    "get_state_dict", "set_state_dict", "clip_grad_norm_", "model_state_bytes", "comm_stats",
    "estimate_model_state_bytes", "save_checkpoint", "load_checkpoint", "wait_for_checkpoint",
    "PerRank", "RNGState", "load_pretrained", "save_pretrained", "from_deepspeed_config",
    "RankFailure",
]
