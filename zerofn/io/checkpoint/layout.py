"""A checkpoint root on disk, and its ``latest`` pointer.

A checkpoint root holds::

    root/step-00000010/    a plain DCP checkpoint (FSDP2 reads it: see docs/checkpoints.md)
    root/latest            the name of the newest complete checkpoint, replaced atomically
    root/.tmp-step-...     a save in progress, renamed into place once every rank has written

[Note: complete on object stores] At an fsspec URL (``memory://``, ``s3://``: fs.py's
[Note: storage URLs]) there is no atomic rename of a directory: on an object store a
rename copies every byte. A save there writes ``root/step-...`` in place, and the
writer writes ``.metadata`` last, after every rank's data files and ``checksums.json``
(checksums.py): a checkpoint directory without ``.metadata`` is a save that did not
finish, which every reader (zerofn's, DCP's, FSDP2's) refuses and the next save removes.
``latest`` is written after ``.metadata``, as locally. Saving a step that is already
there again withdraws the old one first (``latest`` moved off it), since the new one is
written over it.

Everything here is plain file handling on one process (rank 0, or a converter with no
process group); saving, consolidation and the DeepSpeed converter share it.
"""
from __future__ import annotations

import os
import re

from .. import fs
from .checksums import METADATA

LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)$")


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``, e.g. ``step-00000010``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: pass the training step as a non-negative int.")
    return f"step-{step:08d}"


def unfinished(root: str, name: str) -> str:
    """Where the checkpoint ``name`` is written before ``publish`` renames it into place
    (at a URL: in place, [Note: complete on object stores])."""
    return os.path.join(root, name) if fs.is_url(root) else os.path.join(root, ".tmp-" + name)


def clear_unfinished(root: str, name: str | None = None) -> None:
    """Remove saves a crash left behind (ours is awaited before this runs); at a URL,
    withdraw the checkpoint ``name`` too, which is about to be written over."""
    fs.makedirs(root)
    for entry in fs.listdir(root):
        if _unfinished(root, entry) or entry.startswith(".old-"):
            fs.rmtree(os.path.join(root, entry))
    if name is not None and fs.is_url(root) and fs.exists(os.path.join(root, name)):
        _withdraw(root, name)


def _unfinished(root: str, entry: str) -> bool:
    """``root``'s ``entry`` is a save that never finished: a hidden temporary, or (at a
    URL) a checkpoint directory without its ``.metadata``."""
    if entry.startswith(".tmp-"):
        return True
    return fs.is_url(root) and bool(_STEP_DIR.match(entry)) and \
        not fs.exists(os.path.join(root, entry, METADATA))


def _withdraw(root: str, name: str) -> None:
    """At a URL, before ``name`` is written again in place: point ``latest`` at the newest
    other complete checkpoint if it named ``name`` (none: remove it), then remove ``name``,
    so that a crash meanwhile leaves ``latest`` naming a complete checkpoint or nothing."""
    pointer = os.path.join(root, LATEST)
    if fs.exists(pointer) and _pointed(pointer) == name:
        others = [n for n in complete_steps(root) if n != name]
        if others:
            write_pointer(root, others[-1])
        else:
            fs.remove(pointer)
    fs.rmtree(os.path.join(root, name))


def publish(root: str, name: str, keep: int | None) -> None:
    """Rank 0, after every rank has written: rename into place, point ``latest``, prune.

    Each step is one atomic rename, so a crash anywhere leaves ``latest`` naming a
    complete checkpoint. The same step saved again replaces the old one.
    """
    if not fs.is_url(root):        # (at a URL it is in place, complete with its .metadata)
        fs.replace(unfinished(root, name), os.path.join(root, name),
                   aside=os.path.join(root, ".old-" + name))
    write_pointer(root, name)
    if keep is not None:
        for old in complete_steps(root)[:-keep]:
            if old != name:
                fs.rmtree(os.path.join(root, old))


def write_pointer(root: str, name: str) -> None:
    """Point ``root/latest`` at the checkpoint ``name``, atomically."""
    fs.write_file(os.path.join(root, LATEST), name + "\n")


def complete_steps(root: str) -> list[str]:
    """Checkpoint directories under ``root``, oldest step first."""
    names = [n for n in fs.listdir(root) if _STEP_DIR.match(n)
             and fs.exists(os.path.join(root, n, METADATA))]
    return sorted(names, key=lambda n: int(_STEP_DIR.match(n).group(1)))


def holds_nothing(path: str) -> bool:
    """No checkpoint was ever published here: no such path, or a directory holding nothing
    but unfinished saves (which the next save removes)."""
    if not fs.exists(path):
        return True
    return fs.isdir(path) and all(_unfinished(path, e) for e in fs.listdir(path))


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` means: itself, or the one its ``latest`` names."""
    if fs.exists(os.path.join(path, METADATA)):
        return path
    pointer = os.path.join(path, LATEST)
    if not fs.exists(pointer):
        steps = complete_steps(path) if fs.isdir(path) else []
        if steps:     # (a first save renamed into place, its pointer not yet written)
            return os.path.join(path, steps[-1])
        if _STEP_DIR.search(path.rstrip("/")) and fs.isdir(path):
            raise ValueError(f"{path} is a checkpoint whose save did not finish (it has no "
                             f".metadata, which a save writes last): load the checkpoint "
                             f"root (its {LATEST!r} names the newest complete one) or "
                             f"another step.")
        raise ValueError(f"No checkpoint at {path}: it has neither a {LATEST!r} file nor a "
                         f"DCP .metadata file. Pass a checkpoint root or one checkpoint "
                         f"directory.")
    name = _pointed(pointer)
    ckpt = os.path.join(path, name)
    if not fs.exists(os.path.join(ckpt, METADATA)):
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint "
                         f"(no {os.path.join(ckpt, METADATA)}).")
    return ckpt


def _pointed(pointer: str) -> str:
    """The checkpoint name the ``latest`` file ``pointer`` holds."""
    with fs.open_file(pointer, "r") as f:
        return f.read().strip()
