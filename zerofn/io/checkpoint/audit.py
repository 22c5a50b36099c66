"""``zerofn verify CKPT``: what a checkpoint holds, whether its files match their checksums,
and what a safe load would refuse; read offline, on one process, running none of it.

    zerofn verify CKPT     exit status 0 when a load would take it, 1 when it would not

``CKPT`` is a checkpoint root (its ``latest`` is read) or one checkpoint directory, from
zerofn, FSDP2 or any ``dcp.save``, a local path or an fsspec URL (``s3://bucket/ckpt``).
Every file is checked, not only those one load reads, and every entry is scanned; a load
checks the same things of what it reads (reader.py).
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .. import fs
from . import checksums, pickles
from .layout import resolve
from .reader import SafeReader, refusals
from .verify import file_problems

_PER_RANK = ".rank"


@dataclass
class Audit:
    """What ``audit`` found: ``holds`` describes the contents, ``problems`` are damaged or
    missing files, ``refusals`` what a safe load would refuse; ``summed``: the checkpoint
    has checksums."""
    ckpt: str
    summed: bool = False
    holds: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.refusals


def audit(path) -> Audit:
    """Check the checkpoint at ``path`` as the module docstring says; runs none of it."""
    found = Audit(resolve(os.fspath(path)))
    try:
        sums = checksums.read_sums(found.ckpt)
        found.summed = sums is not None
    except checksums.Mismatch as e:
        sums = None
        found.problems.append(str(e))
    metadata = _metadata(found, sums)
    if metadata is None:
        return found
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    damaged = checksums.problems(found.ckpt, files, sums)
    found.problems += list(damaged.values()) if sums is not None else \
        file_problems(found.ckpt, metadata)
    found.holds = _holds(metadata, files, sums, found.ckpt)
    found.refusals += refusals(_reader(found.ckpt, metadata), _entries(metadata, damaged))
    return found


def _metadata(found: Audit, sums: dict | None):
    """The checkpoint's ``Metadata``, its refused globals stood in for and recorded; None
    (and a problem recorded) where it cannot be read."""
    path = os.path.join(found.ckpt, checksums.METADATA)
    with fs.open_file(path, "rb") as f:
        data = f.read()
    try:
        checksums.check_bytes(found.ckpt, checksums.METADATA, data, sums)
        unpickler = pickles.MetadataUnpickler(io.BytesIO(data), path, survey=True)
        metadata = unpickler.load()
    except checksums.Mismatch as e:
        found.problems.append(str(e))
        return None
    except Exception as e:  # a damaged pickle: say so, whatever broke
        found.problems.append(f"cannot read {path} ({type(e).__name__}: {e})")
        return None
    if unpickler.refused:
        found.refusals.append(pickles.refusal(path, sorted(set(unpickler.refused))))
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        found.problems.append(f"{path} holds no DCP checkpoint metadata")
        return None
    return metadata


def _reader(ckpt: str, metadata) -> SafeReader:
    reader = SafeReader(ckpt)
    reader.set_up_storage_reader(metadata, True)
    return reader


def _entries(metadata, damaged: dict) -> list[ReadItem]:
    """A read item for every stored entry of a file not ``damaged``."""
    items = []
    for index, info in metadata.storage_data.items():
        if info.relative_path in damaged:
            continue
        stored = metadata.state_dict_metadata.get(index.fqn)
        kind = LoadItemType.BYTE_IO if isinstance(stored, BytesStorageMetadata) \
            else LoadItemType.TENSOR
        items.append(ReadItem(type=kind, dest_index=index, dest_offsets=torch.Size(),
                              storage_index=index, storage_offsets=torch.Size(),
                              lengths=torch.Size()))
    return items


def _holds(metadata, files: list[str], sums: dict | None, ckpt: str) -> list[str]:
    groups: dict[str, list] = {}
    for fqn, stored in metadata.state_dict_metadata.items():
        groups.setdefault(fqn.split(".", 1)[0], []).append((fqn, stored))
    lines = [f"{name}: {_describe(name, entries)}" for name, entries in sorted(groups.items())]
    size = sum(fs.size(os.path.join(ckpt, f)) for f in files
               if fs.exists(os.path.join(ckpt, f)))
    lines.append(f"files: {checksums.METADATA} and {len(files)} data "
                 f"file{'s' if len(files) != 1 else ''}, {_bytes(size)}; "
                 + ("checksums: CRC-32 of each" if sums is not None else
                    "no checksums (written before zerofn wrote them, or by FSDP2): sizes "
                    "checked against .metadata"))
    return lines


def _describe(group: str, entries: list) -> str:
    tensors = [s for _, s in entries if not isinstance(s, BytesStorageMetadata)]
    if group != "extra":
        nbytes = sum(s.size.numel() * s.properties.dtype.itemsize for s in tensors)
        return f"{len(tensors)} tensors ({_bytes(nbytes)}), {len(entries) - len(tensors)} " \
               f"other values"
    names: dict[str, str] = {}
    per_rank: dict[str, int] = {}
    for fqn, _ in entries:
        name = fqn[len("extra."):]
        base, sep, rank = name.rpartition(_PER_RANK)
        if sep and rank.isdigit():
            per_rank[base] = per_rank.get(base, 0) + 1
        else:
            names[name] = name
    names.update({b: f"{b} (per rank, {n} ranks)" for b, n in per_rank.items()})
    return ", ".join(label for _, label in sorted(names.items()))


def _bytes(n: float) -> str:
    unit = "B"
    for bigger in ("KB", "MB", "GB"):
        if n < 1000:
            break
        n, unit = n / 1000, bigger
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def main(argv=None, prog: str = "python -m zerofn.io.checkpoint.audit") -> int:
    """The command line; ``prog`` names it in the help (the ``zerofn`` script passes its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint root (uses its 'latest') or directory")
    args = parser.parse_args(argv)
    try:
        found = audit(args.checkpoint)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"checkpoint {found.ckpt}")
    for line in found.holds:
        print(f"  {line}")
    for problem in found.problems:
        print(f"  damaged: {problem}")
    for refusal in found.refusals:
        print(f"  refused: {refusal}")
    if found.ok:
        print(("OK: every file matches its checksum" if found.summed else
               "OK: no checksums to check, every file as long as .metadata says")
              + "; a safe load takes every entry")
    else:
        print(f"FAILED: {len(found.problems)} damaged, {len(found.refusals)} refused")
    return 0 if found.ok else 1


if __name__ == "__main__":
    sys.exit(main())
