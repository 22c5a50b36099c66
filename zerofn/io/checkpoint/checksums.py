"""Checksums of a checkpoint's files: summed as they are written, checked before a load.

[Note: checksums] ``ChecksumWriter`` is DCP's ``FileSystemWriter`` with every byte it
writes summed on its way to the file, from memory, in the thread that writes it (a
background save's too): each rank sums its own data files, the sums travel to rank 0
with DCP's write results, and rank 0 writes them to ``checksums.json`` beside
``.metadata``, with the sum of ``.metadata`` itself::

    {"format": "zerofn checksums", "version": 1, "algorithm": "crc32",
     "files": {".metadata": {"size": 9887, "crc32": 1234567890}, "__0_0.distcp": ...},
     "crc32_of_files": 987654321}

(the last is the sum of ``files`` itself, written compactly with sorted keys, so damage
to ``checksums.json`` is blamed on it rather than on a file it describes).

zerofn writes a checkpoint into an unfinished directory and renames it into place
(layout.py), so the sums appear with the rest or not at all. At an fsspec URL, where a
checkpoint is written in place, the writer writes ``checksums.json`` before ``.metadata``,
the file that makes the checkpoint visible ([Note: complete on object stores]). A load
checks ``.metadata`` against its sum before unpickling it (reader.py), and every data
file a rank will read before DCP reads any of it (``verify.agree_on_load``): a flipped bit
or a truncated file is a ``ValueError`` naming the file, on every rank, before any value
reaches the model.
A checkpoint without ``checksums.json`` (written before zerofn wrote them, or by FSDP2)
is read as before, its files' sizes checked against ``.metadata``.

The sum is CRC-32 (``zlib.crc32``): the fastest the standard library has (2.1 GB/s on a
core of the development machine, SHA-256 1.0, BLAKE2b 0.9, MD5 0.6), it releases the GIL
while it runs, and it catches every error burst of up to 32 bits; with the size, every
truncation. It guards against corruption, not against someone who rewrites a file and its
sum: that is the safe readers' job (pickles.py).

[Note: bounded files] DCP's writer keeps every tensor it writes until the file is done,
and copies each that is a view into a larger buffer (a row of a whole parameter, a unit's
flat masters, offloaded state in its arena: most of zerofn's state) or that lives on a
GPU. With one file per rank, as DCP writes by default, a synchronous save held a second
copy of the rank's whole state. ``ChecksumWriter`` splits each rank's items into files of
at most ``file_bytes`` (a rank's piece of a tensor larger than that gets a file of its
own). Readers, DCP's and FSDP2's alike, find every item's file in ``.metadata``.

[Note: one item at a time] DCP's own file loop (torch 2.13's ``_write_files_from_queue``)
also keeps a reference to every tensor of a file until the file is closed (a dict it
needs only for safetensors), so a save held one whole file's copies, half of
``staging_bytes``, beside what it reads and what a background save copies aside: under
low-precision offload, steps running beside a background save peaked 80 MiB over two data
files (docs/checkpoints.md, "One tensor's copy at a time"). ``ChecksumWriter`` writes each file with a loop of its own
that takes an item, writes it and lets it go before it takes the next, so a save holds
one item's copy at a time; the files, and every byte in them, are DCP's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import queue
import threading
import zlib
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, FileSystem,
                                                     SerializationFormat, _write_item)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.futures import Future

from .. import fs

SUMS = "checksums.json"
METADATA = ".metadata"
_FORMAT, _VERSION, _ALGORITHM = "zerofn checksums", 1, "crc32"
_CHUNK = 16 << 20          # bytes read at a time when a file is summed at load
FILE_BYTES = 256 << 20     # a data file's bytes at most (a larger piece: a file alone)


class Mismatch(ValueError):
    """A checkpoint file does not match its checksum, or the checksums are unreadable."""


# -- writing ---------------------------------------------------------------------------
class _Summing:
    """A binary file being written, summing what passes through ``write``."""

    def __init__(self, raw):
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return written

    def __getattr__(self, name):       # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


class _Sums:
    """A DCP file system (local or fsspec) keeping ``{file name: (crc32, size)}`` of every
    file written."""

    def __init__(self):
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summing = _Summing(stream)
            yield summing
        self.sums[os.path.basename(os.fspath(path))] = (summing.crc, summing.size)


class _SummingFileSystem(_Sums, FileSystem):
    """DCP's local file system, summing."""

    def metadata_sum(self, root: str) -> tuple[int, int]:
        return file_sum(os.path.join(root, METADATA))

    def publish_metadata(self) -> None:
        """(in place already: the whole directory is renamed into place, layout.py)"""


