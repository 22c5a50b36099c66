"""DeepSpeed's front door on zerofn: its config files, ``initialize`` and checkpoints.

A DeepSpeed script runs on zerofn with one changed line::

    import zerofn.deepspeed as deepspeed     # was: import deepspeed

``initialize`` returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed's
does; ``from_deepspeed_config`` reads a ``ds_config.json`` into a zerofn transform for
those who keep their own loop. See docs/deepspeed.md.
"""
from torch import distributed as comm

from . import checkpointing, utils
from .config import DeepSpeedConfigWarning, DeepSpeedSettings, from_deepspeed_config
from .engine import DeepSpeedEngine, add_config_arguments, init_distributed, initialize

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
           "from_deepspeed_config", "DeepSpeedSettings", "DeepSpeedConfigWarning",
           "checkpointing", "comm", "utils"]
