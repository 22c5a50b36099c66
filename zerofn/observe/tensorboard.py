"""``zf.tensorboard``'s runtime side: the series a step writes, traces, and ``zf.log``.

The transform (``zf.tensorboard``, api.py) only sets plan options; a runtime built
from a plan that has them attaches one ``Monitor`` per rank, an observer of its events
(runtime/events.py). Every rank measures (the
slowest and fastest rank's step time need them all); the ranks in ``ranks`` write.

[Note: no waiting on quiet steps] Nothing here reads a device value except on a logging
step (every ``every``-th optimizer step) and in ``flush``. Phase times are CUDA events on
GPUs (runtime/timing.py), values passed to ``zf.log`` and the gradient norm are kept as
tensors, learning rates given as tensors are cloned, and the one collective (the ranks'
step times) runs on logging steps only. On a logging step all of them are read with one
synchronization per device.

Step attribution: a step runs from the first forward after an optimizer step to the end
of the next optimizer step. A value logged while a step runs belongs to it; a value
logged after ``opt.step()`` and before the next forward belongs to the step just
finished, so both places in a training loop give the same curve.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import resource
import weakref
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

from ..runtime.events import StepObserver
from ..runtime.timing import Timing
from .series import comm_series, environment, floats, rss
from .writers import CsvSeries, rank_dir, writing_ranks

TIME_SERIES = ("step", "forward", "backward", "optimizer", "logging", "reduce_wait",
               "gather_wait", "checkpoint_wait")
COUNTS = ("tokens", "samples")           # zf.log names that are summed, not averaged
BUILT_IN = ("lr", "grad_norm", "loss_scale", "skipped_steps", "tokens_per_s")


def monitor_problems(plan, device: torch.device, rank: int, world: int) -> list[str]:
    """What stops the plan's monitor on this rank (raised on every rank at set-up)."""
    root = plan.monitor.log_dir
    if root is None:
        return []
    ranks = plan.monitor.ranks
    if ranks != "all" and max(ranks) >= world:
        return [f"zf.tensorboard(ranks={ranks}): there are only {world} ranks (0 to "
                f"{world - 1})."]
    if plan.monitor.memory_snapshot and device.type != "cuda":
        return [f"zf.tensorboard(memory_snapshot=...) records the CUDA caching allocator, but "
                f"this model computes on {device}; drop memory_snapshot."]
    if rank not in writing_ranks(ranks, world):
        return []
    for path in filter(None, (root, plan.monitor.csv)):
        try:
            os.makedirs(rank_dir(path, ranks, rank, world), exist_ok=True)
        except OSError as e:
            return [f"zf.tensorboard(): cannot create the log directory {path!r} ({e}); "
                    f"choose a writable path."]
    return []


