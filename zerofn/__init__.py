"""zerofn: ZeRO as stateless, composable transforms over a plain nn.Module and optimizer.

    >>> zero3 = zerofn.compose(zerofn.shard_optimizer(), zerofn.shard_grads(),
    ...                        zerofn.shard_params())
    >>> model, opt = zero3(model, opt)
"""
from .checkpoint import (PerRank, ResumableLoader, RNGState, load_checkpoint, save_checkpoint,
                         trust_class, wait_for_checkpoint)
from .core.estimate import estimate_model_state_bytes
from .api import (Transform, compose, mixed_precision, offload, shard_grads, shard_optimizer,
                  shard_params, tensorboard)
from .observe.failures import RankFailure, name_uncaught_errors
from .observe.log import flush_logs, log, set_log_step
from .io.weights import full_weights
from .pretrained import load_pretrained, save_pretrained
from .runtime import (NonFiniteGradient, finish_collectives_at_exit, is_transformed,
                      return_large_frees, whole_tensors)
from .state.accounting import comm_stats, model_state_bytes
from .state.clip import clip_grad_norm_
from .state.loss_scale import scale_loss
from .state.state_dict import get_state_dict, set_state_dict

__all__ = [
    "Transform", "compose", "shard_optimizer", "shard_grads", "shard_params", "mixed_precision",
    "offload", "tensorboard", "log", "flush_logs", "set_log_step",
    "get_state_dict", "set_state_dict", "full_weights", "clip_grad_norm_", "scale_loss", "model_state_bytes",
    "comm_stats",
    "estimate_model_state_bytes", "save_checkpoint", "load_checkpoint", "wait_for_checkpoint",
    "trust_class",
    "PerRank", "RNGState", "ResumableLoader", "load_pretrained", "save_pretrained", "from_deepspeed_config",
    "RankFailure", "NonFiniteGradient", "is_transformed", "plan", "auto",
    "whole_tensors", "name_uncaught_errors", "return_large_frees", "finish_collectives_at_exit",
]

# The DeepSpeed adapter (config reader, engine, checkpoint converter) loads on first use of
# these names (PEP 562): most programs never need it.
# The planner (zf.plan, zf.auto) likewise: it loads torch's memory tracker.
_LAZY = ("deepspeed", "from_deepspeed_config", "plan", "auto")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in ("plan", "auto"):
        from .planner import search
        return getattr(search, name)
    from .deepspeed.config import from_deepspeed_config   # binds "deepspeed" here as well
    globals()["from_deepspeed_config"] = from_deepspeed_config
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
