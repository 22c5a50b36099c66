"""offload("nvme"): master parameters and Adam state in a swap file per rank.

[Note: bounded host memory] The file holds, per unit, master | exp_avg | exp_avg_sq. The
step streams units through ``units_in_flight`` staging buffers: while one unit steps,
the next is read ahead and the previous one written back, each by a worker thread (file
I/O releases the GIL). Host memory for optimizer state is therefore ``units_in_flight``
times the largest unit, whatever the model's size.

O_DIRECT is used where the filesystem accepts it (no page-cache copy of what is read
once per step); buffers and file offsets are aligned for it. Elsewhere I/O is buffered.

Outside the step, the optimizer's tensors for these units (its params and its
``exp_avg``/``exp_avg_sq``) point at a one-element stand-in. ``materialize`` reads the
state into memory and points them there, for state dicts; the next step writes it back.
"""
from __future__ import annotations

import atexit
import glob
import os
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .offload import HostArena, adam_unit, fused_adam_mode, groups_by_param

BLOCK = 4096                     # bytes: O_DIRECT alignment of buffers, offsets and sizes
FLOAT = 4


def _round(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


def swap_name(path: str, rank: int) -> str:
    return os.path.join(path, f"zerofn-rank{rank}-{os.getpid()}.swap")


def nvme_problems(path, need_bytes: int, optimizer) -> list[str]:
    """What stops an NVMe store at ``path``: checked on every rank before any collective."""
    if fused_adam_mode(optimizer) is None:
        return [f"offload('nvme') steps Adam and AdamW only (got {type(optimizer).__name__}); "
                "use offload('cpu') for other optimizers."]
    if not path:
        return ["offload('nvme') needs path=, a directory on the NVMe drive."]
    if not os.path.isdir(path):
        return [f"offload('nvme'): {path!r} is not an existing directory; create it first."]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"offload('nvme'): cannot write to {path!r}; choose a writable directory."]
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        return [f"offload('nvme'): {path!r} has {free / 2**30:.2f} GiB free, the swap file needs "
                f"{need_bytes / 2**30:.2f} GiB; free space or choose another drive."]
    return []


