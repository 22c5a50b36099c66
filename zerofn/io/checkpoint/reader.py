"""The reader every load of a checkpoint goes through: DCP's, made safe and checked.

``SafeReader`` is DCP's ``FileSystemReader`` whose ``.metadata`` is checked against its
checksum and read by the restricted unpickler (pickles.py); ``SafePlanner`` is DCP's
``DefaultLoadPlanner`` whose bytes entries are scanned and read weights-only.
``preflight`` runs before the load itself (``verify.agree_on_load`` on every rank,
``consolidate.to_full`` alone): it plans this rank's reads as DCP will, checks every file
they touch against its checksum and scans every entry they read, zerofn's extras' blobs
included, so a corrupt file or a refused global is an error before DCP copies any tensor
into the model. [Note: pickles in a checkpoint] in pickles.py, [Note: checksums] in
checksums.py.
"""
from __future__ import annotations

import io
import os
from types import SimpleNamespace

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from .. import fs
from . import checksums, pickles

EXTRA = "extra."     # zerofn's extras: each entry holds one more torch.save blob (extras.py)
_SMALL = 1 << 20     # bytes: an entry this long is scanned from memory


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that checks ``.metadata`` against the checkpoint's checksums
    and reads it with the restricted unpickler (as torch does, with ``trusted=True``).
    ``path`` may be an fsspec URL: then it reads through DCP's fsspec file system, as
    ``FsspecReader`` does."""

    def __init__(self, path, *, trusted: bool = False):
        super().__init__(path)
        if fs.is_url(path):
            self.fs = FsspecFileSystem()
            self.path = self.fs.init_path(path)
        self.trusted = trusted

    def read_metadata(self, *args, **kwargs):
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        with fs.open_file(path, "rb") as f:
            data = f.read()
        root = os.fspath(self.path)
        checksums.check_bytes(root, os.path.basename(path), data, checksums.read_sums(root))
        metadata = pickles.load_metadata(data, path, self.trusted)
        if metadata.storage_meta is None:       # (older checkpoints have none)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def file_of(self, item) -> str:
        """The path of the file holding the read item ``item``."""
        info = self.storage_data[item.storage_index]
        return os.path.join(os.fspath(self.path), info.relative_path)

    def entry(self, file, item):
        """The stored entry ``item`` reads, as a seekable stream into the open ``file``
        (through the checkpoint's stream transforms, as ``read_data`` reads it); a small
        one read whole, which torch's archive reader then reads faster than the file."""
        info = self.storage_data[item.storage_index]
        stream = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), self._slice_file(file, info))
        if stream.seekable() and info.length > _SMALL:
            return stream
        return io.BytesIO(stream.read())


    def value(self, fqn: str):
        """The value of the bytes entry ``fqn``, read as a load reads it, outside a DCP
        load (after ``set_up_storage_reader``)."""
        item = SimpleNamespace(storage_index=MetadataIndex(fqn))
        path = self.file_of(item)
        with fs.open_file(path, "rb") as f:
            return pickles.load_entry(self.entry(f, item), f"{path} (entry {fqn})",
                                      self.trusted)


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading bytes entries with ``pickles.load_entry`` instead of
    an unrestricted ``torch.load``."""

    def __init__(self, *, trusted: bool = False):
        super().__init__()
        self.trusted = trusted

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = self.metadata.storage_data[read_item.storage_index]
        where = f"{info.relative_path} (entry {read_item.dest_index.fqn})"
        obj = pickles.load_entry(value, where, self.trusted)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def preflight(reader: SafeReader, metadata, state: dict, coordinator: bool) -> list[str]:
    """What stops this rank from loading ``state`` safely from ``reader``'s checkpoint
    (whose ``metadata`` it read): files its reads touch that do not match their checksums,
    then entries they read whose pickles a safe load refuses. Reads and checks, loads
    nothing into ``state``."""
    planner = SafePlanner(trusted=reader.trusted)
    planner.set_up_planner(state, metadata, coordinator)
    reader.set_up_storage_reader(metadata, coordinator)
    items = list({i.storage_index: i for i in planner.create_local_plan().items}.values())
    root = os.fspath(reader.path)
    files = {reader.storage_data[i.storage_index].relative_path for i in items}
    try:
        problems = list(checksums.problems(root, files, checksums.read_sums(root)).values())
    except checksums.Mismatch as e:
        return [str(e)]
    if problems or reader.trusted:
        return problems
    return refusals(reader, items)


def refusals(reader: SafeReader, items) -> list[str]:
    """A refusal for every entry of ``items`` (read items of ``reader``'s checkpoint) whose
    pickle, or whose zerofn extra's blob, names a global a safe load refuses."""
    out = []
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(reader.file_of(item), []).append(item)
    for path, file_items in sorted(by_file.items()):
        with fs.open_file(path, "rb") as f:
            for item in file_items:
                where = f"{path} (entry {item.storage_index.fqn})"
                try:
                    out += _refused(reader.entry(f, item), where, item)
                except pickles.Unreadable as e:
                    out.append(f"{where}: {e}")
    return out


def _refused(stream, where: str, item) -> list[str]:
    names = pickles.refused_in(stream)
    if names:
        return [pickles.refusal(where, names)]
    if item.type != LoadItemType.BYTE_IO or not item.storage_index.fqn.startswith(EXTRA):
        return []
    blob = pickles.load_entry(stream, where)
    if not isinstance(blob, bytes):
        return []
    names = pickles.refused_in(io.BytesIO(blob))
    return [pickles.refusal(f"{where}, its extra's blob", names)] if names else []
