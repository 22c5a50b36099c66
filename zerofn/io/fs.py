"""Atomic, durable placement of finished files and directories, and where files live.

Everything io writes locally is first written whole under a hidden name and then put in
place by ``replace``: a reader (or a job restarted after a crash) finds the old version or
the new one, complete, never a half-written one. A checkpoint may also live at an fsspec
URL ([Note: storage URLs] below), where it is made whole differently (layout.py).
"""
from __future__ import annotations

import os
import shutil

from ..core.paths import is_url, local_only   # (io's modules ask fs.is_url, fs.local_only)


def replace(tmp: str, final: str, *, aside: str | None = None) -> None:
    """Put the finished ``tmp`` (a file or a directory) at ``final`` and make it durable.

    A directory already at ``final`` cannot be renamed over, so it is first renamed to
    ``aside`` (default: a hidden sibling) and removed once the new one is in place and
    synced. Each step is one rename: a crash between them leaves both complete versions,
    the old under ``aside``.
    """
    final = os.path.abspath(final)     # (a trailing separator would hide the parent)
    parent = os.path.dirname(final)
    aside = aside or os.path.join(parent, f".{os.path.basename(final)}.old")
    moved = os.path.isdir(final)
    if moved:
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(parent)
    if moved:
        shutil.rmtree(aside, ignore_errors=True)


def write_file(path: str, text: str) -> None:
    """Write a small text file (a pointer, an index) in full or not at all."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    if is_url(path):      # an object appears whole when written; a move puts it in place
        store = filesystem(path)
        store.pipe_file(tmp, text.encode())
        store.mv(tmp, path)
        return
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make the renames in directory ``path`` durable (a rename is a write to it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_tree(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` as hard links (copies where the filesystem has none), so
    carrying files into a new directory leaves the old one whole and costs no space."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.makedirs(dst)
        for entry in os.listdir(src):
            link_tree(os.path.join(src, entry), os.path.join(dst, entry))
    else:
        try:
            os.link(src, dst)
        except OSError:        # a filesystem without hard links
            shutil.copy2(src, dst)


# -- where files live: a local path or an fsspec URL ------------------------------------
# [Note: storage URLs] A checkpoint may live anywhere fsspec reaches: ``memory://run/ckpt``,
# ``file:///data/ckpt``, ``s3://bucket/ckpt`` (with s3fs installed). A path with a
# ``scheme://`` goes through fsspec; a plain path through ``os`` exactly as before, so a
# local checkpoint's code path and bytes are unchanged. URLs are kept whole and joined with
# ``os.path.join`` (``/``), which every fsspec filesystem takes.

def filesystem(url: str):
    """The fsspec filesystem serving ``url`` (fsspec caches them: the same one each time)."""
    from fsspec.core import url_to_fs   # (torch depends on fsspec; imported on first URL)
    try:
        return url_to_fs(url)[0]
    except (ImportError, ValueError) as e:
        raise ValueError(f"Cannot reach {url!r} through fsspec ({e}); install the package "
                         f"for its protocol (s3fs for s3://, gcsfs for gs://) or pass a "
                         f"local path.") from e


def open_file(path: str, mode: str = "rb"):
    """Open ``path`` (local or URL) for reading or writing."""
    return filesystem(path).open(path, mode) if is_url(path) else open(path, mode)


def exists(path: str) -> bool:
    return filesystem(path).exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return filesystem(path).isdir(path) if is_url(path) else os.path.isdir(path)


def size(path: str) -> int:
    return filesystem(path).size(path) if is_url(path) else os.path.getsize(path)


def listdir(path: str) -> list[str]:
    """The names in directory ``path`` (no such directory on an object store: none)."""
    if not is_url(path):
        return os.listdir(path)
    store = filesystem(path)
    if not store.isdir(path):
        return []
    return [os.path.basename(p.rstrip("/")) for p in store.ls(path, detail=False)]


def makedirs(path: str) -> None:
    if is_url(path):
        filesystem(path).makedirs(path, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
    if is_url(path):
        filesystem(path).rm_file(path)
    else:
        os.remove(path)


def rmtree(path: str) -> None:
    """Remove the directory ``path`` and everything in it, if it is there."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
    elif exists(path):
        filesystem(path).rm(path, recursive=True)
