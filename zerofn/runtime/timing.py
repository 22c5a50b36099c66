"""Profiler labels and phase timing at the points of a step that matter.

[Note: timing] The runtime's components label what they do through ``self.timing``: a
unit's gather (in forward, in backward, after the step) and the wait for it, a unit's
reduce-scatter and the wait for it, offload copies, CPU Adam, NVMe reads and writes, the
overflow check and clipping. Without a monitor ``timing`` is ``UNTIMED``, which only
labels, and only while a profiler records (``label``): a ``record_function`` costs a
dispatcher call, about 10 us on this project's CPU machine, even when nobody listens.

With ``zf.tensorboard`` the runtime's ``Timing`` also adds each region's duration to a
series, on one of two clocks. The host clock is ``time.perf_counter``. The device clock is
the host clock on the CPU; on CUDA it records an event on the current stream at each end
of a region (no wait), and the events are read once per logging interval, after one
synchronization (``CudaClock.read``). So a step that does not log never waits for the
device. CPU Adam and NVMe I/O run on the host (NVMe in I/O threads): they use the host
clock on every device.

A collective's time (``comm/<kind>/time_ms``) runs from its issue to the moment a wait
for it returned: where it finished long before it was waited for, that overstates its
duration, so its bandwidth is a lower bound. Its exposed part is ``reduce_wait`` or
``gather_wait``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, defaultdict

import torch
import torch.autograd.profiler as _profiler

NOTHING = contextlib.nullcontext()     # stateless: one instance serves every region
HOST_SERIES = frozenset(("cpu_adam", "nvme_read", "nvme_write"))


def label(what: str, unit: str | None = None):
    """``record_function("zerofn::<what> <unit>")`` while a profiler records (torch's, or
    ``emit_nvtx``), else a context that does nothing."""
    if not _profiler._is_profiler_enabled:
        return NOTHING
    return _profiler.record_function(f"zerofn::{what}" + (f" {unit}" if unit else ""))


class Waited:
    """An asynchronous collective whose wait is labelled (and, under a monitor, timed)."""

    __slots__ = ("work", "timing", "kind", "wait_series", "unit", "start", "stall")

    def __init__(self, timing, kind, wait_series, unit, work, start, stall):
        self.timing, self.kind, self.wait_series, self.unit = timing, kind, wait_series, unit
        self.work, self.start, self.stall = work, start, stall

    def wait(self) -> bool:
        self.timing.waited(self)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Untimed:
    """Labels only: what the runtime's components use when no monitor is attached."""

    active = False

    def span(self, series: str | None, what: str, unit: str | None = None):
        """A labelled region, timed into ``series`` under a monitor (None: label only)."""
        return label(what, unit)

    def collective(self, kind: str):
        """A blocking collective of ``kind``, counted and timed under a monitor."""
        return NOTHING

    def issue(self, kind: str, what: str, unit: str, start_it, wait_series: str,
              stall: bool = True) -> Waited:
        """``start_it()`` starts an asynchronous collective of ``kind`` for ``unit``;
        returns its work, whose ``wait`` is labelled ``wait_series`` and, where ``stall``,
        timed into that series (False where the wait holds a side stream, not the step)."""
        with label(what, unit):
            work = start_it()
        return Waited(self, kind, wait_series, unit, work, None, stall)

    def waited(self, w: Waited) -> None:
        with label(w.wait_series, w.unit):
            w.work.wait()

    def begin(self, phase: str) -> None:
        """A step's phase (forward, backward, optimizer) starts; no-op if it has."""

    def end(self, phase: str) -> None:
        """The phase ends; no-op if it was not begun."""


UNTIMED = Untimed()


