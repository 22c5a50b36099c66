"""offload("nvme"): master parameters and Adam state in a swap file per rank.

[Note: bounded host memory] The file holds, per unit, master | exp_avg | exp_avg_sq and,
under ZeRO-3 parameter offload, the unit's compute shard after them. The step streams
units through ``units_in_flight`` staging buffers: while one unit steps, the next is read
ahead and the previous one written back (with its refreshed compute shard), each by a
worker thread (file I/O releases the GIL). Host memory for optimizer state and parameter
shards is therefore ``units_in_flight`` times the largest unit, whatever the model's size.

[Note: parameter shards on NVMe] Between steps ZeRO-3's compute shards exist only in the
file: ``unit.shard`` and the registered DTensors' local tensors point at a one-element
stand-in. ``ParamReads`` reads each shard into the same staging ring (idle outside the
step) just before its gather, ahead of use in the gatherer's order.

[Note: compute rows in the ring] Where the compute dtype is not the masters' fp32 (mixed
precision), the kernel writes each unit's updated rows in that dtype too, past the state
in its staging buffer (where a parameter-offloaded unit's compute shard lies in its
block), and they go to the device from there: a copy that also casts would cast on the
host into pageable memory, holding the step until it is done, and move fp32 across PCIe.
Rows the kernel does not write (parameters without a gradient, frozen ones, padding) are
cast from the master after it.

O_DIRECT is used where the filesystem accepts it (no page-cache copy of what is read
once per step); buffers and file offsets are aligned for it. Elsewhere I/O is buffered.

Outside the step, the optimizer's tensors for these units (its params and its
``exp_avg``/``exp_avg_sq``) point at a one-element stand-in. ``materialize`` reads the
state (and parameter shards) into memory and points them there, for state dicts; the next
step writes it back.
"""
from __future__ import annotations

import atexit
import errno
import glob
import itertools
import os
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .offload import HostArena, adam_unit, device_of, fused_adam_mode, groups_by_param
from .pinned import host_buffer, pins
from .timing import UNTIMED

BLOCK = 4096                     # bytes: O_DIRECT alignment of buffers, offsets and sizes
FLOAT = 4


