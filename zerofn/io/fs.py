"""Atomic, durable placement of finished files and directories.

Everything io writes is first written whole under a hidden name and then put in place by
``replace``: a reader (or a job restarted after a crash) finds the old version or the new
one, complete, never a half-written one.
"""
from __future__ import annotations

import os
import shutil


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
