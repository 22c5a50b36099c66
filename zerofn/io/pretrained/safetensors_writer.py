"""Hugging Face's sharded safetensors layout, written tensor by tensor as it streams in.

A shard file is an 8-byte header length, a JSON header naming every tensor's dtype,
shape and byte range, then the tensors' bytes in that order. Knowing every entry's dtype
and shape up front, the writer puts the header first and appends each tensor as it
arrives, so no shard is ever held in memory.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch

from .. import fs

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class Entry:
    """One tensor of the saved file: its name, dtype and shape, and where it comes from
    (a parameter's slot, or a buffer's name)."""

    def __init__(self, name: str, dtype: torch.dtype, shape, source):
        self.name, self.dtype, self.shape, self.source = name, dtype, tuple(shape), source

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def shards(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Consecutive runs of entries of at most ``limit`` bytes (a larger tensor alone), so
    each shard can be written as the units stream in."""
    out, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > limit:
            out.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current or not out:
        out.append(current)
    return out


class Writer:
    """Safetensors shards written tensor by tensor in entry order into the directory
    ``tmp``, then the index. A failure is kept (``error``), not raised, so the writing
    rank goes on joining the gathers and every rank learns of it at the end."""

    def __init__(self, tmp: str, shards: list[list[Entry]]):
        self.tmp, self.error = tmp, None
        self._queue = [(i, e) for i, shard in enumerate(shards) for e in shard]
        self._shards, self._file, self._open_shard, self._at = shards, None, None, 0

    def write(self, source, pieces) -> None:
        """Write the next entry (``source`` must be it) from its pieces, in order."""
        if self.error:
            return
        try:
            shard, entry = self._queue[self._at]
            assert entry.source is source or entry.source == source, (entry.name, source)
            self._at += 1
            if shard != self._open_shard:
                self._start(shard)
            for piece in pieces:
                t = piece.detach().to("cpu", entry.dtype).contiguous().reshape(-1)
                self._file.write(memoryview(t.view(torch.uint8).numpy()))
        except Exception as e:   # kept for every rank to raise; rank 0 goes on gathering
            self._fail(e)

    def finish(self, then) -> None:
        """Close the last shard, write the index, then ``then(tmp)`` (what completes the
        directory and puts it in place); a failure is kept as for ``write``."""
        if self.error:
            return
        try:
            for shard in range(len(self._shards)):
                if not self._shards[shard] and shard != self._open_shard:
                    self._start(shard)      # a model without tensors: an empty file
            self._close()
            if len(self._shards) > 1:
                text = json.dumps(_index(self._shards), indent=2, sort_keys=True) + "\n"
                fs.write_file(os.path.join(self.tmp, INDEX_NAME), text)
            then(self.tmp)
        except Exception as e:
            self._fail(e)

    def _start(self, shard: int) -> None:
        self._close()
        entries = self._shards[shard]
        path = os.path.join(self.tmp, _shard_name(shard, len(self._shards)))
        self._file = open(path, "wb")
        self._file.write(_header(entries))
        self._open_shard = shard

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _fail(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            if self._file is not None:
                self._file.close()
        self._file = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def _shard_name(i: int, n: int) -> str:
    """The file name of shard ``i`` of ``n``, as Hugging Face names them."""
    return SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _header(entries: list[Entry]) -> bytes:
    """The safetensors header: 8 bytes of length, then JSON naming each tensor's dtype,
    shape and byte range in the data that follows, padded with spaces to 8 bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _index(shards) -> dict:
    n = len(shards)
    return {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
            "weight_map": {e.name: _shard_name(i, n) for i, s in enumerate(shards) for e in s}}
