"""A checkpoint root on disk, and its ``latest`` pointer.

A checkpoint root holds::

    root/step-00000010/    a plain DCP checkpoint (FSDP2 reads it: see docs/checkpoints.md)
    root/latest            the name of the newest complete checkpoint, replaced atomically
    root/.tmp-step-...     a save in progress, renamed into place once every rank has written

Everything here is plain file handling on one process (rank 0, or a converter with no
process group); saving, consolidation and the DeepSpeed converter share it.
"""
from __future__ import annotations

import os
import re
import shutil

from .. import fs

LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)$")


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``, e.g. ``step-00000010``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: pass the training step as a non-negative int.")
    return f"step-{step:08d}"


def unfinished(root: str, name: str) -> str:
    """Where the checkpoint ``name`` is written before ``publish`` renames it into place."""
    return os.path.join(root, ".tmp-" + name)


def clear_unfinished(root: str) -> None:
    """Remove saves a crash left behind (ours is awaited before this runs)."""
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        if entry.startswith(".tmp-") or entry.startswith(".old-"):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def publish(root: str, name: str, keep: int | None) -> None:
    """Rank 0, after every rank has written: rename into place, point ``latest``, prune.

    Each step is one atomic rename, so a crash anywhere leaves ``latest`` naming a
    complete checkpoint. The same step saved again replaces the old one.
    """
    fs.replace(unfinished(root, name), os.path.join(root, name),
               aside=os.path.join(root, ".old-" + name))
    write_pointer(root, name)
    if keep is not None:
        for old in complete_steps(root)[:-keep]:
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def write_pointer(root: str, name: str) -> None:
    """Point ``root/latest`` at the checkpoint ``name``, atomically."""
    fs.write_file(os.path.join(root, LATEST), name + "\n")


def complete_steps(root: str) -> list[str]:
    """Checkpoint directories under ``root``, oldest step first."""
    names = [n for n in os.listdir(root) if _STEP_DIR.match(n)
             and os.path.exists(os.path.join(root, n, ".metadata"))]
    return sorted(names, key=lambda n: int(_STEP_DIR.match(n).group(1)))


def holds_nothing(path: str) -> bool:
    """No checkpoint was ever published here: no such path, or a directory holding nothing
    but unfinished saves (which the next save removes)."""
    if not os.path.exists(path):
        return True
    return os.path.isdir(path) and all(e.startswith(".tmp-") for e in os.listdir(path))


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` means: itself, or the one its ``latest`` names."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    pointer = os.path.join(path, LATEST)
    if not os.path.exists(pointer):
        raise ValueError(f"No checkpoint at {path}: it has neither a {LATEST!r} file nor a "
                         f"DCP .metadata file. Pass a checkpoint root or one checkpoint "
                         f"directory.")
    with open(pointer) as f:
        name = f.read().strip()
    ckpt = os.path.join(path, name)
    if not os.path.exists(os.path.join(ckpt, ".metadata")):
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint "
                         f"(no {os.path.join(ckpt, '.metadata')}).")
    return ckpt
