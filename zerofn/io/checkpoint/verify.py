"""What every rank must agree on before a save or load, and what can be wrong with one.

[Note: agreement] Every collective entry point first agrees across ranks in one small
``all_gather_object`` (the step and extras on save; the checkpoint's verdict on load), so
a mismatch raises the same error on every rank instead of leaving some in a collective.
A load's verdict includes its files' checksums and its pickles' safety (reader.py).
"""
from __future__ import annotations

import hashlib
import os
import re
import socket

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from ...runtime.agree import agree_or_raise, from_first, gather
from .. import fs
from . import checksums, pickles
from .layout import holds_nothing, resolve
from .reader import SafeReader, preflight

_MARK = ".zerofn-save"     # rank 0's token in a save's directory (agree_on_directory)
_PER_RANK = re.compile(r"extra\.(.+)\.rank\d+$")


# -- save ------------------------------------------------------------------------------
def agree_on_save(step: int, blobs: dict, group) -> None:
    """Every rank saves the same step, and the same replicated extras (by their hashes)."""
    replicated = {k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()
                  if isinstance(v, bytes) and k != "step"}
    gathered = gather((step, replicated), group)
    first_step, first = gathered[0]   # every rank is held to rank 0's: one error on all
    for rank, (other_step, other) in enumerate(gathered):
        if other_step != first_step:
            raise ValueError(f"save_checkpoint: rank {rank} saves step {other_step}, rank 0 "
                             f"step {first_step}; pass the same step on every rank.")
        if other.keys() != first.keys():
            raise ValueError(f"save_checkpoint: rank {rank} passes extras "
                             f"{sorted(other)}, rank 0 {sorted(first)}.")
        for key in first:
            if other[key] != first[key]:
                raise ValueError(
                    f"save_checkpoint: extra {key!r} differs between ranks 0 and {rank}, so "
                    f"saving one copy would lose the others; wrap it in "
                    f"zerofn.checkpoint.PerRank(...) to save each rank's own.")


def mark(tmp: str) -> None:
    """Rank 0 leaves a token in the save's directory, for every rank to find there."""
    fs.makedirs(tmp)
    with fs.open_file(os.path.join(tmp, _MARK), "w") as f:
        f.write(os.urandom(8).hex())


def agree_on_directory(tmp: str, group) -> None:
    """Every rank must see rank 0's token (``mark``): the checkpoint root is one shared
    directory. Raises the same ValueError on every rank otherwise, before any is written
    (node-local paths would leave no complete checkpoint: docs/checkpoints.md)."""
    try:
        with fs.open_file(os.path.join(tmp, _MARK), "r") as f:
            seen = f.read()
    except OSError:
        seen = None
    where = tmp if fs.is_url(tmp) else os.path.abspath(tmp)
    gathered = gather((seen, socket.gethostname(), where), group)
    token, host, path = gathered[0]
    blind = [f"rank {r} on {other}" for r, (seen, other, _) in enumerate(gathered)
             if seen != token]
    if blind:
        raise ValueError(
            f"save_checkpoint: {', '.join(blind)} cannot see the directory rank 0 (on "
            f"{host}) writes, {os.path.dirname(path)}: every rank must see one "
            f"shared checkpoint root (NFS, Lustre, ...), or no complete checkpoint is "
            f"written. Put --save-dir / the path on a filesystem every node mounts at "
            f"that path; an fsspec URL must name storage every rank reaches (s3://, "
            f"file:// on a shared filesystem; memory:// is one process's own).")
    if dist.get_rank(group) == 0:
        fs.remove(os.path.join(tmp, _MARK))


# -- load ------------------------------------------------------------------------------
def resolve_on_rank0(path: str, group) -> str | None:
    """Rank 0 reads ``latest`` (it alone publishes it) and tells the others; None where
    ``path`` holds no checkpoint at all."""
    found = None
    if dist.get_rank(group) == 0:
        try:
            found = None if holds_nothing(path) else resolve(path)
        except (OSError, ValueError) as e:
            found = e
    found = from_first(found, group)
    if isinstance(found, BaseException):
        raise ValueError(f"load_checkpoint: rank 0 cannot read {path}: {found}")
    return found


