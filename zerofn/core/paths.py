"""What a path given to zerofn may be: a local path, or a URL that fsspec serves
(``scheme://...``; io/fs.py opens those). Here, below the transforms, so that an option
naming a file the operating system must open refuses a URL when it is given."""
from __future__ import annotations

import os


def is_url(path) -> bool:
    """``path`` names a location through fsspec (``scheme://...``), not a local path."""
    return isinstance(path, str) and "://" in path


def local_only(path, what: str) -> str:
    """``path`` as a string, or a clear error where it is a URL but ``what`` needs a local
    filesystem (swap files, TensorBoard logs, files other libraries open by name)."""
    path = os.fspath(path)
    if is_url(path):
        raise ValueError(f"{what} must be a local path, not the URL {path!r}: it is opened "
                         f"by the operating system, not through fsspec. Pass a directory on "
                         f"a local or mounted filesystem.")
    return path