class Monitor(StepObserver):
    """One rank's measurements and writers; see the module's docstring."""

    preflight = staticmethod(monitor_problems)

    @staticmethod
    def attach(rt) -> "Monitor | None":
        return Monitor(rt) if rt.plan.monitor.log_dir is not None else None

    def __init__(self, rt):
        plan = rt.plan
        self.rt = rt
        self.every = plan.monitor.every
        ranks = plan.monitor.ranks
        root = plan.monitor.log_dir
        # Ranks over every rank of the layout: HSDP's replicas share shard ranks.
        self.rank, self.world = dist.get_rank(rt.group), dist.get_world_size(rt.group)
        self.writes = self.rank in writing_ranks(ranks, self.world)
        self.timing = Timing(rt.device)
        self.step = 0                    # optimizer steps finished
        self._in_step = False            # a forward ran since the last optimizer step
        self._step_start = None          # device mark
        self._written = 0                # the last step whose interval was written
        self._pending: list = []         # (step, tag, value) of per-step values
        self._counts: list = []          # (step, name, value) of zf.log's counts
        self._samples = 0.0              # written so far
        self._step_ms: dict = {}         # step -> ms, of the last interval read
        self._skipped = 0
        # on_nonfinite="skip" without loss scaling: the guard's skips, as nonfinite/skipped
        self._guarded = not plan.scales_loss() and plan.nonfinite_rule() == "skip"
        self._nonfinite = 0
        self._grad_norm = None
        self._comm: Counter = Counter()  # comm_stats summed over the interval's steps
        self._unplaced = plan.offload.ratio == "auto"     # placed after a step: written then
        self.writer = self._csv = None
        if self.writes:
            from torch.utils.tensorboard import SummaryWriter   # only where logs are written
            self.writer = SummaryWriter(rank_dir(root, ranks, self.rank, self.world))
            csv_root = plan.monitor.csv
            if csv_root:
                self._csv = CsvSeries(rank_dir(csv_root, ranks, self.rank, self.world))
            self._write_text()
        self.profiler = self._make_profiler(plan, root) if self.writes else None
        self._profiling = False
        self._snapshot = None
        if self.writes and plan.monitor.memory_snapshot:
            self._snapshot = os.path.join(root, "memory", f"rank{self.rank}.pickle")
            torch.cuda.memory._record_memory_history(
                max_entries=plan.monitor.memory_snapshot, stacks="python", device=rt.device)
        # Closed by close() (a rebuild, or exit), else when collected.
        self._closer = weakref.finalize(self, Monitor._close_refs, self.writer, self._csv)
        self._closer.atexit = False
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def _series(self) -> tuple[str, ...]:
        return TIME_SERIES + self.rt.time_series()

    # -- step boundaries: the runtime's events --------------------------------------------
    def forward_begin(self) -> None:
        if not self._in_step:
            self._in_step = True
            self._advance_profiler()
            if self._step_start is None:
                self._step_start = self.timing.device.mark()
        self.timing.begin("forward")

    def forward_end(self, raised) -> None:
        self.timing.end("forward")

    def backward_begin(self) -> None:
        if not self.timing.is_open("backward"):
            self.timing.begin("backward")
            # Queued from a final callback, the end runs after the runtime's own callback
            # (which waits for the reductions): they are part of backward.
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self.timing.end("backward")))

    def grad_norm(self, total: torch.Tensor) -> None:
        """``zf.clip_grad_norm_``'s total norm, kept for this step."""
        self._grad_norm = total.detach()

    def step_done(self) -> None:
        """The end of ``optimizer.step()``: per-step values, and the interval's series on
        logging steps."""
        rt = self.rt
        self.timing.end("optimizer")
        end = self.timing.device.mark()
        self.timing.device.add("step", self._step_start or end, end)
        self._step_start = end
        self.step += 1
        self._in_step = False
        for i, group in enumerate(rt.optimizer.param_groups):
            lr = group["lr"]
            self._pending.append((self.step, f"train/lr/group{i}",
                                  lr.detach().clone() if torch.is_tensor(lr) else lr))
        if rt.loss_scale() is not None:
            self._pending.append((self.step, "train/loss_scale", rt.loss_scale()))
        if self._grad_norm is not None:
            self._pending.append((self.step, "train/grad_norm", self._grad_norm))
            self._grad_norm = None
        self._skipped += rt.step_skipped()
        self._nonfinite += self._guarded and rt.step_skipped()
        self._comm.update(rt.comm_stats())
        if self._unplaced:
            with self._logging():
                self._write_placement()
        if self.step % self.every == 0:
            with self._logging():
                self._write(collective=True)

    def log(self, values: dict) -> None:
        step = self.step + 1 if self._in_step else self.step
        for name, value in values.items():
            if name in COUNTS:
                self._counts.append((step, name, value))
            else:
                self._pending.append((step, f"train/{name}", value))
        if 0 < step <= self._written:   # a logging step's value, logged after its write
            with self._logging():
                self._write_values()

    # -- writing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _logging(self):
        """The monitor's own time (``time/logging``): after the step's end, so it falls in
        the next step, which it does delay."""
        start = self.timing.host.mark()
        yield
        self.timing.host.add("logging", start, self.timing.host.mark())

    def _write(self, collective: bool) -> None:
        """The interval's series, if any step finished since the last write, then every
        pending per-step value. ``collective``: every rank is here (a logging step), so
        the ranks' step times can be compared."""
        if self.step > self._written:
            self._write_interval(collective)
        self._write_values()

    def _write_interval(self, collective: bool) -> None:
        steps = self.step - self._written
        self._written = self.step
        spans = self.timing.read(keep=(self._step_start,))
        ms = {series: sum(times) for series, times in spans.items()}
        self._step_ms = dict(zip(range(self.step - steps + 1, self.step + 1),
                                 spans.get("step", [])))
        calls, self.timing.calls = self.timing.calls, Counter()
        comm, self._comm = self._comm, Counter()
        step_ms = ms.get("step", 0.0) / steps
        stragglers = self._stragglers(step_ms) if collective else None
        if not self.writes:
            return
        scalars = {f"time/{s}": ms.get(s, 0.0) / steps for s in self._series}
        if stragglers is not None:
            scalars["time/step_max"], scalars["time/step_min"] = stragglers
        scalars["train/skipped_steps"] = self._skipped
        scalars["checkpoint/waits"] = self.rt.checkpoint_waits()[0]
        if self._guarded:
            scalars["nonfinite/skipped"] = self._nonfinite
        scalars.update(comm_series(comm, calls, ms, steps, self.rt.world, self.rt.replica_world))
        scalars.update(self._memory())
        for tag, value in scalars.items():
            self._scalar(tag, value, self.step)
        self._dump_snapshot()

    def _stragglers(self, step_ms: float) -> tuple[float, float]:
        """The slowest and fastest rank's mean step time: one small all-reduce."""
        t = torch.tensor([step_ms, -step_ms], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.rt.group)
        slowest, fastest = t.tolist()
        return slowest, -fastest

    def _write_values(self) -> None:
        """Every pending per-step value, read with one synchronization per device: the
        mean of a tag's values in a step; counts summed per step, as cumulative samples and
        as tokens per second of the step's time (for steps whose time is read)."""
        pending, counts = self._pending, self._counts
        self._pending, self._counts = [], []
        if not self.writes or not (pending or counts):
            return
        read = floats([v for _, _, v in pending] + [v for _, _, v in counts])
        per_step: dict = defaultdict(list)
        for (step, tag, _), value in zip(pending + counts, read):
            per_step[(step, tag)].append(value)
        for (step, tag), values in sorted(per_step.items(), key=lambda kv: kv[0][0]):
            if tag == "samples":
                self._samples += sum(values)
                self._scalar("train/samples", self._samples, step)
            elif tag == "tokens" and step in self._step_ms:
                self._scalar("train/tokens_per_s", sum(values) / self._step_ms[step] * 1e3, step)
            elif tag == "tokens":      # its step is still running: at the next write
                self._counts += [(step, "tokens", v) for v in values]
            else:
                self._scalar(tag, sum(values) / len(values), step)
        self._flush_files()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)
        if self._csv is not None:
            self._csv.add(tag, value, step)

    def _flush_files(self) -> None:
        self.writer.flush()
        if self._csv is not None:
            self._csv.flush()

    def _memory(self) -> dict[str, float]:
        from ..runtime.pinned import registered_bytes
        out = {f"memory/model_state/{place}/{role}": float(n)
               for place, roles in self.rt.model_state_bytes().items()
               for role, n in roles.items()}
        device = self.rt.device
        if device.type == "cuda":
            out["memory/device/peak_allocated"] = float(torch.cuda.max_memory_allocated(device))
            out["memory/device/peak_reserved"] = float(torch.cuda.max_memory_reserved(device))
        out["memory/host/rss"] = float(rss())
        # (the kernel updates the high-water mark lazily: it may lag the current size)
        out["memory/host/peak_rss"] = max(out["memory/host/rss"], float(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        out["memory/host/pinned"] = float(registered_bytes())
        nvme = self.rt.model_state_bytes().get("nvme")
        if nvme:
            out["memory/nvme/file_bytes"] = float(sum(nvme.values()))
        return out

    def _write_placement(self) -> None:
        """offload(ratio="auto")'s placement, at the step that made it (the first one not
        skipped): its reason as text; the units and this rank's optimizer bytes on each
        side as scalars."""
        rt = self.rt
        reason = rt.placement_reason()
        if reason is None:
            return
        self._unplaced = False
        if not self.writes:
            return
        self.writer.add_text("placement", reason, self.step)
        optimizer = {place: roles["optimizer"] for place, roles in rt.model_state_bytes().items()}
        on_device = len(rt.units_on_device())
        for tag, value in (("units_on_device", on_device),
                           ("units_on_host", sum(bool(u.slots) for u in rt.units) - on_device),
                           ("optimizer_bytes/device", optimizer.get(rt.device.type, 0)),
                           ("optimizer_bytes/host", optimizer.get("host", 0))):
            self._scalar(f"placement/{tag}", float(value), self.step)
        self._flush_files()

    def _write_text(self) -> None:
        rt = self.rt
        plan = "\n".join(f"| {k} | `{v}` |" for k, v in
                         (line.split("=", 1) for line in rt.plan.describe()))
        self.writer.add_text("plan", "| option | value |\n|---|---|\n" + plan, 0)
        env = environment(rt)
        self.writer.add_text("environment", "| | |\n|---|---|\n" +
                             "\n".join(f"| {k} | {v} |" for k, v in env.items()), 0)
        self.writer.flush()

    # -- traces and memory snapshots --------------------------------------------------------
    def _make_profiler(self, plan, root: str):
        options = plan.monitor.profile
        if options is None:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        activities = [ProfilerActivity.CPU] + \
            ([ProfilerActivity.CUDA] if self.rt.device.type == "cuda" else [])
        self._profile_steps = options.get("skip_first", 0) + options["repeat"] * sum(
            options.get(k, 0) for k in ("wait", "warmup", "active"))
        return profile(activities=activities, schedule=schedule(**options),
                       on_trace_ready=tensorboard_trace_handler(
                           os.path.join(root, "traces"), worker_name=f"rank{self.rank}",
                           use_gzip=True),
                       experimental_config=_all_threads())

    def _advance_profiler(self) -> None:
        """At the start of each step: the profiler's step boundary, so every traced
        ``ProfilerStep#`` is one whole step; stopped once its schedule is done."""
        if self.profiler is None:
            return
        if not self._profiling:
            self.profiler.start()
            self._profiling = True
        else:
            self.profiler.step()
        if self.profiler.step_num >= self._profile_steps:
            self.profiler.stop()
            self.profiler = None

    def _dump_snapshot(self) -> None:
        if self._snapshot is not None:
            os.makedirs(os.path.dirname(self._snapshot), exist_ok=True)
            torch.cuda.memory._dump_snapshot(self._snapshot)
            torch.cuda.memory._record_memory_history(enabled=None, device=self.rt.device)
            self._snapshot = None

    # -- the end -------------------------------------------------------------------------
    def flush(self) -> None:
        """Everything outstanding written (see ``flush_logs``) and flushed; an unfinished
        trace window saved."""
        if self.profiler is not None and self._profiling:
            self.profiler.stop()
            self.profiler = None
        with self._logging():
            self._write(collective=False)

    def close(self) -> None:
        if not self._closer.alive:
            return
        self.flush()
        self._closer()

    @staticmethod
    def _close_refs(writer, csv_series) -> None:
        if writer is not None:
            writer.close()
        if csv_series is not None:
            csv_series.close()


def _close_at_exit(ref) -> None:
    monitor = ref()
    if monitor is not None:
        monitor.close()


def _all_threads():
    """Trace every thread (NVMe I/O runs in worker threads) where this torch can."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None
