"""The entry point: main() parses the flags and starts the job under torchrun; run() sets
up this rank, trains, and turns an error into one message and an exit status."""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import zerofn as zf
from zerofn.observe.failures import RankFailure, default_store, translate

from .args import parse_args
from .errors import hear_from_rank_0, say_once, tell_the_others
from .launch import check_before_launch, launch, setup, under_launcher
from .loop import train


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # (parsed outside @record, which swallows SystemExit(0): --help must still exit)
    args = parse_args(argv)
    if not under_launcher():
        check_before_launch(args)
    run(args, argv)


@record   # a rank's uncaught error reaches torchrun's failure summary
def run(args: argparse.Namespace, argv: list[str]) -> None:
    if not under_launcher():
        launch(argv, args.nproc)    # torchrun, in this process, until the ranks end
        return
    if args.nproc is not None and args.nproc != int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc)):
        raise SystemExit(f"--nproc {args.nproc}, but the launcher started "
                         f"{os.environ['LOCAL_WORLD_SIZE']} ranks here; drop --nproc.")
    if args.timeout <= 0:
        raise SystemExit(f"--timeout {args.timeout:g}: give the seconds (> 0) a collective "
                         f"may wait for the slowest rank.")
    device = setup(args.timeout)
    store = default_store()
    finished = alone = False
    try:
        train(args, device)
        finished = True
    except ValueError as e:
        alone = say_once(store, str(e))
        raise SystemExit(2) from None
    except zf.NonFiniteGradient as e:   # --on-nonfinite raise: every rank raised it alike
        alone = say_once(store, str(e))
        raise SystemExit(1) from None
    except RuntimeError as e:
        # Another rank failed (also in this job's own collectives): say which, and where.
        failure = translate(e)
        if not isinstance(failure, RankFailure):
            raise
        tell_the_others(store, str(failure))
        raise SystemExit(1) from None
    finally:
        try:
            zf.wait_for_checkpoint()
        except Exception:
            if finished:
                raise
            # The run failed already; a background save that failure cut off (its
            # peers gone) says nothing more, and the previous checkpoint stands.
        # zerofn's runtime and the model refer to each other: collected here, the groups
        # they hold end with destroy_process_group and their connections close now, so a
        # peer still in a collective with this rank stops at once (the exit abort is
        # launch.py's finish_collectives_at_exit's).
        _let_go_of_the_groups()
        gc.collect()
        dist.destroy_process_group()
        if alone and store is not None:
            hear_from_rank_0(store)


def _let_go_of_the_groups() -> None:
    """Drop what would keep this rank's process groups, and so their connections, past
    destroy_process_group: a peer waiting in a collective with this rank stops only once
    they close, and until then ``hear_from_rank_0`` waits out its 10 s for rank 0's word.
    The error a SystemExit above replaced (its context, never printed) holds the training
    loop's frames, and through them the model and zerofn's runtime; DTensor's dispatch
    cache, in C++, holds the device meshes its operations ran on, each holding its groups."""
    stopping = sys.exc_info()[1]
    if isinstance(stopping, SystemExit):
        stopping.__context__ = None
    clear_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cache is not None:     # (a private function, as yet)
        clear_cache()
