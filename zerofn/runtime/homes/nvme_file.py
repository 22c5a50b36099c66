"""The swap file of offload("nvme"): one per rank, a block per unit at a fixed offset.

A unit's block holds master | exp_avg | exp_avg_sq (fp32) and, under ZeRO-3 parameter
offload, the unit's compute shard after them; each part is aligned for O_DIRECT. O_DIRECT
is used where the filesystem accepts it (no page-cache copy of what is read once per
step); elsewhere I/O is buffered. Every read and write goes through in full or raises an
error naming the file, the unit and the cause: a full or failing drive must stop the run,
never leave a block half-written (a short count is no error to the OS) to be read back.
"""
from __future__ import annotations

import errno
import glob
import itertools
import os
import shutil
import weakref

import torch

from ..pinned import host_buffer
from .stored import StoredForm

BLOCK = 4096                     # bytes: O_DIRECT alignment of buffers, offsets and sizes
FLOAT = 4


def _round(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


_SWAPS = itertools.count()     # swap files this process made: each its own name


def swap_name(path: str, rank: int) -> str:
    """A new swap file's path: two models offloaded to one drive in one process (a notebook,
    a reference model) must not open, truncate or remove each other's file."""
    return os.path.join(path, f"zerofn-rank{rank}-{os.getpid()}-{next(_SWAPS)}.swap")


FP32 = StoredForm()


def state_bytes(unit, form: StoredForm = FP32) -> int:
    """A block's master | exp_avg | exp_avg_sq (and the form's extras, stored.py)."""
    return _round(form.state_bytes(unit))


def block_bytes(unit, param_dtype: torch.dtype | None = None, form: StoredForm = FP32) -> int:
    """A unit's block: its state, then its compute shard in ``param_dtype`` under
    parameter offload."""
    return state_bytes(unit, form) + \
        (_round(unit.shard_numel * param_dtype.itemsize) if param_dtype else 0)


def swap_bytes(units, param_dtypes: dict, form: StoredForm = FP32) -> int:
    return sum(block_bytes(u, param_dtypes.get(u), form) for u in units)


def nvme_problems(path, need_bytes: int, units=()) -> list[str]:
    """What stops an NVMe store at ``path``: checked on every rank before any collective
    (which optimizer steps it: homes/__init__.py's ``optimizer_problems``)."""
    # The swap file's masters and Adam state are fp32, stepped by the C++ kernel: a wider
    # dtype would be rounded (and its gradients are no kernel input).
    wide = next((s for u in units for s in u.slots if s.param.dtype.itemsize > 4), None)
    if wide is not None:
        return [(f"offload('nvme') keeps fp32 masters, but parameter {wide.fqn!r} is "
                 f"{wide.param.dtype}: cast the model to float32 (bf16 or fp16 compute with "
                 "mixed_precision), or use offload('cpu'), which keeps each unit's dtype.")]
    if not path:
        return ["offload('nvme') needs path=, a directory on the NVMe drive."]
    if not os.path.isdir(path):
        return [f"offload('nvme'): {path!r} is not an existing directory; create it first."]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"offload('nvme'): cannot write to {path!r}; choose a writable directory."]
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        return [(f"offload('nvme'): {path!r} has {_size(free)} free, the swap file needs "
                 f"{_size(need_bytes)}; free space or choose another drive.")]
    return []


def _size(n: int) -> str:
    """Bytes as GiB where that says something, else exactly (a small model's swap files)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n:,} bytes"


def remove_stale(path: str, rank: int) -> None:
    """Swap files of this rank left by processes that no longer run (killed runs)."""
    for name in glob.glob(os.path.join(path, f"zerofn-rank{rank}-*.swap")):
        pid = int(os.path.basename(name).split("-")[2].split(".")[0])   # (-N.swap or .swap)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.remove(name)
        except PermissionError:
            pass   # alive, someone else's


class SwapFile:
    """The file, its blocks' places, and checked whole-block I/O.

    Args:
        path: the directory (on the NVMe drive).
        rank: the global rank, which names the file (HSDP's replicas share shard ranks).
        units: every unit, in order; each gets a block.
        params: ``{unit: compute dtype}`` of the units whose ZeRO-3 shard lives here too.
        form: how masters and moments are stored (stored.py).
    """

    def __init__(self, path: str, rank: int, units, params: dict, form: StoredForm = FP32):
        self.params, self.form = params, form
        self.block = {u: block_bytes(u, params.get(u), form) for u in units}
        self.offset, size = {}, 0
        for u in units:
            self.offset[u] = size
            size += self.block[u]
        self.size = size
        self.param_bytes = sum(self.block[u] - state_bytes(u, form) for u in params)
        remove_stale(path, rank)
        self.name = swap_name(path, rank)
        self.fd, self.direct = _open(self.name)
        # Closed and removed when the file is dropped, or at exit (a finalizer's default:
        # no exit handler of zerofn's own).
        self._cleanup = weakref.finalize(self, _close_and_remove, self.fd, self.name)
        try:    # the space reserved now: no later swap write can find the drive full
            os.posix_fallocate(self.fd, 0, max(size, BLOCK))
        except OSError as e:
            self._cleanup()
            raise OSError(e.errno, f"offload('nvme'): reserving {_size(size)} for the swap "
                                   f"file {self.name} failed: {e.strerror} (other ranks' swap "
                                   "files on that drive take their share); free space on it "
                                   "or give offload's path= another drive.") from e

    def read_state(self, unit, buf: torch.Tensor) -> torch.Tensor:
        """The unit's master|m|v into ``buf`` (the step never needs the old compute shard)."""
        self._io(os.preadv, "reading", unit, as_bytes(buf)[:state_bytes(unit, self.form)],
                 self.offset[unit])
        return buf

    def read_block(self, unit, buf: torch.Tensor) -> None:
        self._io(os.preadv, "reading", unit, as_bytes(buf)[:self.block[unit]], self.offset[unit])

    def write_block(self, unit, buf: torch.Tensor) -> None:
        """The whole block: state, and the compute shard where the file holds one."""
        self._io(os.pwritev, "writing", unit, as_bytes(buf)[:self.block[unit]],
                 self.offset[unit])

    def read_param(self, unit, buf: torch.Tensor) -> torch.Tensor:
        start = state_bytes(unit, self.form)
        self._io(os.preadv, "reading", unit, as_bytes(buf)[:self.block[unit] - start],
                 self.offset[unit] + start)
        return buf.view(self.params[unit])[:unit.shard_numel]

    def _io(self, call, doing: str, unit, view: memoryview, offset: int) -> None:
        """``call(fd, [view], offset)`` in full, or an OSError naming the file, the unit,
        the bytes and the cause."""
        try:
            done = call(self.fd, [view], offset)
        except OSError as e:
            code, cause = e.errno, e.strerror
        else:
            if done == len(view):
                return
            code, cause = errno.EIO, f"only {done:,} bytes went through"
        raise OSError(code, f"offload('nvme'): {doing} {len(view):,} bytes of unit "
                            f"'{unit.name}' at offset {offset:,} of {self.name} failed: "
                            f"{cause}. Free space on that drive (or give offload's path= "
                            f"another one) and resume from the last checkpoint.")


def _open(name: str):
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(name, flags | getattr(os, "O_DIRECT", 0))
        probe = host_buffer(BLOCK // FLOAT, torch.float32, pin=False)
        os.pwritev(fd, [as_bytes(probe)], 0)      # some filesystems refuse only at I/O time
        return fd, bool(getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(name, flags), False


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _close_and_remove(fd: int, name: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    if os.path.exists(name):
        os.remove(name)
