"""When one rank fails, every other rank stops with an error that names it and its phase.

[Note: progress records] Each rank keeps one short record in the process group's c10d
Store (the rendezvous store every rank already reaches): its step, its phase (forward,
backward, step, checkpoint save or load), a count of phase changes, the time, its host
and process id. It is rewritten only when the phase changes, a few times a step, never
per tensor. A rank that raises inside zerofn's hooks, the optimizer step or a checkpoint
adds what it raised and in which unit before the exception goes on.

When a collective fails on a rank (gloo's "Connection closed by peer" where a rank died,
a timeout where one stalls, NCCL's errors), ``Watch.explain`` reads every other rank's
record and raises ``RankFailure``: which rank raised what, which is gone (its process
ended), which is behind (it reported fewer phase changes) or still stalled (it neither
finished nor failed its collective: ranks waiting in the same collective time out too,
and say so within a short grace period). A rank that only stopped because another failed
says so in its record, so it is never blamed.

The bound on a stall is the process group's timeout: zerofn's ``timeout=`` option sets it
for the group the model is sharded over (default None: the group's own, 30 minutes for a
gloo group made without one; ``zerofn train --timeout`` defaults to 300 s).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import weakref

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..runtime.events import StepObserver
from .stalls import StallWatch

KEY = "zerofn/progress/"       # + the global rank
DEFAULT_TIMEOUT = 300.0        # seconds; zerofn train's --timeout
# How a failed collective reads, by backend: a peer gone, or a wait that ran out.
LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "ncclRemoteError", "NCCL communicator was aborted")
TIMED_OUT = ("Timed out waiting", "Operation timed out", "timed out", "Timeout", "timeout",
             "Watchdog")


class RankFailure(RuntimeError):
    """Another rank failed, so this one cannot go on.

    Attributes:
        ranks: the global ranks blamed (raised, gone, behind or stalled); empty where no
            rank reported anything that explains the failed collective.
        phase: this rank's phase when its collective failed, e.g. ``"backward of step 3"``.
    """

    def __init__(self, message: str, ranks: list[int], phase: str):
        super().__init__(message)
        self.ranks, self.phase = ranks, phase


def collective_failure(exc: BaseException) -> str | None:
    """``"lost"`` (a peer's connection closed), ``"timeout"`` or None (not a failed
    collective: this rank's own error)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, RankFailure):
        return None
    text = str(exc)
    if any(s in text for s in LOST):
        return "lost"
    if any(s in text for s in TIMED_OUT) or isinstance(exc, getattr(dist, "DistError", ())):
        return "timeout"
    return None


def translate(exc: Exception) -> Exception:
    """``exc`` as the newest active ``Watch`` of this process sees it: a ``RankFailure``
    for a failed collective of the job's own (outside zerofn's hooks), else ``exc``."""
    watch = Watch.latest and Watch.latest()
    return exc if watch is None or not watch.active else watch.failed(exc)


class Watch(StepObserver):
    """One rank's progress record and the reading of everyone else's (see the Note).

    Args:
        group: the process group over every rank the model is sharded over (None: the
            world); their records are read when a collective fails.
        timeout: the seconds a collective may wait (the sharding option ``timeout=``,
            which the runtime sets on its groups, runtime/mesh.py); None: the group's own,
            which ``init_process_group(timeout=...)`` set.
        stall_warning: the seconds one wait lasts before this rank logs it (stalls.py);
            None: never.
    """

    # A weak reference to the newest of this process, for ``translate``: weak, so that
    # it does not keep a finished model and its memory.
    latest: weakref.ref | None = None

    def __init__(self, group=None, timeout: float | None = None,
                 stall_warning: float | None = None):
        self.rank = dist.get_rank()
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.store = default_store()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.timeout = timeout if timeout is not None else _group_timeout(group)
        self.step = 1          # the optimizer step under way, counted from 1
        self.phase_name = "set-up"
        self.seq = 0           # phase changes so far: ranks in step with each other agree
        self.unit = None
        self.between = False   # the last optimizer step is done, the next forward not begun
        self.active = True
        self.stalls = StallWatch(stall_warning, self.rank, self.where, self.timeout)
        Watch.latest = weakref.ref(self)
        self._write()

    # -- StepObserver: the runtime's events (runtime/events.py) ------------------------
    @staticmethod
    def preflight(plan, device, rank: int, world: int) -> list[str]:
        return []

    @staticmethod
    def attach(rt) -> "Watch":
        """Every runtime is watched, over every rank of its layout."""
        return Watch(rt.group, rt.plan.sharding.timeout, rt.plan.sharding.stall_warning)

    def forward_begin(self) -> None:
        self.enter("forward")

    def forward_end(self, raised) -> None:
        if isinstance(raised, Exception):   # the forward raised: the hook runs anyway
            self.failed(raised)

    def backward_gathered(self) -> None:
        self.enter("backward")

    def step_begin(self) -> None:
        self.enter("step")

    def phase(self, name: str) -> None:
        self.enter(name)

    def set_step(self, step: int) -> None:
        self.step = step

    def guard(self, fn, unit: str | None = None):
        """``fn`` whose exceptions go through ``failed``: a ``unit`` names the unit; where
        it is None and ``fn`` takes a unit first (backward's per-unit hooks), that one."""
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                named = unit if unit is not None else getattr(args[0] if args else None,
                                                              "name", None)
                self._reraise(e, named if isinstance(named, str) else None)
        return call

    def close(self) -> None:
        """Stop recording: the runtime is undone."""
        self.active = False
        self.stalls.close()

    # -- records -----------------------------------------------------------------------
    def where(self) -> str:
        return _where(self.phase_name, self.step, self.unit, self.between)

    def enter(self, phase: str, unit: str | None = None) -> None:
        """Record a new phase (a no-op if it is the current one). A checkpoint's phase
        between steps is "after" the last step."""
        if not phase.startswith("checkpoint"):
            self.between = False
        if phase != self.phase_name and self.active:
            self.phase_name, self.unit, self.seq = phase, unit, self.seq + 1
            self._write()

    def step_done(self) -> None:
        self.step += 1
        self.between = True

    def _reraise(self, exc: Exception, unit: str | None) -> None:
        """Inside an ``except``: raise what ``failed`` makes of ``exc``."""
        failure = self.failed(exc, unit)
        if failure is exc:
            raise
        raise failure from exc

    def failed(self, exc: Exception, unit: str | None = None) -> Exception:
        """What to raise for ``exc``: a ``RankFailure`` where a collective failed, else
        ``exc`` itself, recorded (and noted) as this rank's own error. An error every rank
        raises alike after agreeing on it (``raised_on_every_rank``: the non-finite guard's)
        is no rank's failure: it passes untouched."""
        if not self.active or isinstance(exc, RankFailure) or getattr(exc, "_zerofn_seen", False) \
                or getattr(exc, "raised_on_every_rank", False):
            return exc
        try:
            exc._zerofn_seen = True    # outer guards leave it alone
        except AttributeError:
            pass
        if unit is not None:
            self.unit = unit
        kind = collective_failure(exc)
        if kind is None:
            self._write(raised=f"{type(exc).__name__}: {_first_line(exc)}"[:300])
            exc.add_note(f"zerofn: rank {self.rank} raised this in {self.where()}; the "
                         f"other ranks stop with a RankFailure naming it.")
            return exc
        return self.explain(kind, exc)

    def explain(self, kind: str, exc: Exception) -> RankFailure:
        """Read every rank's record (waiting a little for ranks in the same collective to
        report theirs) and build the error; records this rank as stopped."""
        self._write(stopped=True)
        others = [r for r in self.ranks if r != self.rank]
        deadline = time.monotonic() + min(10.0, max(2.0, 0.1 * self.timeout))
        while True:
            records = self._read(others)
            verdicts = {r: _verdict(r, records.get(r), self.seq, self.host) for r in others}
            if all(blame is not None for blame, _ in verdicts.values()):
                break
            if time.monotonic() > deadline:   # silent through the grace: stalled
                verdicts = {r: (blame is not False, text) for r, (blame, text) in verdicts.items()}
                break
            time.sleep(0.2)
        return RankFailure(self._message(kind, exc, verdicts),
                           sorted(r for r, (blame, _) in verdicts.items() if blame), self.where())

    def _message(self, kind: str, exc: Exception, verdicts: dict) -> str:
        blamed = [text for blame, text in verdicts.values() if blame]
        waiting = [text for blame, text in verdicts.values() if not blame]
        what = "a peer's connection closed" if kind == "lost" else \
            f"a collective waited past the timeout ({self.timeout:g} s)"
        lines = [f"rank {self.rank} stopped in {self.where()}: {what}."]
        lines += blamed or ["No rank reported an error or is known to be gone (a rank on "
                            "another host may have died; see its log)."]
        if waiting:
            lines.append("Also stopped: " + "; ".join(waiting) + ".")
        if kind == "timeout":
            lines.append("A slow but healthy rank needs a longer timeout: zerofn's "
                         "timeout= option or zerofn train --timeout.")
        first = re.sub(r"^\[[^\]]*\]\s*", "", _first_line(exc))
        lines.append(f"({type(exc).__name__}: {first[:160]})")   # less gloo's source path
        return "\n".join(lines)

    # -- the store -------------------------------------------------------------------
    def _write(self, **extra) -> None:
        if self.store is None:
            return
        record = {"step": self.step, "phase": self.phase_name, "unit": self.unit, "seq": self.seq,
                  "between": self.between, "t": time.time(), "host": self.host,
                  "pid": self.pid, **extra}
        try:
            self.store.set(KEY + str(self.rank), json.dumps(record))
        except Exception:   # a store that is gone (its host died) must not hide the failure
            self.store = None

    def _read(self, ranks: list[int]) -> dict:
        out = {}
        for r in ranks if self.store is not None else ():
            try:
                if self.store.check([KEY + str(r)]):
                    out[r] = json.loads(self.store.get(KEY + str(r)))
            except Exception:
                return out
        return out


def _verdict(rank: int, record: dict | None, my_seq: int, my_host: str) -> tuple[bool | None, str]:
    """(blamed, text) for another rank's record: True where it raised, is gone or is
    behind; False where it stopped because of a failure too; None while undecided (alive,
    in step with this rank, and silent: stalled, unless it reports within the grace)."""
    if record is None:
        return None, f"rank {rank} never reported (it may not have reached zerofn's set-up)"
    rank_where = _where(record["phase"], record["step"], record.get("unit"),
                        record.get("between", False))
    ago = f"{time.time() - record['t']:.1f} s ago"
    if record.get("raised"):
        return True, f"rank {rank} raised {record['raised']} in {rank_where}, {ago}"
    if record.get("stopped"):
        return False, f"rank {rank} in {rank_where}"
    if record["host"] == my_host and not _alive(record["pid"]):
        return True, f"rank {rank} is gone: its process {record['pid']} on " \
                     f"{record['host']} ended in {rank_where} (last heard {ago})"
    if record["seq"] < my_seq:
        return True, f"rank {rank} is behind: last reported {rank_where}, {ago}"
    return None, f"rank {rank} is stalled in {rank_where} (since {ago})"


def _where(phase: str, step: int, unit: str | None, between: bool) -> str:
    """``forward of step 3 (unit 'blocks.1')``; between steps (the job's own code:
    logging, loading data, a checkpoint) ``checkpoint save after step 2``."""
    if between:
        return f"{phase} after step {step - 1}" if phase.startswith("checkpoint") \
            else f"the gap between steps {step - 1} and {step}"
    return f"{phase} of step {step}" + (f" (unit '{unit}')" if unit else "")


def _alive(pid: int) -> bool:
    """Whether a process of this host still runs (a zombie, killed but not yet reaped by
    its launcher, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def name_uncaught_errors() -> None:
    """Record in this rank's progress record what ends the process uncaught, so that the
    other ranks name the error and its phase; a failed collective of the job's own is
    explained after its traceback as zerofn explains its own (``RankFailure``).

    An opt-in, process-wide change (it wraps ``sys.excepthook``, calling the hook that was
    there): applying a transform installs nothing. Without it an error raised where zerofn
    has no hook of its own (the model's own backward code, the job's data loading or
    logging) still ends every rank: the others find this rank's process gone and name it
    so. ``zerofn train`` calls it; a job's own script calls it once, anywhere before its
    loop. Calling it again changes nothing."""
    if getattr(sys.excepthook, "_zerofn", False):
        return
    previous = sys.excepthook

    def record_and_print(kind, exc, tb):
        failure = translate(exc) if isinstance(exc, Exception) else exc
        previous(kind, exc, tb)
        if failure is not exc:
            print(f"\n{type(failure).__name__}: {failure}", file=sys.stderr)

    record_and_print._zerofn = True
    sys.excepthook = record_and_print


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def default_store():
    """The default process group's c10d Store, or None."""
    try:
        return c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _group_timeout(group) -> float:
    """The group's collective timeout in seconds, as its backend holds it."""
    group = group or dist.group.WORLD
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None:
            return options._timeout.total_seconds()
    return c10d.default_pg_timeout.total_seconds()
