"""On a CPU device, glibc's malloc gives large freed blocks back to the OS.

[Note: mmap threshold] On a CPU device every gathered parameter's gradient and every
activation comes from malloc, and glibc serves a block from its heap unless it is at
least the "mmap threshold" (128 KiB at start). The threshold moves: each time a block
that was mmapped is freed, it rises to that block's size (up to 32 MiB). One step of a
model with multi-MiB weights frees such blocks (a 9 MiB gradient after its
reduce-scatter), and from then on blocks of up to that size come from the heap, which
keeps what is freed in the middle of it. Under ZeRO-3 at 112M parameters on two ranks
that heap held 240 to 300 MB of freed memory at the peak: 0.3 of the model state, the
difference between 1.50x and 1.36x of the ZeRO memory formula in peak RSS.

Fixing the threshold (glibc's ``mallopt(M_MMAP_THRESHOLD, ...)``, which also stops it
moving) at 8 MiB sends every block of 8 MiB and more to mmap, returned at once when freed;
smaller blocks stay on the heap, where they are cheap to reuse. At 112M parameters that
gives ZeRO-3 1.36x (ZeRO-1 1.37x, ZeRO-2 1.27x), as 4 MiB does, with steps within
run-to-run noise of the moving threshold (tools/bench_zero.py; docs/benchmarks.md),
where 4 MiB cost 5-10 % and 64 KiB 15-50 %: every mmapped block's pages are faulted in
afresh.

This is a process-wide setting, so zerofn makes it only where asked:
``zf.return_large_frees()`` in a job's script, or ``zerofn train`` (whose process is its
own) on a CPU device. Applying a transform leaves malloc alone, as FSDP2 does. It changes
nothing where the user chose a threshold: a process started with ``MALLOC_MMAP_THRESHOLD_``
or a ``glibc.malloc.mmap_threshold`` tunable keeps it. On a CUDA device gradients and
activations live in device memory and the host's large buffers (offload arenas, staging)
are made once and kept, so there is little for the heap to keep. What it saves and costs
on the planner grid's wide GPT: tools/bench_malloc_threshold.py.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_MMAP_THRESHOLD = -3         # glibc's malloc.h
THRESHOLD = 8 << 20           # bytes


def user_chose_threshold() -> bool:
    """Whether this process was started with its own mmap threshold."""
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or \
        "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def return_large_frees(threshold: int = THRESHOLD) -> int | None:
    """Have glibc's malloc map every block of ``threshold`` bytes or more by itself, and
    return it to the OS as soon as it is freed, for the rest of the process.

    On a CPU device a step's gradients and activations come from malloc, whose moving
    mmap threshold otherwise keeps freed multi-MiB blocks in its heap: at 112M parameters
    a fifth to a third more peak memory (docs/design.md). This is process-wide and
    opt-in: applying a transform never calls it; ``zerofn train`` does on a CPU. The
    planner's CPU memory model assumes it.

    Args:
        threshold: bytes (default 8 MiB, measured by tools/bench_malloc_threshold.py).

    Returns:
        The threshold now in force, or None where malloc was left alone: not glibc, or the
        process was started with a threshold of the user's (``MALLOC_MMAP_THRESHOLD_``,
        ``GLIBC_TUNABLES``).
    """
    if platform.libc_ver()[0] != "glibc" or user_chose_threshold():
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return threshold if libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1 else None   # 1: success
