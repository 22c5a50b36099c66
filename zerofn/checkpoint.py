"""Face of zerofn/io/checkpoint/, where checkpoints live now; re-exports its public names."""
from .io.checkpoint import (AsyncCheckpointer, PerRank, RNGState, load_checkpoint,
                            save_checkpoint, wait_for_checkpoint)
from .io.checkpoint.extras import to_bytes
from .io.checkpoint.layout import LATEST, publish, step_name

_publish = publish      # (alias for zerofn/deepspeed until it imports the public name)
_step_name = step_name  # (alias for zerofn/deepspeed until it imports the public name)
_to_bytes = to_bytes    # (alias for zerofn/deepspeed until it imports the public name)

__all__ = ["LATEST", "AsyncCheckpointer", "PerRank", "RNGState", "load_checkpoint",
           "save_checkpoint", "wait_for_checkpoint"]
