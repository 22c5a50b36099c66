"""A collective one rank never joins (an evaluation on rank 0 alone under ZeRO-3) is named
on the waiting rank after ``stall_warning`` seconds, and ``timeout=`` ends the wait with a
RankFailure."""
from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch
import torch.distributed as dist

from support.loops import zero
from support.models import batches, make_models
from support.ranks import run_ranks

pytestmark = pytest.mark.timed   # (conftest.py: run alone, after the rest)

STALL, TIMEOUT = 2.0, 8.0


class Kept(logging.Handler):
    """zerofn's log records, with when they came (seconds from ``start``)."""

    def __init__(self, start: float):
        super().__init__(logging.WARNING)
        self.start, self.records = start, []

    def emit(self, record):
        self.records.append((time.monotonic() - self.start, record.getMessage()))


def one_rank_evaluates(rank, world):
    _, model = make_models()
    model = zero(3, timeout=TIMEOUT, stall_warning=STALL)(model)
    elsewhere = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    [(x, y)] = batches(1, 1, world)[0]
    start = time.monotonic()
    kept = Kept(start)
    logging.getLogger("zerofn").addHandler(kept)
    try:
        if rank == 0:
            with torch.no_grad():
                model(x, y)           # an evaluation on this rank alone
        else:                         # the other rank waits in a collective of its own
            dist.all_reduce(torch.ones(1), group=elsewhere)
        ended = None
    except Exception as e:  # (what each rank raised, and when)
        ended = (type(e).__name__, str(e), time.monotonic() - start)
    finally:
        logging.getLogger("zerofn").removeHandler(kept)
    return ended, kept.records


@pytest.mark.multirank
def test_a_gather_one_rank_never_joins_is_named_then_ended_by_the_timeout():
    (ended, records), (other, quiet) = run_ranks(2, one_rank_evaluates, timeout=120)
    assert ended is not None and ended[0] == "RankFailure", ended
    assert TIMEOUT - 1 <= ended[2] <= TIMEOUT + 12, ended
    assert other is not None and other[2] <= TIMEOUT + 12, other
    assert len(records) == 1, records
    at, message = records[0]
    assert STALL <= at <= STALL + 2, records
    assert message.startswith("zerofn: rank 0 has waited 2 s in the all_gather of unit "), message
    assert "(forward of step 1" in message and "run it on every rank" in message, message
    assert f"after the timeout ({TIMEOUT:g} s" in message
    assert not quiet          # (rank 1 waited in no collective of zerofn's)
