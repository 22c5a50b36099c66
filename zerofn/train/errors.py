"""How the job's errors reach the user once: an error every rank raised alike is printed
by rank 0, which leaves it in the rendezvous store for the other ranks to compare theirs
with; and the message for a torch without fp16 kernels."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

SAID_KEY = "zerofn/train/error"   # rank 0's error message, in the rendezvous store


def fp16_kernels_missing(error: RuntimeError, precision: str) -> str | None:
    """A clear message for torch lacking an fp16 kernel (on the CPU), else None."""
    text = str(error)
    if precision != "fp16" or "Half" not in text or "not implemented" not in text:
        return None
    return (f"--precision fp16: this torch ({torch.__version__}) has no fp16 kernel for an "
            f"operation the model uses ({text.strip()}). Use --precision bf16 or fp32 on "
            f"this machine, or run fp16 on a GPU.")


def say_once(store, message: str) -> bool:
    """Print an error that usually every rank raised alike (before any collective could
    part them) once, from rank 0; a rank that raised something else, or raised where rank
    0 did not, prints its own, so no rank's error goes unseen. True where this rank spoke
    alone and rank 0 has said nothing yet (see ``hear_from_rank_0``). ``store``: the
    rendezvous store, or None."""
    rank = dist.get_rank()
    if rank == 0:
        tell_the_others(store, message)
        return False
    try:
        store.wait([SAID_KEY], datetime.timedelta(seconds=3))
        said = store.get(SAID_KEY).decode()
    except Exception:   # (no store, or rank 0 raised nothing of the kind)
        said = None
    if said != message:
        print(f"error on rank {rank}: {message}", file=sys.stderr, flush=True)
    return said is None


def tell_the_others(store, message: str) -> None:
    """Print this rank's error; rank 0 also leaves it in the rendezvous store for the
    others."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if store is not None and dist.get_rank() == 0:
        store.set(SAID_KEY, message)


def hear_from_rank_0(store, seconds: float = 10.0) -> None:
    """Wait (bounded) for rank 0 to print why it stopped. Called once this rank's process
    group is gone, which ends rank 0's pending collective: torchrun stops every rank as
    soon as one exits, so leaving at once would cut rank 0's explanation off."""
    try:
        store.wait([SAID_KEY], datetime.timedelta(seconds=seconds))
    except Exception:   # rank 0 is busy elsewhere or gone: its own log says the rest
        pass