class _SummingFsspec(_Sums, FsspecFileSystem):
    """DCP's fsspec file system, summing, which holds back the rename that makes
    ``.metadata`` visible until ``publish_metadata`` (after ``checksums.json``)."""

    def __init__(self):
        super().__init__()
        self.held: tuple[str, str] | None = None

    def rename(self, path, new_path) -> None:
        if os.path.basename(os.fspath(new_path)) == METADATA:
            self.held = (path, new_path)
            return
        super().rename(path, new_path)

    def metadata_sum(self, root: str) -> tuple[int, int]:
        """``(crc32, size)`` of the ``.metadata`` written, summed as it was."""
        return self.sums[os.path.basename(os.fspath(self.held[0]))]

    def publish_metadata(self) -> None:
        """Rename the written ``.metadata`` into place: the checkpoint is complete."""
        super().rename(*self.held)


@dataclasses.dataclass(frozen=True)
class _Summed:
    """A write result's storage info with its file's sum, on its way to rank 0."""
    info: Any
    crc32: int
    size: int


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that writes ``checksums.json``: the CRC-32 and size of every
    file of the checkpoint, and each rank's data in files of at most ``file_bytes`` (None:
    ``FILE_BYTES``), setting the ``threading.Event`` ``written`` (if any) once they are;
    see the module docstring. Takes FileSystemWriter's arguments; the
    checkpoint has one global ``.metadata`` (``dcp.save``'s default). ``path`` may be an
    fsspec URL: then it writes through DCP's fsspec file system, as ``FsspecWriter`` does,
    syncing files only where they are local (an object is durable once written)."""

    def __init__(self, path, file_bytes: int | None = None, written=None, **kwargs):
        url = fs.is_url(path)
        if url:
            kwargs.setdefault("sync_files", "file" in fs.filesystem(path).protocol)
        super().__init__(path, **kwargs)
        self.fs = _SummingFsspec() if url else _SummingFileSystem()
        if url:
            self.path = self.fs.init_path(path)
        self.file_bytes = FILE_BYTES if file_bytes is None else file_bytes
        self.written = written     # a threading.Event set once this rank's data is written

    def write_data(self, plan, planner) -> Future:
        try:
            results = self._write_files(plan, planner).wait()    # written when it returns
        finally:
            if self.written is not None:
                self.written.set()
        done: Future = Future()
        done.set_result([dataclasses.replace(r, storage_data=_Summed(
            r.storage_data, *self.fs.sums[r.storage_data.relative_path])) for r in results])
        return done

    def _write_files(self, plan, planner) -> Future:
        """DCP's ``write_data`` with the rank's items in bounded files (``thread_count``
        threads take them in turn)."""
        if not self.single_file_per_rank:          # a file per item: bounded already
            return super().write_data(plan, planner)
        files: queue.Queue = queue.Queue()
        for n, items in enumerate(bounded_files(plan.items, self.file_bytes)):
            name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def _write_data(self, planner, files: queue.Queue) -> Future:
        """DCP's, in ``thread_count`` threads taking files in turn, each file written one
        item at a time ([Note: one item at a time])."""
        if self.serialization_format != SerializationFormat.TORCH_SAVE:
            return super()._write_data(planner, files)     # (safetensors needs a whole file)
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                while not errors:
                    try:
                        path, name, items = files.get_nowait()
                    except queue.Empty:
                        return
                    results.put(self._write_file(planner, path, name, items))
            except BaseException as e:  # raised below, in the calling thread
                errors.append(e)

        threads = [threading.Thread(target=drain) for _ in range(1, self.thread_count)]
        for t in threads:
            t.start()
        drain()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done: Future = Future()
        done.set_result([r for _ in range(results.qsize()) for r in results.get_nowait()])
        return done

    def _write_file(self, planner, path, name: str, items: list[WriteItem]) -> list:
        """Write ``items`` to the data file ``path``: byte items first, then each tensor,
        taken from the planner, written, and let go before the next is taken."""
        results = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    results.append(self._write_one(stream, planner.resolve_data(item), item,
                                                   name))
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    results.append(self._write_one(stream, _own(planner.resolve_data(item)),
                                                   item, name))
            if self.sync_files:
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()
        return results

    def _write_one(self, stream, data, item: WriteItem, name: str):
        return _write_item(self.transforms, stream, data, item, name, self.serialization_format)

    def finish(self, metadata, results) -> None:
        files, plain = {}, []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                summed = r.storage_data
                files[summed.info.relative_path] = {"size": summed.size, "crc32": summed.crc32}
                plain[-1].append(dataclasses.replace(r, storage_data=summed.info))
        super().finish(metadata, plain)
        root = os.fspath(self.path)
        crc, size = self.fs.metadata_sum(root)
        files[METADATA] = {"size": size, "crc32": crc}
        write_sums(root, files)
        self.fs.publish_metadata()       # at a URL, what makes the checkpoint visible


def _own(tensor):
    """``tensor`` on the host in memory of exactly its bytes, as DCP's loader makes it (a
    view into a larger buffer is copied: torch.save would write the whole buffer)."""
    tensor = tensor.detach().cpu()
    return tensor.clone() if tensor.untyped_storage().size() != tensor.nbytes else tensor


def bounded_files(items: list[WriteItem], file_bytes: int) -> list[list[WriteItem]]:
    """``items`` in order, in files of at most ``file_bytes`` of the rank's tensor data
    (a larger piece alone in one); the byte items (small: counters, extras) in the first."""
    files: list[list[WriteItem]] = [[i for i in items if i.type == WriteItemType.BYTE_IO]]
    size = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        data = item.tensor_data          # the rank's piece: chunk.sizes (size: the whole)
        nbytes = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
        if size and size + nbytes > file_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += nbytes
    return files


def write_sums(ckpt: str, files: dict) -> None:
    """Write ``{file name: {"size", "crc32"}}`` as ``ckpt``'s checksums, atomically."""
    fs.write_file(os.path.join(ckpt, SUMS), json.dumps(
        {"format": _FORMAT, "version": _VERSION, "algorithm": _ALGORITHM,
         "files": dict(sorted(files.items())), "crc32_of_files": _self_sum(files)},
        indent=1) + "\n")


