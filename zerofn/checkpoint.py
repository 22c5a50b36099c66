"""Face of zerofn/io/checkpoint/, where checkpoints live now; re-exports its public names."""
from .io.checkpoint import (AsyncCheckpointer, PerRank, ResumableLoader, RNGState,
                            load_checkpoint, save_checkpoint, trust_class, wait_for_checkpoint)
from .io.checkpoint.layout import LATEST

__all__ = ["LATEST", "AsyncCheckpointer", "PerRank", "ResumableLoader", "RNGState",
           "load_checkpoint", "save_checkpoint", "trust_class", "wait_for_checkpoint"]
