"""Sharded, atomic, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP).

``api.py`` saves and loads (and owns the background saves), ``layout.py`` the checkpoint
root on disk and its ``latest`` pointer, ``extras.py`` the step and extra objects,
``verify.py`` what the ranks agree on and what a checkpoint can lack, ``staging.py`` the
host copy a background save writes from (what lives on the device), ``streamed.py`` the
offloaded state a save reads a unit at a time as it writes it, ``narrow.py`` the state offload keeps in bf16,
saved in bf16, ``positions.py`` where each data loader is in its epoch, ``rest.py`` the
rest of an epoch a resume deals over its world. Safety and integrity: ``pickles.py`` what
a load takes from a checkpoint's pickles (nothing that runs code), ``checksums.py`` the
files' checksums and the writer that sums them, ``reader.py`` the reader every load goes
through and its checks before any value reaches the model, ``audit.py`` ``zerofn verify``.
``docs/checkpoints.md`` describes the format.
"""
from .api import AsyncCheckpointer, load_checkpoint, save_checkpoint, wait_for_checkpoint
from .extras import PerRank, RNGState
from .pickles import trust_class
from .positions import ResumableLoader

__all__ = ["AsyncCheckpointer", "PerRank", "RNGState", "ResumableLoader", "load_checkpoint",
           "save_checkpoint", "trust_class", "wait_for_checkpoint"]
