"""Starting the job: under torchrun (which it starts itself where nothing launched it), in
a process group whose rendezvous store keeps torchrun's attempts apart; and whether
torchrun restarted it after a failure."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from zerofn import finish_collectives_at_exit, name_uncaught_errors, return_large_frees
from zerofn.observe.failures import DEFAULT_TIMEOUT

from .args import refuse


def under_launcher() -> bool:
    """Whether torchrun (or another launcher setting RANK and WORLD_SIZE) started us."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def ranks_to_start(nproc: int | None) -> int:
    return nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)


def check_before_launch(args) -> None:
    """The flags and their combination checked as each rank will check them (job.py's
    ``resolve``), before any rank starts: one line and exit status 2, as argparse's own
    refusals, rather than every rank's error inside torchrun's report."""
    from .job import resolve
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolve(args, device, world=ranks_to_start(args.nproc))
    except (ValueError, OSError) as e:
        refuse(str(e))


def launch(argv: list[str], nproc: int | None) -> None:
    """Run ``torch.distributed.run`` in this process, starting the job on ``nproc`` ranks
    (its own free port, so several jobs can share a machine); returns once they ended
    well, else raises torchrun's ChildFailedError (its report of the failed rank).

    As ``python -m torch.distributed.run`` would, less a second interpreter importing torch
    again: the caller's ``@record`` is torchrun's own ``main``'s, and its agent forwards
    SIGTERM and SIGINT to the ranks from this process's main thread."""
    from torch.distributed import run as torchrun   # (here: the ranks never launch)
    n = ranks_to_start(nproc)
    if n < 1:
        raise SystemExit(f"--nproc {n}: start at least one rank.")
    sys.stdout.flush()
    torchrun.run(torchrun.parse_args(["--standalone", "--nproc-per-node", str(n), "-m",
                                      "zerofn.train", *without_nproc(argv)]))


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N``: torchrun would take it for an abbreviation of its own
    ``--nproc-per-node`` and stop."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg != "--nproc" and not arg.startswith("--nproc="):
            out.append(arg)
        skip = arg == "--nproc"
    return out


def setup(timeout: float = DEFAULT_TIMEOUT) -> torch.device:
    """Join the process group, whose collectives wait at most ``timeout`` seconds; pick
    this rank's device. The process is zerofn train's own, so it takes the process-wide
    settings a job's own script opts into: uncaught errors named to the other ranks, the
    collectives' threads finished at exit and, on a CPU device, large freed blocks
    returned to the OS."""
    wait = datetime.timedelta(seconds=timeout)
    name_uncaught_errors()
    finish_collectives_at_exit()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=wait, **attempt_store(wait))
        return device
    # Ranks on one machine share its cores: more threads than their share only fight.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return_large_frees()
    dist.init_process_group("gloo", timeout=wait, **attempt_store(wait))
    return torch.device("cpu")


def attempt_store(wait: datetime.timedelta) -> dict:
    """The rendezvous store, under a prefix of torchrun's attempt where the ranks share
    the launcher's own store (``TORCHELASTIC_USE_AGENT_STORE``, torchrun's default).

    That store outlives the ranks, and a process group's keys are named alike in every
    attempt (groups "0", "1", ... of a per-process counter): after a restart a rank can
    read a dead rank's address, and gloo then fails to connect or waits forever (torch
    2.13; pytorch/pytorch#135712 for NCCL). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    each attempt gets a fresh store and needs no prefix. The restart count is per node,
    so across nodes only that setting keeps attempts apart (docs/multinode.md)."""
    store, rank, world = next(dist.rendezvous("env://", timeout=wait))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"zerofn-attempt-{attempt}", store)
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        if rank == 0 and restarts and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
            print("zerofn train: torchrun may restart this multi-node job, and its ranks "
                  "share each launcher's store, whose restart count differs by node: set "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node "
                  "(docs/multinode.md).", file=sys.stderr, flush=True)
    return {"store": store, "rank": rank, "world_size": world}


def restarted(device: torch.device) -> bool:
    """Whether torchrun restarted this job after a failure, on any node: each node's
    launcher counts its own restarts, and one whose ranks were healthy restarts them
    uncounted when another node's fail, so the ranks agree here (one all-reduce) rather
    than some resuming while others start afresh."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))],
                         device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return count.item() > 0