def remove_stale(path: str, rank: int) -> None:
    """Swap files of this rank left by processes that no longer run (killed runs)."""
    for name in glob.glob(os.path.join(path, f"zerofn-rank{rank}-*.swap")):
        pid = int(name.rsplit("-", 1)[1].split(".")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.remove(name)
        except PermissionError:
            pass   # alive, someone else's


class NvmeOffload:
    def __init__(self, units, optimizer, path: str, rank: int, in_flight: int, grad_dtype_of):
        self.adamw_mode = fused_adam_mode(optimizer)
        self.grads, self._arenas = {}, []
        for dtype in {grad_dtype_of(u) for u in units}:
            mine = [u for u in units if grad_dtype_of(u) == dtype]
            arena = HostArena([u.shard_numel for u in mine], dtype)
            self.grads.update({u: arena.take(u.shard_numel) for u in mine})
            self._arenas.append(arena)
        self.units = units
        self.offset, size = {}, 0
        for u in units:
            self.offset[u] = size
            size += _round(3 * u.shard_numel * FLOAT)
        remove_stale(path, rank)
        self.name = swap_name(path, rank)
        self.fd, self.direct = _open(self.name)
        os.posix_fallocate(self.fd, 0, max(size, BLOCK))
        self._cleanup = weakref.finalize(self, _close_and_remove, self.fd, self.name)
        atexit.register(self._cleanup)
        biggest = max((u.shard_numel for u in units), default=0)
        self.staging = [_aligned_buffer(3 * biggest) for _ in range(in_flight)]
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerofn-nvme")
        self.resident: dict = {}          # unit -> flat master|m|v while materialized
        self.file_bytes = size

    def arenas(self) -> list:
        return self._arenas

    def host_state_bytes(self) -> int:
        """Optimizer state in host memory outside state-dict access: the staging ring."""
        return sum(b.numel() * FLOAT for b in self.staging)

    # -- raw I/O ---------------------------------------------------------------------
    def _read(self, unit, buf: torch.Tensor) -> torch.Tensor:
        n = _round(3 * unit.shard_numel * FLOAT)
        os.preadv(self.fd, [_bytes(buf)[:n]], self.offset[unit])
        return buf[:3 * unit.shard_numel]

    def _write(self, unit, buf: torch.Tensor) -> None:
        n = _round(3 * unit.shard_numel * FLOAT)
        os.pwritev(self.fd, [_bytes(buf)[:n]], self.offset[unit])

    def write_initial(self, unit, master: torch.Tensor) -> None:
        buf = self.staging[0]
        buf.zero_()
        buf[:unit.shard_numel].copy_(master)
        self._write(unit, buf)

    # -- the step --------------------------------------------------------------------
    def step(self, optimizer, grads: dict, after_unit) -> None:
        """Adam over every unit, streamed; ``after_unit(unit, master)`` refreshes the compute
        params from the updated master while it is in memory."""
        self.evict()
        units = [u for u in self.units if u.slots]
        group_of = groups_by_param(optimizer)
        ring = len(self.staging)
        writes = [None] * ring
        reads = {}

        def start_read(i: int) -> None:
            if writes[i % ring] is not None:
                writes[i % ring].result()      # that buffer's write-back must finish first
            reads[i] = self.io.submit(self._read, units[i], self.staging[i % ring])

        for i, unit in enumerate(units):
            if i not in reads:
                start_read(i)
            flat = reads.pop(i).result()
            if ring > 1 and i + 1 < len(units):
                start_read(i + 1)              # read ahead while this unit steps
            master, m, v = flat.view(3, unit.shard_numel)
            adam_unit(optimizer, group_of, unit, grads, master, m, v, self.adamw_mode)
            after_unit(unit, master)
            writes[i % ring] = self.io.submit(self._write, unit, self.staging[i % ring])
        for w in writes:
            if w is not None:
                w.result()

    # -- state dicts -------------------------------------------------------------------
    def register_state(self, optimizer) -> None:
        trainable = [s for u in self.units for s in u.trainable]
        steps = HostArena([1] * (len(trainable) + 1), torch.float32)   # host, not device
        self._arenas.append(steps)
        self._stand_in = steps.take(1)
        for s in trainable:
            optimizer.state[s.opt_param] = {"step": steps.take(1).view(()),
                                            "exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}
        self._point(optimizer, None)

    def materialize(self, optimizer) -> None:
        """Read every unit into memory and point the optimizer's tensors at it."""
        if self.resident:
            return
        for u in self.units:
            buf = _aligned_buffer(3 * u.shard_numel)
            self.resident[u] = self._read(u, buf).view(3, u.shard_numel)
        self._point(optimizer, self.resident)
        self._optimizer = optimizer

    def evict(self) -> None:
        """Write materialized state back (it may have been loaded into) and let it go."""
        if not self.resident:
            return
        for u, flat in self.resident.items():
            buf = self.staging[0]
            buf[:flat.numel()].copy_(flat.view(-1))
            self._write(u, buf)
        self._point(self._optimizer, None)
        self.resident = {}

    def _point(self, optimizer, flats) -> None:
        for u in self.units:
            for s in u.slots:
                views = [s.shard_of(f) for f in flats[u]] if flats else [None] * 3
                _set(s.opt_param, views[0], s.local_shape, self._stand_in)
                state = optimizer.state.get(s.opt_param)
                if state:
                    _set(state["exp_avg"], views[1], s.local_shape, self._stand_in)
                    _set(state["exp_avg_sq"], views[2], s.local_shape, self._stand_in)


def _set(t: torch.Tensor, view, shape, stand_in) -> None:
    """Point ``t`` (keeping its identity, which the optimizer keys on) at ``view``'s memory,
    or at a one-element stand-in with stride 0."""
    with torch.no_grad():
        if view is None:
            t.set_(stand_in.untyped_storage(), 0, shape, [0] * len(shape))
        else:
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _open(name: str):
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(name, flags | getattr(os, "O_DIRECT", 0))
        probe = _aligned_buffer(BLOCK // FLOAT)
        os.pwritev(fd, [_bytes(probe)], 0)      # some filesystems refuse only at I/O time
        return fd, bool(getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(name, flags), False


def _aligned_buffer(numel: int) -> torch.Tensor:
    """A zeroed fp32 buffer whose address and byte size are multiples of BLOCK."""
    n = _round(max(numel, 1) * FLOAT) // FLOAT
    raw = torch.zeros(n + BLOCK // FLOAT, dtype=torch.float32)
    skip = (-raw.data_ptr() % BLOCK) // FLOAT
    return raw[skip:skip + n]


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _close_and_remove(fd: int, name: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    if os.path.exists(name):
        os.remove(name)
