"""Run a function on real gloo ranks (spawned processes), with a timeout so a hang fails."""
from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init_method, fn, args, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        results.put((rank, None, fn(rank, world, *args)))
    except BaseException:  # report every failure, including assertion errors, to the parent
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 180):
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process.

    Raises AssertionError with every failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, init, fn, args, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        out, errors = {}, {}
        try:
            for _ in range(world):
                rank, err, value = results.get(timeout=timeout)
                (errors if err else out)[rank] = err or value
        except queue.Empty:
            raise AssertionError(f"ranks timed out after {timeout}s; finished: {sorted(out)}, "
                                 f"failed: {errors}") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [out[r] for r in range(world)]