def _round(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


def swap_name(path: str, rank: int) -> str:
    return os.path.join(path, f"zerofn-rank{rank}-{os.getpid()}.swap")


def block_bytes(unit, param_dtype: torch.dtype | None = None) -> int:
    """A unit's region of the swap file: master | exp_avg | exp_avg_sq, then its compute
    shard in ``param_dtype`` under parameter offload; each part aligned for O_DIRECT."""
    return _state_bytes(unit) + (_round(unit.shard_numel * param_dtype.itemsize) if param_dtype else 0)


def _state_bytes(unit) -> int:
    return _round(3 * unit.shard_numel * FLOAT)


def swap_bytes(units, param_dtypes: dict) -> int:
    return sum(block_bytes(u, param_dtypes.get(u)) for u in units)


def nvme_problems(path, need_bytes: int, optimizer, units=()) -> list[str]:
    """What stops an NVMe store at ``path``: checked on every rank before any collective."""
    if fused_adam_mode(optimizer) is None:
        return [(f"offload('nvme') steps Adam and AdamW only (got {type(optimizer).__name__}); "
                 "use offload('cpu') for other optimizers.")]
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
        return [(f"offload('nvme'): {path!r} has {free / 2**30:.2f} GiB free, the swap file "
                 f"needs {need_bytes / 2**30:.2f} GiB; free space or choose another drive.")]
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
    timing = UNTIMED     # runtime/timing.py (I/O threads use its host clock)

    def __init__(self, units, optimizer, path: str, rank: int, in_flight: int, grad_dtype_of,
                 param_dtypes: dict | None = None, compute_dtype: torch.dtype | None = None):
        self.adamw_mode = fused_adam_mode(optimizer)
        pin = pins(device_of(units))     # what the device reads and writes is page-locked
        self.grads, self._arenas = {}, []
        for dtype in {grad_dtype_of(u) for u in units}:
            mine = [u for u in units if grad_dtype_of(u) == dtype]
            arena = HostArena([u.shard_numel for u in mine], dtype, pin)
            self.grads.update({u: arena.take(u.shard_numel) for u in mine})
            self._arenas.append(arena)
        self.units = units
        self.params = dict(param_dtypes or {})   # unit -> compute dtype of its shard in the file
        self.block = {u: block_bytes(u, self.params.get(u)) for u in units}
        self.offset, size = {}, 0
        for u in units:
            self.offset[u] = size
            size += self.block[u]
        remove_stale(path, rank)
        self.name = swap_name(path, rank)
        self.fd, self.direct = _open(self.name)
        os.posix_fallocate(self.fd, 0, max(size, BLOCK))
        self._cleanup = weakref.finalize(self, _close_and_remove, self.fd, self.name)
        atexit.register(self._cleanup)
        # [Note: compute rows in the ring]: past the state, as a parameter shard lies.
        dtypes = {u: compute_dtype or u.dtype for u in units if u.slots and u not in self.params}
        self.lowp = {u: dt for u, dt in dtypes.items() if dt != torch.float32}
        biggest = max([*self.block.values(),
                       *(block_bytes(u, dt) for u, dt in self.lowp.items())], default=0)
        # Page-aligned and a multiple of BLOCK long, for O_DIRECT; pinned for the device.
        self.staging = [host_buffer(biggest // FLOAT, torch.float32, pin)
                        for _ in range(in_flight)]
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerofn-nvme")
        self.resident: dict = {}          # unit -> flat master|m|v while materialized
        self._resident_blocks: dict = {}  # unit -> the aligned block buffer behind it
        self.file_bytes = size
        self.param_file_bytes = sum(self.block[u] - _state_bytes(u) for u in self.params)
        stand_ins = {dt: HostArena([1], dt) for dt in set(self.params.values())}
        self._arenas += stand_ins.values()
        self._param_stand_in = {dt: a.take(1) for dt, a in stand_ins.items()}
        self.param_reads = ParamReads(self) if self.params else None

    def arenas(self) -> list:
        return self._arenas

    def host_param_bytes(self) -> int:
        """The part of the staging ring that holds parameter shards."""
        part = max((self.block[u] - _state_bytes(u) for u in self.params), default=0)
        return part * len(self.staging)

    def host_state_bytes(self) -> int:
        """Optimizer state in host memory outside state-dict access: the rest of the ring."""
        return sum(b.numel() * FLOAT for b in self.staging) - self.host_param_bytes()

    # -- raw I/O ---------------------------------------------------------------------
    def _read(self, unit, buf: torch.Tensor) -> torch.Tensor:
        """The unit's master|m|v (the step never needs the old compute shard)."""
        with self.timing.span("nvme_read", "nvme_read", unit.name):
            self._io(os.preadv, "reading", unit, _bytes(buf)[:_state_bytes(unit)],
                     self.offset[unit])
        return buf[:3 * unit.shard_numel]

    def _write(self, unit, buf: torch.Tensor) -> None:
        """The whole block: state, and the compute shard where the file holds one."""
        with self.timing.span("nvme_write", "nvme_write", unit.name):
            self._io(os.pwritev, "writing", unit, _bytes(buf)[:self.block[unit]],
                     self.offset[unit])

    def _io(self, call, doing: str, unit, view: memoryview, offset: int) -> None:
        """``call(fd, [view], offset)`` in full, or an OSError naming the file, the unit,
        the bytes and the cause: a full or failing drive must stop the run, never leave
        a block half-written (a short count is no error to the OS) to be read back."""
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

    def read_param(self, unit, buf: torch.Tensor) -> torch.Tensor:
        start = _state_bytes(unit)
        with self.timing.span("nvme_read", "nvme_read", unit.name):
            os.preadv(self.fd, [_bytes(buf)[:self.block[unit] - start]],
                      self.offset[unit] + start)
        return buf.view(self.params[unit])[:unit.shard_numel]

    def _compute_part(self, unit, buf: torch.Tensor) -> torch.Tensor | None:
        """Where the compute shard lies in a buffer laid out like the unit's block (for
        units without one in the file, where the step writes its compute rows); None
        where the masters are the compute rows."""
        dtype = self.params.get(unit) or self.lowp.get(unit)
        if dtype is None:
            return None
        return buf[_state_bytes(unit) // FLOAT:].view(dtype)[:unit.shard_numel]

    def write_initial(self, unit, master: torch.Tensor) -> None:
        buf = self.staging[0]
        buf.zero_()
        buf[:unit.shard_numel].copy_(master)
        if unit in self.params:
            self._compute_part(unit, buf).copy_(master)
        self._write(unit, buf)

    def param_shard(self, unit, dtype: torch.dtype) -> torch.Tensor:
        """ZeRO-3 parameter offload: the shard is in the file (``write_initial``); what
        stands for it in memory is the stand-in, so the DTensors built on it hold no data."""
        return self._param_stand_in[dtype].expand(unit.shard_numel)

    # -- the step --------------------------------------------------------------------
    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copied=None) -> None:
        """Adam over every unit, streamed; ``after_unit(unit, master)`` refreshes the compute
        params from the updated master while it is in memory, and ``copied(unit)`` waits
        for any asynchronous copy that refresh started, before its buffer is read into
        again. Gradients are multiplied by ``grad_scale`` (unscale x clip) in the kernel."""
        if self.param_reads is not None:
            self.param_reads.forget()          # the ring is ours again; the file changes now
        self.evict()
        units = [u for u in self.units if u.slots]
        group_of = groups_by_param(optimizer)
        ring = len(self.staging)
        writes = [None] * ring
        reads = {}

        def release(i: int) -> None:
            """Buffer ``i % ring``'s last unit is written back and copied to the device."""
            if writes[i % ring] is not None:
                writes[i % ring].result()
                writes[i % ring] = None
                if copied is not None:
                    copied(units[i - ring])

        def start_read(i: int) -> None:
            release(i)
            reads[i] = self.io.submit(self._read, units[i], self.staging[i % ring])

        for i, unit in enumerate(units):
            if i not in reads:
                start_read(i)
            flat = reads.pop(i).result()
            if ring > 1 and i + 1 < len(units):
                start_read(i + 1)              # read ahead while this unit steps
            master, m, v = flat.view(3, unit.shard_numel)
            rows = self._compute_part(unit, self.staging[i % ring])
            lowp = rows if rows is not None and rows.dtype != master.dtype else None
            written = adam_unit(optimizer, group_of, unit, grads, master, m, v,
                                self.adamw_mode, lowp=lowp, grad_scale=grad_scale,
                                timing=self.timing)
            if rows is not None:       # (an fp32 compute shard: all of it)
                _cast_the_rest(rows, master, written if lowp is not None else [])
            self._refresh(unit, master if rows is None else rows, after_unit)
            writes[i % ring] = self.io.submit(self._write, unit, self.staging[i % ring])
        for i in range(len(units), len(units) + ring):   # the ring is idle again after
            release(i)
        if self.param_reads is not None:
            self.param_reads.resume()

    def _refresh(self, unit, rows: torch.Tensor, after_unit) -> None:
        """Under parameter offload the compute shard ``after_unit`` refreshes is the block's
        own part of the staging buffer (``rows``), written back to the file with the
        state."""
        if unit in self.params:
            unit.shard = rows
        after_unit(unit, rows)
        if unit in self.params:
            unit.shard = self.param_shard(unit, self.params[unit])

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
        """Read every unit into memory and point the optimizer's tensors (and the parameter
        shards) at it."""
        if self.resident:
            return
        for u in self.units:
            buf = host_buffer(self.block[u] // FLOAT, torch.float32, pin=False)
            os.preadv(self.fd, [_bytes(buf)[:self.block[u]]], self.offset[u])
            self._resident_blocks[u] = buf
            self.resident[u] = buf[:3 * u.shard_numel].view(3, u.shard_numel)
            if u in self.params:
                self._show_params(u, self._compute_part(u, buf))
        self._point(optimizer, self.resident)
        self._optimizer = optimizer

    def evict(self) -> None:
        """Write materialized state back (it may have been loaded into) and let it go."""
        if not self.resident:
            return
        for u, buf in self._resident_blocks.items():
            self._write(u, buf)
            if u in self.params:
                self._show_params(u, None)
        self._point(self._optimizer, None)
        self.resident, self._resident_blocks = {}, {}

    def _show_params(self, unit, flat) -> None:
        """Point the unit's compute shard and its registered DTensors at ``flat``, or back
        at the stand-in."""
        stand_in = self._param_stand_in[self.params[unit]]
        unit.shard = self.param_shard(unit, self.params[unit]) if flat is None else flat
        for s in unit.slots:
            _set(s.sharded._local_tensor, None if flat is None else s.shard_of(flat),
                 s.local_shape, stand_in)

    def _point(self, optimizer, flats) -> None:
        for u in self.units:
            for s in u.slots:
                views = [s.shard_of(f) for f in flats[u]] if flats else [None] * 3
                _set(s.opt_param, views[0], s.local_shape, self._stand_in)
                state = optimizer.state.get(s.opt_param)
                if state:
                    _set(state["exp_avg"], views[1], s.local_shape, self._stand_in)
                    _set(state["exp_avg_sq"], views[2], s.local_shape, self._stand_in)


class ParamReads:
    """ZeRO-3 parameter shards read from the swap file just before their gathers, into the
    staging ring (idle outside the step), up to ``units_in_flight`` of them ahead of use.

    ``read_ahead`` names the units to come, in order; each buffer that frees up goes to the
    next of them, so reading runs ahead of the gathers for as long as the guess holds.

    A lent buffer may still be read by an asynchronous copy to the device after it is
    given back: ``take``'s ``copied`` waits for that copy, and runs before the buffer is
    read into again."""

    def __init__(self, store: NvmeOffload):
        self.store = store
        self.free = [(b, None) for b in store.staging]   # (buffer, wait for its last copy)
        self.held: dict = {}                  # unit -> (buffer, future), oldest first
        self._lent = None                     # (buffer, copied) ``take`` returned last
        self._plan = iter(())

    def read_ahead(self, units) -> None:
        """Read the shards of ``units`` (an iterable, consumed lazily), replacing the plan."""
        self._settle()
        self._plan = iter(units)
        self._fill()

    def take(self, unit, copied=None) -> torch.Tensor:
        """The unit's shard on the host, valid until the next call here; ``copied()`` then
        waits for the caller's copy of it, if any, before the buffer is reused."""
        if self.store.resident:
            return unit.shard                 # may be newer than the file (a load)
        self._settle()
        if unit not in self.held:
            if not self.free:
                self._drop(next(iter(self.held)))   # a read ahead that guessed wrong
            self._start(unit)
        buf, read = self.held.pop(unit)
        self._lent = (buf, copied)
        shard = read.result()
        self._fill()
        return shard

    def forget(self) -> None:
        """Let every read go: the step is about to use the buffers and rewrite the file.
        Their units go back to the front of the plan, for ``resume``."""
        self._settle()
        dropped = list(self.held)
        for u in dropped:
            self._drop(u)
        self.free = [(buf, _waited(copied)) for buf, copied in self.free]
        self._plan = itertools.chain(dropped, self._plan)

    def resume(self) -> None:
        """After the step: read the first units of the plan (the next forward's) again."""
        self._fill()

    def _fill(self) -> None:
        while self.free and not self.store.resident:   # materialized: read from memory
            u = next(self._plan, None)
            if u is None:
                return
            if u not in self.held and u in self.store.params:
                self._start(u)

    def _start(self, unit) -> None:
        buf, copied = self.free.pop()
        _waited(copied)
        self.held[unit] = (buf, self.store.io.submit(self.store.read_param, unit, buf))

    def _settle(self) -> None:
        """The caller is done with the buffer ``take`` lent it (its copy may not be)."""
        if self._lent is not None:
            self.free.append(self._lent)
            self._lent = None

    def _drop(self, unit) -> None:
        buf, read = self.held.pop(unit)
        read.result()
        self.free.append((buf, None))


def _waited(copied) -> None:
    """Wait for a copy out of a staging buffer, if one was made (``None`` after)."""
    if copied is not None:
        copied()


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
        probe = host_buffer(BLOCK // FLOAT, torch.float32, pin=False)
        os.pwritev(fd, [_bytes(probe)], 0)      # some filesystems refuse only at I/O time
        return fd, bool(getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(name, flags), False


def _cast_the_rest(rows: torch.Tensor, master: torch.Tensor, written: list) -> None:
    """Cast ``master`` into ``rows`` (flat, of one unit) outside the ``written`` slots."""
    at = 0
    for start, end in sorted((s.offset, s.offset + s.local_numel) for s in written) + \
            [(rows.numel(), rows.numel())]:
        if start > at:
            rows[at:start].copy_(master[at:start])
        at = max(at, end)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _close_and_remove(fd: int, name: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    if os.path.exists(name):
        os.remove(name)
