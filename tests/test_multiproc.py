"""run_ranks forks its ranks from a server that preloaded torch: they must still start as
spawned ones would, with the test's environment (even what glibc reads only at start), a
seed of their own, and their atexit handlers run."""
from __future__ import annotations

import atexit
import ctypes
import os

import pytest
import torch

from support.ranks import run_ranks

pytestmark = pytest.mark.multirank


class MallInfo(ctypes.Structure):   # glibc's struct mallinfo
    _fields_ = [(f, ctypes.c_int) for f in ("arena ordblks smblks hblks hblkhd usmblks "
                                            "fsmblks uordblks fordblks keepcost").split()]


def rank_start(rank, world, path):
    open(path + str(rank), "w").close()
    atexit.register(os.remove, path + str(rank))
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.mallinfo.restype = ctypes.c_void_p, MallInfo
    before = libc.mallinfo().hblks
    blocks = [libc.malloc(100_000) for _ in range(3000)]   # past the heap's free space
    own_mmaps = libc.mallinfo().hblks - before > 1000      # only under a 64 KiB threshold
    for p in blocks:
        libc.free(ctypes.c_void_p(p))
    return own_mmaps, torch.randn(4)


def test_ranks_start_like_spawned_ones(monkeypatch, tmp_path):
    path = str(tmp_path / "rank")
    [(own_mmaps, _)] = run_ranks(1, rank_start, path)
    assert not own_mmaps, "the control: by default 100 kB blocks come from the heap"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    (a, x), (b, y) = run_ranks(2, rank_start, path)
    assert a and b, "the environment set before run_ranks did not reach glibc in the ranks"
    assert not torch.equal(x, y), "the ranks share a seed"
    assert os.listdir(tmp_path) == [], "the ranks' atexit handlers did not run"
