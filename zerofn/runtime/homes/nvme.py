"""offload("nvme"): master parameters and Adam state in a swap file per rank.

[Note: bounded host memory] The file holds, per unit, master | exp_avg | exp_avg_sq and,
under ZeRO-3 parameter offload, the unit's compute shard after them. The step streams
units through ``units_in_flight`` staging buffers: while one unit steps, the next is read
ahead and the previous one written back (with its refreshed compute shard), each by a
worker thread (file I/O releases the GIL). Host memory for optimizer state and parameter
shards is therefore ``units_in_flight`` times the largest unit, whatever the model's size.

[Note: parameter shards on NVMe] Between steps ZeRO-3's compute shards exist only in the
file: the unit's compute shard (``table[unit].shard``) and the registered DTensors' local
tensors point at a one-element stand-in. ``ParamReads`` reads each shard into the same staging ring (idle outside the
step) just before its gather, ahead of use in the gatherer's order.

[Note: compute rows in the ring] Where the compute dtype is not the masters' fp32 (mixed
precision), the kernel writes each unit's updated rows in that dtype too, past the state
in its staging buffer (where a parameter-offloaded unit's compute shard lies in its
block), and they go to the device from there: a copy that also casts would cast on the
host into pageable memory, holding the step until it is done, and move fp32 across PCIe.
Rows the kernel does not write (parameters without a gradient, frozen ones, padding) are
cast from the master after it.

The file itself, its block layout and checked I/O are nvme_file.py's.

Outside the step, the optimizer's tensors for these units (its params and its
``exp_avg``/``exp_avg_sq``) point at a one-element stand-in. ``materialize`` reads the
state (and parameter shards) into memory and points them there, for state dicts; the next
step writes it back.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..pinned import host_buffer, pins
from ..chain import members_of
from ..owned import is_whole
from .adam import adam_unit, cast_the_rest, groups_by_param
from ...core.units import local_of
from .base import HomeSpec, HostArena, Home, decoupled_weight_decay, device_of, point_at, stand_in
from .nvme_file import FLOAT, FP32, SwapFile, block_bytes, state_bytes
from .stored import StoredForm
from .param_reads import ParamReads


class NvmeHome(Home):
    """Adam/AdamW state and fp32 masters in a swap file, streamed through a staging ring;
    gradients land in host buffers. See the module notes."""

    kind = "nvme"

    cpu_adam = True      # (set-up refuses other optimizers but whole-tensor ones beside it)
    time_series = ("d2h", "h2d", "cpu_adam", "nvme_read", "nvme_write")

    def __init__(self, units, spec: HomeSpec, form: StoredForm = FP32):
        grad_dtype_of, policy = spec.grad_dtype, spec.policy
        path, rank, in_flight = policy.path, spec.rank, policy.units_in_flight
        param_dtypes = {u: dt for u, dt in spec.param_dtypes.items() if u in units}
        self.timing = spec.timing     # (its I/O threads use its host clock)
        self.table = spec.table
        self.decoupled = True         # (AdamW's, until bind finds the optimizer)
        pin = pins(device_of(units))     # what the device reads and writes is page-locked
        self.grads, self._arenas = {}, []
        for dtype in {grad_dtype_of(u) for u in units}:
            mine = [u for u in units if grad_dtype_of(u) == dtype]
            arena = HostArena([u.shard_numel for u in mine], dtype, pin)
            self.grads.update({u: arena.take(u.shard_numel) for u in mine})
            self._arenas.append(arena)
        self.units = units
        self.params = dict(param_dtypes or {})   # unit -> compute dtype of its shard in the file
        self.form = form                          # how masters and moments are stored
        self.file = SwapFile(path, rank, units, self.params, form)
        # [Note: compute rows in the ring]: past the state, as a parameter shard lies.
        dtypes = {u: u.compute_dtype for u in units if u.slots and u not in self.params}
        self.ring_rows = {u: dt for u, dt in dtypes.items() if dt != form.master_dtype_of(u)}
        biggest = max([*self.file.block.values(),
                       *(block_bytes(u, dt, form) for u, dt in self.ring_rows.items())],
                      default=0)
        # Page-aligned and a multiple of BLOCK long, for O_DIRECT; pinned for the device.
        self.staging = [host_buffer(biggest // FLOAT, torch.float32, pin)
                        for _ in range(in_flight)]
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerofn-nvme")
        self.resident: dict = {}          # unit -> flat master|m|v while materialized
        self._resident_blocks: dict = {}  # unit -> the aligned block buffer behind it
        stand_ins = {dt: HostArena([1], dt) for dt in set(self.params.values())}
        self._arenas += stand_ins.values()
        self._param_stand_in = {dt: a.take(1) for dt, a in stand_ins.items()}
        filler = HostArena([1], torch.float32)      # what unread masters and state point at
        self._arenas.append(filler)
        self._stand_in = filler.take(1)
        self._optimizer = None
        self.param_reader = ParamReads(self) if self.params else None
        # [Note: owned rows in the file] The slots CPU Adam steps (its state is in the
        # file); a whole-tensor optimizer's (owned.py) keep only their masters' rows here,
        # and its updated rows wait in ``pending`` (host memory) for the streamed step to
        # write them into their unit's block.
        self.adam_slots: set = set()
        self.pending: dict = {}
        self.torch_math = False     # (adam.py: beside a whole-tensor optimizer)

    def arenas(self) -> list:
        return self._arenas

    def exact_dtypes(self, unit) -> tuple[torch.dtype, torch.dtype]:
        return self.form.exact_dtypes()

    def unseen_bytes(self) -> dict[str, dict[str, int]]:
        """The file, and the part of the staging ring standing for each of its roles."""
        ring = sum(b.numel() * FLOAT for b in self.staging)
        param_part = max((self.file.block[u] - state_bytes(u, self.form) for u in self.params),
                         default=0) * len(self.staging)
        return {"nvme": {"optimizer": self.file.size - self.file.param_bytes,
                         "params": self.file.param_bytes},
                "host": {"optimizer": ring - param_part, "params": param_part}}

    # -- I/O, timed --------------------------------------------------------------------
    def _read(self, unit, buf: torch.Tensor) -> torch.Tensor:
        with self.timing.span("nvme_read", "nvme_read", unit.name):
            return self.file.read_state(unit, buf)

    def _write(self, unit, buf: torch.Tensor) -> None:
        with self.timing.span("nvme_write", "nvme_write", unit.name):
            self.file.write_block(unit, buf)

    def read_param(self, unit, buf: torch.Tensor) -> torch.Tensor:
        with self.timing.span("nvme_read", "nvme_read", unit.name):
            return self.file.read_param(unit, buf)

    def _compute_part(self, unit, buf: torch.Tensor) -> torch.Tensor | None:
        """Where the compute shard lies in a buffer laid out like the unit's block (for
        units without one in the file, where the step writes its compute rows); None
        where the masters are the compute rows."""
        dtype = self.params.get(unit) or self.ring_rows.get(unit)
        if dtype is None:
            return None
        start = state_bytes(unit, self.form)
        return buf.view(torch.uint8)[start:].view(dtype)[:unit.shard_numel]

    # -- set-up ------------------------------------------------------------------------
    def place_masters(self, unit, keep: bool) -> torch.Tensor | None:
        """The rows go to the file; the optimizer's tensors are stand-ins until read
        (``_point``). The rows are returned only where ``keep`` asks for them."""
        dtype = self._face(unit)
        master = torch.zeros(unit.shard_numel, dtype=dtype)
        for s in unit.slots:
            s.shard_of(master).copy_(s.rows_of(local_of(s.param).detach()))
            self.table[s].opt_param = stand_in(s.local_shape, dtype)
        buf = self.staging[0]
        buf.zero_()
        state = self.form.views(unit, buf)
        state.master.copy_(master)
        self.form.zero(state)
        if unit in self.params:
            self._compute_part(unit, buf).copy_(master)
        self._write(unit, buf)
        return master if keep else None

    def param_shard(self, unit, dtype: torch.dtype) -> torch.Tensor:
        """The shard is in the file (``place_masters``); what stands for it in memory is
        the stand-in, so the DTensors built on it hold no data."""
        return self._param_stand_in[dtype].expand(unit.shard_numel)

    def updated_rows(self, unit) -> torch.Tensor | None:
        """Materialized for a load: from memory; else the step refreshed them already."""
        return self.resident[unit][0] if unit in self.resident else None

    # -- the step --------------------------------------------------------------------
    def step(self, optimizer, grads: dict, after_unit, grad_scale: float = 1.0,
             copies=None, early=None) -> None:
        """Adam over every unit, streamed; ``after_unit(unit, master)`` refreshes the compute
        params from the updated master while it is in memory, and the copy that refresh
        started is waited for (``copies``) before its buffer is read into again. Gradients
        are multiplied by ``grad_scale`` (unscale x clip) in the kernel."""
        if self.param_reader is not None:
            self.param_reader.forget()          # the ring is ours again; the file changes now
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
                if copies is not None:
                    copies.before_host_write(units[i - ring])

        def start_read(i: int) -> None:
            release(i)
            reads[i] = self.io.submit(self._read, units[i], self.staging[i % ring])

        for i, unit in enumerate(units):
            if i not in reads:
                start_read(i)
            buf = reads.pop(i).result()
            if ring > 1 and i + 1 < len(units):
                start_read(i + 1)              # read ahead while this unit steps
            state = self.form.views(unit, buf)
            master = state.master
            for s in unit.slots:
                if s in self.pending:
                    s.shard_of(master).copy_(self.pending.pop(s))
            rows = self._compute_part(unit, buf)
            lowp = rows if rows is not None and rows.dtype != master.dtype else None
            options = (lambda s, st=state: self.form.kernel_options(st, s)) \
                if self.form.lowp else None
            written = adam_unit(optimizer, group_of, unit, grads, master, state.exp_avg,
                                state.exp_avg_sq, self.decoupled, lowp=lowp,
                                grad_scale=grad_scale, timing=self.timing, options=options,
                                torch_math=self.torch_math, table=self.table)
            if rows is not None:       # (an fp32 compute shard: all of it)
                cast_the_rest(rows, master, written if lowp is not None else [])
            self._refresh(unit, master if rows is None else rows, after_unit)
            writes[i % ring] = self.io.submit(self._write, unit, self.staging[i % ring])
        for i in range(len(units), len(units) + ring):   # the ring is idle again after
            release(i)
        if self.param_reader is not None:
            self.param_reader.resume()

    def _refresh(self, unit, rows: torch.Tensor, after_unit) -> None:
        """Under parameter offload the compute shard ``after_unit`` refreshes is the block's
        own part of the staging buffer (``rows``), written back to the file with the
        state."""
        if unit in self.params:
            self.table[unit].shard = rows
        after_unit(unit, rows)
        if unit in self.params:
            self.table[unit].shard = self.param_shard(unit, self.params[unit])

    # -- state dicts -------------------------------------------------------------------
    def write_rows(self, unit, slot, rows: torch.Tensor) -> None:
        """[Note: owned rows in the file] Into the materialized block, or held until the
        step streams ``unit`` through the ring."""
        if self.resident:
            self.table[slot].opt_param.copy_(rows)
        else:
            self.pending[slot] = rows.to("cpu", copy=True)

    def bind(self, optimizer) -> None:
        """The swap file's state is Adam's (set-up refuses another optimizer beside
        whole-tensor ones: homes/__init__.py's ``optimizer_problems``): the optimizer's
        state tensors are stand-ins until read. A whole-tensor optimizer's parameters keep
        their masters here and their state with it (owned.py)."""
        adam = [m for m in members_of(optimizer) if not is_whole(m)]
        self.decoupled = decoupled_weight_decay(adam[0]) if adam else True
        self.torch_math = len(adam) < len(members_of(optimizer))
        held = {p for m in adam for g in m.param_groups for p in g["params"]}
        self.adam_slots = {s for u in self.units for s in u.trainable
                           if self.table[s].opt_param in held}
        steps = HostArena([1] * len(self.adam_slots), torch.float32)   # host, not device
        self._arenas.append(steps)
        for u in self.units:
            face = self._face(u)
            for s in u.trainable:
                if s not in self.adam_slots:
                    continue
                optimizer.state[self.table[s].opt_param] = {
                    "step": steps.take(1).view(()), "exp_avg": torch.empty(0, dtype=face),
                    "exp_avg_sq": torch.empty(0, dtype=face)}
        self._point(optimizer, None)

    def forget_state(self) -> None:
        """Each unit's moments in the file at zero, a unit at a time through the ring."""
        self.evict()
        buf = self.staging[0]
        for u in self.units:
            self.file.read_block(u, buf)        # (the whole block: a parameter shard too)
            self.form.zero(self.form.views(u, buf))
            self._write(u, buf)

    def materialize(self, optimizer) -> None:
        """Read every unit into memory and point the optimizer's tensors (and the parameter
        shards) at it."""
        if self.resident:
            return
        for u in self.units:
            buf = host_buffer(self.file.block[u] // FLOAT, torch.float32, pin=False)
            self.file.read_block(u, buf)
            self._resident_blocks[u] = buf
            self.resident[u] = self._decoded(u, buf)
            if u in self.params:
                self._show_params(u, self._compute_part(u, buf))
        self._point(optimizer, self.resident)
        self._optimizer = optimizer

    def unread(self, unit) -> bool:
        return not self.resident

    def read_unit(self, unit):
        """The unit's state read from the file into a buffer of its own (decoded where
        stored in fewer bits); the staging ring, the step's, is not touched."""
        buf = host_buffer(self.file.block[unit] // FLOAT, torch.float32, pin=False)
        return tuple(self._decoded(unit, self.file.read_state(unit, buf)))

    def evict(self) -> None:
        """Write materialized state back (it may have been loaded into) and let it go."""
        if not self.resident:
            return
        for u, buf in self._resident_blocks.items():
            if self.form.lowp:      # (fp32 state was loaded into the block itself)
                self.form.encode(u, self.form.views(u, buf), self.resident[u], masters=True)
            self._write(u, buf)
            if u in self.params:
                self._show_params(u, None)
        self._point(self._optimizer, None)
        self.resident, self._resident_blocks = {}, {}

    def _face(self, unit) -> torch.dtype:
        """The dtype the optimizer sees the unit's masters and moments in: fp32 for state in
        fewer bits, else the dtype they are stored in (the parameters')."""
        return torch.float32 if self.form.lowp else self.form.master_dtype_of(unit)

    def _decoded(self, unit, buf: torch.Tensor):
        """The unit's master, exp_avg and exp_avg_sq as the optimizer shows them: views of
        the block where they are stored at full precision (the unit's dtype), else decoded
        into fp32 (stored.py)."""
        if not self.form.lowp:
            st = self.form.views(unit, buf)
            return st.master, st.exp_avg, st.exp_avg_sq
        flat = torch.zeros(3, unit.shard_numel)
        self.form.decode(unit, self.form.views(unit, buf), flat, masters=True)
        return flat

    def _show_params(self, unit, flat) -> None:
        """Point the unit's compute shard and its registered DTensors at ``flat``, or back
        at the stand-in."""
        filler = self._param_stand_in[self.params[unit]]
        self.table[unit].shard = self.param_shard(unit, self.params[unit]) \
            if flat is None else flat
        for s in unit.slots:
            point_at(self.table[s].sharded._local_tensor,
                     None if flat is None else s.shard_of(flat), s.local_shape, filler)

    def _point(self, optimizer, flats) -> None:
        for u in self.units:
            for s in u.slots:
                views = [s.shard_of(f) for f in flats[u]] if flats else [None] * 3
                point_at(self.table[s].opt_param, views[0], s.local_shape, self._stand_in)
                state = optimizer.state.get(self.table[s].opt_param) \
                    if optimizer is not None and s in self.adam_slots else None
                if state:
                    point_at(state["exp_avg"], views[1], s.local_shape, self._stand_in)
                    point_at(state["exp_avg_sq"], views[2], s.local_shape, self._stand_in)