def agree_on_load(ckpt: str, state: dict, group, trusted: bool = False,
                  places=None) -> None:
    """Check the checkpoint against what this rank will load into ``state``, its files
    against their checksums and its pickles against what a safe load takes (unless
    ``trusted``), and its data loaders' positions against this world (``places``, a
    ``positions.Places``); raise on every rank if any rank found a problem, before the
    collective load could leave some ranks waiting, and before any value reaches the model.
    Adds the checkpoint's step, and the positions ``places`` asks for, to the extras
    loaded, when it has them."""
    try:
        problems = _load_problems(SafeReader(ckpt, trusted=trusted), ckpt, state, group,
                                  places)
    except Exception as e:  # an unreadable checkpoint is one more problem to agree on
        problems = [f"cannot read it ({type(e).__name__}: {e}); a file is damaged"]
    agree_or_raise(problems, group, f"Cannot load checkpoint {ckpt}")


def _load_problems(reader: SafeReader, ckpt: str, state: dict, group,
                   places=None) -> list[str]:
    try:
        metadata = reader.read_metadata()
    except (pickles.Refused, checksums.Mismatch) as e:
        return [f"cannot read its metadata: {e}"]
    except Exception as e:  # whatever broke in the pickle, the file is the problem
        return [f"cannot read its metadata ({type(e).__name__}: {e}); the save did not "
                f"finish or the file is corrupt"]
    if "extra.step" in metadata.state_dict_metadata:
        state["extra"].setdefault("step", b"")
    if places is not None:
        places.request(metadata, state["extra"])
    problems = _problems(ckpt, metadata, state, dist.get_world_size(group))
    problems = problems or preflight(reader, metadata, state, dist.get_rank(group) == 0)
    return problems or ([] if places is None else places.problems(reader, metadata))


def _problems(ckpt: str, metadata, state: dict, world: int) -> list[str]:
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    problems = _per_rank_problems(flat, saved, world)
    missing = [k for k in flat if k not in saved and not _PER_RANK.match(k)]
    if missing:
        problems.append(f"it lacks {len(missing)} entries this model needs, e.g. "
                        f"{', '.join(missing[:3])}" + _missing_hint(missing, saved))
    wrong = [f"{k}: saved {_shape(saved[k])}, here {_shape_of(v)}"
             for k, v in flat.items() if k in saved and _shape(saved[k]) != _shape_of(v)]
    if wrong:
        problems.append(f"{len(wrong)} shapes differ ({'; '.join(wrong[:3])}): it was saved "
                        f"from another model configuration")
    return problems + file_problems(ckpt, metadata)


def saved_ranks(saved: dict, key: str) -> int:
    """How many ranks saved the per-rank extra ``key`` (``saved``: the checkpoint's keys)."""
    prefix = f"extra.{key}.rank"
    return sum(1 for k in saved if k.startswith(prefix) and k[len(prefix):].isdigit())


def _per_rank_problems(flat: dict, saved: dict, world: int) -> list[str]:
    problems = []
    for key in flat:
        match = _PER_RANK.match(key)
        if match:
            ranks = saved_ranks(saved, match.group(1))
            if ranks != world:
                problems.append(f"per-rank state {match.group(1)!r} was saved by {ranks} "
                                f"ranks, not {world}: it cannot move to another world size; "
                                f"load without it")
    return problems


def _missing_hint(missing: list[str], saved: dict) -> str:
    if any(k.startswith("optim.") for k in missing) and \
            not any(k.startswith("optim.") for k in saved):
        return " (it holds no optimizer state: pass optimizer=None to load the model alone)"
    return ": was it saved from another model?"


def _shape(meta) -> str:
    return "bytes" if isinstance(meta, BytesStorageMetadata) else str(tuple(meta.size))


def _shape_of(value) -> str:
    if isinstance(value, (torch.Tensor, DTensor)):
        return str(tuple(value.shape))
    return "bytes"


def file_problems(ckpt: str, metadata) -> list[str]:
    """Data files ``metadata`` names that are missing or shorter than it says."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(need.items()):
        file = os.path.join(ckpt, name)
        if not fs.exists(file):
            problems.append(f"data file {name} is missing")
        elif fs.size(file) < size:
            problems.append(f"data file {name} is truncated ({fs.size(file)} of "
                            f"{size} bytes)")
    return problems
