"""A process that ran collectives lets their threads finish before Python finalizes.

[Note: the exit abort] A collective's work is run and then released by a backend thread
(gloo's workers), which often holds the last reference to it: the caller's wait returns
when the work completes, before the thread lets go. When a tensor the work holds lost its
Python object meanwhile (``dist.all_reduce(torch.tensor(...))``, a vote's ballot,
Lightning's ``reduce_boolean_decision``), torch has kept that object alive for it, and
freeing it takes the GIL. If the main thread reaches the interpreter's finalization first,
the thread asking for the GIL is ended by Python (``pthread_exit``) inside a C++
destructor, and the process aborts after its work is done: "terminate called without an
active exception", exit -6, a failed job under torchrun. A core dump shows exactly that
stack (``~AsyncAllreduceWork`` → ``decref_pyobject`` → ``take_gil`` → ``pthread_exit``).
Measured on torch 2.13, 2 ranks on gloo, a script ending straight after its last
``all_reduce`` of a temporary: 13 aborts in 20 runs; the same script with 50 ms of waiting
at its end, none in 20 (``tools/teardown_aborts.py`` counts both arms with zerofn).

``zf.finish_collectives_at_exit()`` registers ``settle`` at exit. It runs before
finalization, with the GIL released while it waits, until no other thread of the process
is running or waiting to run (Linux's ``/proc/self/task``) or 2 s have passed: a thread
that finishes its release needs the GIL and a CPU, and has both. It issues no
collective, so a rank that exits alone (its peers failed or are still training) is not
held. Collectives run after it (in an exit handler registered before it) are not
covered. Like FSDP2's ``fully_shard``, a transform changes nothing process-wide, so this
is a call the user makes; the front doors that run the process's distributed life (the
Lightning strategies, ``ZeroTrainer``, ``zerofn.deepspeed.initialize``, ``zerofn train``)
make it.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

QUIET_FOR = 0.02      # seconds the GIL is released before threads are looked at (and
                      # all the wait, where there is no /proc to look at)
POLL = 0.005
LONGEST = 2.0         # an exit is never held longer than this
_registered = False


def finish_collectives_at_exit() -> None:
    """At this process's exit, before Python finalizes, wait until the threads that ran
    collectives have let go of them: on gloo, a script that ends straight after a
    collective of a temporary tensor otherwise aborts now and then ("terminate called
    without an active exception"). Registered once however often it is called."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(settle)


def settle(longest: float = LONGEST) -> float:
    """Wait, with the GIL released, until no other thread runs; the seconds it waited."""
    start = time.monotonic()
    time.sleep(QUIET_FOR)
    if not os.path.isdir("/proc/self/task"):     # (not Linux: the quiet time only)
        return time.monotonic() - start
    while time.monotonic() - start < longest and others_running():
        time.sleep(POLL)
    return time.monotonic() - start


def others_running() -> bool:
    """Whether a thread of this process other than the caller is running or runnable (state
    R). One waiting for the GIL while it is free, or for a CPU, counts."""
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue        # (the thread ended while we looked)
        if state == "R":
            return True
    return False
