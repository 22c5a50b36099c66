"""Run a function on real gloo ranks (separate processes), with a timeout so a hang fails."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing.forkserver as forkserver
import os
import pickle
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A spawned rank spends ~2.4 s of CPU importing torch and zerofn, most of the suite's time.
# Ranks fork instead from a server that imported them once (importing them starts no thread
# that outlives a fork: numpy's OpenBLAS pool stops itself at fork). A fork keeps the
# server's environment, some of it (MALLOC_*) read only at start, so when os.environ has
# changed (a test's monkeypatch, torch setting TORCHINDUCTOR_CACHE_DIR) the server restarts.
# torch._dynamo too: the first DTensor a rank makes (DTensor.from_local is wrapped by
# torch._disable_dynamo) imports it, ~1 s of CPU in every rank of every call otherwise.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zerofn", "pytest", "support.models"]


def context():
    """The forkserver context ranks start from, its server (re)started as said above."""
    ctx = mp.get_context("forkserver")   # one object, so one server
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if getattr(ctx, "server_env", None) != env:
        forkserver._forkserver._stop()   # private, but the way to stop it; none: a no-op
        ctx.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
        ctx.server_env = env
    return ctx


def _worker(rank, world, init_method, fn, args, results):
    try:
        torch.default_generator.seed()   # a fork copies the server's seed: draw one as spawn does
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        # Gloo's mesh can be whole on one rank while another still connects: a rank whose
        # fn raises at once would exit under that connect (seen under load), so all meet.
        dist.barrier()
        # Pickled here, by value: the queue's own pickler shares tensors through a
        # descriptor the parent fetches from this process, which may have exited by then.
        results.put((rank, None, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # report every failure, including assertion errors, to the parent
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A forked rank ends in os._exit, a spawned one in exit: run its atexit handlers
        # (zerofn's remove swap files, close monitors and wait for checkpoint saves).
        atexit._run_exitfuncs()


@contextlib.contextmanager
def started(world: int, target, *args, daemon: bool = False):
    """``world`` processes forked from the server, each running ``target(rank, world, init,
    *args, results)``, where ``init`` is a file store for ``init_process_group`` (in a
    directory removed on leaving) and ``results`` a queue; yields (processes, results)."""
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, init, *args, results), daemon=daemon)
                 for r in range(world)]
        for p in procs:
            p.start()
        yield procs, results


def run_ranks(world: int, fn, *args, timeout: float = 180):
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process.

    Raises AssertionError with every failing rank's traceback, or on timeout.
    """
    with started(world, _worker, fn, args, daemon=True) as (procs, results):
        out, errors = {}, {}
        try:
            for _ in range(world):
                rank, err, value = results.get(timeout=timeout)
                (errors if err else out)[rank] = err or pickle.loads(value)
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