# -- checking --------------------------------------------------------------------------
def file_sum(path: str) -> tuple[int, int]:
    """``(crc32, size)`` of the file at ``path``, read in chunks."""
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with fs.open_file(path, "rb") if fs.is_url(path) else open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return crc, size


def read_sums(ckpt: str) -> dict | None:
    """``{file name: {"size", "crc32"}}`` from ``ckpt``'s checksums, None where it has none.
    Raises ``Mismatch`` where the checksums file is unreadable."""
    path = os.path.join(ckpt, SUMS)
    try:
        with fs.open_file(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        sums = json.loads(raw.decode("utf-8"))
        if (sums["format"], sums["version"], sums["algorithm"]) != (_FORMAT, _VERSION,
                                                                    _ALGORITHM):
            raise ValueError(f"format {sums['format']!r} version {sums['version']!r} "
                             f"algorithm {sums['algorithm']!r}")
        files = sums["files"]
        if sums["crc32_of_files"] != _self_sum(files):
            raise ValueError("its list of files does not match its own checksum")
        return files
    except Exception as e:  # any damage to the file is one error naming it
        raise Mismatch(f"{path} is unreadable ({type(e).__name__}: {e}): it is corrupt, so "
                       f"the checkpoint cannot be checked; copy it again from its source") from e


def _self_sum(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True, separators=(",", ":")).encode())


def check_bytes(ckpt: str, name: str, data: bytes, sums: dict | None) -> None:
    """Raise ``Mismatch`` unless ``data``, the bytes of ``ckpt``'s file ``name``, match
    its sum in ``sums`` (None: the checkpoint has no checksums, nothing to check)."""
    if sums is None:
        return
    path = os.path.join(ckpt, name)
    problem = _unlisted(path) if name not in sums else \
        _verdict(path, sums[name], zlib.crc32(data), len(data))
    if problem:
        raise Mismatch(problem)


def problems(ckpt: str, names, sums: dict | None) -> dict[str, str]:
    """``{file name: what is wrong with it}`` for those of ``ckpt``'s files ``names`` that
    do not match their sums (none without sums)."""
    out = {}
    for name in [] if sums is None else sorted(names):
        problem = _file_problem(os.path.join(ckpt, name), sums.get(name))
        if problem:
            out[name] = problem
    return out


def _file_problem(path: str, expected: dict | None) -> str | None:
    if expected is None:
        return _unlisted(path)
    if not fs.exists(path):
        return f"{path} is missing; copy the whole checkpoint directory"
    size = fs.size(path)
    if size != expected["size"]:           # no need to read it: the size says it all
        return _verdict(path, expected, None, size)
    return _verdict(path, expected, *file_sum(path))


def _unlisted(path: str) -> str:
    return (f"{path} has no checksum in {SUMS}: the file or the checksums are not from this "
            f"save; copy the checkpoint again from its source")


def _verdict(path: str, expected: dict, crc: int | None, size: int) -> str | None:
    if size != expected["size"]:
        return (f"{path} is {size} bytes, but the save wrote {expected['size']}: it is "
                f"{'truncated' if size < expected['size'] else 'longer than written'}; copy "
                f"it again from the checkpoint's source, or load an older checkpoint")
    if crc != expected["crc32"]:
        return (f"{path} does not match its checksum (CRC-32 {crc:08x}, saved "
                f"{expected['crc32']:08x}): the file is corrupt (a flipped bit, a bad copy); "
                f"copy it again from the checkpoint's source, or load an older checkpoint")
    return None
