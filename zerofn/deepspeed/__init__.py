"""DeepSpeed's front door on zerofn: its config files, ``initialize`` and checkpoints.

A DeepSpeed script runs on zerofn with one changed line::

    import zerofn.deepspeed as deepspeed     # was: import deepspeed

``initialize`` returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed's
does; ``from_deepspeed_config`` reads a ``ds_config.json`` into a zerofn transform for
those who keep their own loop. See docs/deepspeed.md.
"""
import importlib

#: ``torch.distributed`` itself, standing in for DeepSpeed's ``deepspeed.comm``.
from torch import distributed as comm

from . import checkpointing, utils
from .config import DeepSpeedConfigWarning, DeepSpeedSettings, from_deepspeed_config

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
           "from_deepspeed_config", "DeepSpeedSettings", "DeepSpeedConfigWarning",
           "checkpointing", "comm", "utils"]

# The engine loads on first use of its names (PEP 562): reading a config, activation
# checkpointing and the checkpoint converter never need it.
_FROM_ENGINE = ("initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine")


def __getattr__(name: str):
    if name != "engine" and name not in _FROM_ENGINE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    engine = importlib.import_module(".engine", __name__)   # binds "engine" here as well
    for each in _FROM_ENGINE:
        globals()[each] = getattr(engine, each)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_ENGINE) | {"engine"})
