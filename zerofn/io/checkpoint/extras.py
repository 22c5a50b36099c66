"""A checkpoint's ``extra`` entry: the step and every extra object, each one opaque blob.

[Note: why blobs] DCP flattens nested dicts and treats plain tensors as replicated: it
writes one rank's copy and drops the others. A data loader's or generator's state differs
per rank, so each extra is serialized whole (``torch.save`` bytes) and per-rank ones are
keyed by rank (``PerRank``). Loading then needs the same structure only at the top level.
"""
from __future__ import annotations

import io

import torch

from . import pickles


class PerRank:
    """Marks an extra whose state differs per rank (a rank's data loader, its RNG).

    It is saved under this rank's index and restored to the same rank; it cannot move to
    another world size (a data loader over a ``DistributedSampler`` moves by its place in
    the epoch instead: positions.py). ``obj`` is a ``Stateful`` or a plain value.
    """

    def __init__(self, obj):
        self.obj = obj


class _Generators:
    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(PerRank):
    """This rank's torch generators (CPU and every CUDA device), as a per-rank extra."""

    def __init__(self):
        super().__init__(_Generators())


def blobs(extra: dict, rank: int) -> dict:
    """``extra`` as saved: ``{key: bytes}``, per-rank ones as ``{key: {"rank<r>": bytes}}``."""
    out = {}
    for key, value in extra.items():
        obj = value.obj if isinstance(value, PerRank) else value
        blob = to_bytes(obj.state_dict() if is_stateful(obj) else obj)
        out[key] = {f"rank{rank}": blob} if isinstance(value, PerRank) else blob
    return out


def placeholders(extra: dict, rank: int) -> dict:
    """The structure ``blobs`` gives ``extra``, with empty bytes for DCP to load into."""
    return {k: ({f"rank{rank}": b""} if isinstance(v, PerRank) else b"")
            for k, v in extra.items()}


def restore(extra: dict, loaded: dict, rank: int, trusted: bool = False) -> dict:
    """Load the blobs into ``extra``'s ``Stateful`` objects; return the plain values (and
    the step, unless ``extra`` names its own). Blobs are read safely (pickles.py) unless
    ``trusted``."""
    out = {}
    if "step" in loaded and "step" not in extra:
        out["step"] = from_bytes(loaded["step"], "step", trusted)
    for key, value in extra.items():
        blob = loaded[key][f"rank{rank}"] if isinstance(value, PerRank) else loaded[key]
        obj = value.obj if isinstance(value, PerRank) else value
        if is_stateful(obj):
            obj.load_state_dict(from_bytes(blob, key, trusted))
        else:
            out[key] = from_bytes(blob, key, trusted)
    return out


def to_bytes(obj) -> bytes:
    """``obj`` as one blob (``torch.save`` bytes)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(blob: bytes, key: str, trusted: bool):
    """The object a blob of the extra ``key`` holds, read safely unless ``trusted``."""
    return pickles.load_entry(io.BytesIO(blob), f"extra {key!r}", trusted)


def is_stateful(obj) -> bool:
    """Whether ``obj`` has a state of its own (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))