class WatchedWaits:
    """``timing`` whose waits for collectives (``collective``, and ``waited`` of what
    ``issue`` started) a stall watch follows (``stalls.waiting(kind, unit)``: the failure
    watch's, observe/stalls.py); everything else is ``timing``'s own."""

    def __init__(self, timing, stalls):
        self._timing, self._stalls = timing, stalls
        self.active = timing.active

    def __getattr__(self, name):
        return getattr(self._timing, name)

    @contextlib.contextmanager
    def collective(self, kind: str):
        with self._stalls.waiting(kind, None), self._timing.collective(kind):
            yield

    def issue(self, kind, what, unit, start_it, wait_series, stall=True) -> Waited:
        waited = self._timing.issue(kind, what, unit, start_it, wait_series, stall)
        waited.timing = self        # (its wait comes back here)
        return waited

    def waited(self, w: Waited) -> None:
        with self._stalls.waiting(w.kind, w.unit):
            self._timing.waited(w)


class Timing(Untimed):
    """Labels, and durations per series on the host and device clocks (see the Note)."""

    active = True

    def __init__(self, device: torch.device):
        self.host = HostClock()
        self.device = CudaClock(device) if device.type == "cuda" else self.host
        self.calls: Counter = Counter()     # collectives issued, by kind
        self._open: dict = {}               # phase -> (label, start mark)

    def _clock(self, series: str):
        return self.host if series in HOST_SERIES else self.device

    @contextlib.contextmanager
    def span(self, series, what, unit=None):
        if series is None:
            with label(what, unit):
                yield
            return
        clock = self._clock(series)
        with label(what, unit):
            start = clock.mark()
            yield
            clock.add(series, start, clock.mark())

    @contextlib.contextmanager
    def collective(self, kind):
        start = self.device.mark()
        yield
        self.calls[kind] += 1
        self.device.add("comm/" + kind, start, self.device.mark())

    def issue(self, kind, what, unit, start_it, wait_series, stall=True):
        start = self.device.mark()
        with label(what, unit):
            work = start_it()
        self.calls[kind] += 1
        return Waited(self, kind, wait_series, unit, work, start, stall)

    def waited(self, w):
        clock = self.device
        before = clock.mark()
        with label(w.wait_series, w.unit):
            w.work.wait()
        after = clock.mark()
        if w.stall:
            clock.add(w.wait_series, before, after)
        clock.add("comm/" + w.kind, w.start, after)

    def is_open(self, phase: str) -> bool:
        return phase in self._open

    def begin(self, phase):
        if phase not in self._open:
            region = label(phase)
            region.__enter__()
            self._open[phase] = (region, self.device.mark())

    def end(self, phase):
        opened = self._open.pop(phase, None)
        if opened is not None:
            region, start = opened
            self.device.add(phase, start, self.device.mark())
            region.__exit__(None, None, None)

    def read(self, keep=()) -> dict[str, list[float]]:
        """Milliseconds of each span per series since the last read, in the order they
        ended, from both clocks; starts afresh. ``keep``: device marks still in use (a
        step's start), not to be recycled."""
        out = self.device.read(keep)
        if self.host is not self.device:
            out.update(self.host.read())
        return out


class HostClock:
    """``time.perf_counter`` marks; spans may be added from I/O threads."""

    def __init__(self):
        self._spans: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    def add(self, series: str, start: float, end: float) -> None:
        with self._lock:
            self._spans[series].append(end - start)

    def read(self, keep=()) -> dict[str, list[float]]:
        with self._lock:
            spans, self._spans = self._spans, defaultdict(list)
        return {k: [1e3 * t for t in v] for k, v in spans.items()}


class CudaClock:
    """CUDA events recorded on the current stream, pooled, read once per interval."""

    def __init__(self, device: torch.device):
        self.device = device
        self._spans: dict[str, list] = defaultdict(list)
        self._free: list = []

    def mark(self):
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, series: str, start, end) -> None:
        self._spans[series].append((start, end))

    def read(self, keep=()) -> dict[str, list[float]]:
        """One synchronization, then every span's elapsed time; the events go back to the
        pool, except ``keep``."""
        torch.cuda.synchronize(self.device)
        spans, self._spans = self._spans, defaultdict(list)
        out = {k: [s.elapsed_time(e) for s, e in pairs] for k, pairs in spans.items()}
        used = {id(e): e for pairs in spans.values() for pair in pairs for e in pair}
        held = {id(e) for e in keep}
        self._free += [e for i, e in used.items() if i not in held]
        return out
