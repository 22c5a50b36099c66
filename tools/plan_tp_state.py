"""``zf.plan``'s per-rank model state and buffer pool for a model tensor parallelism split,
against what zerofn holds: the (dp=2, tp=2) case of tests/test_plan_tensor_parallel.py
(tests/support/tp_plan.py) on 4 gloo ranks, with and without sequence-parallel norms, as
a markdown table (bytes after two steps; the plan's is its forward peak with the process
and the allocator's overhead left out, for data-parallel rank 0's rows of the rank's own
tensor-parallel piece).

    python tools/plan_tp_state.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.ranks import run_ranks  # noqa: E402
from support.tp_plan import held_and_planned  # noqa: E402


def main() -> None:
    print("| candidate | sp | rank | model state held | + pool held | planned | error |")
    print("|---|---|---|---|---|---|---|")
    for sp in (False, True):
        for rank, (rows, _, _) in enumerate(run_ranks(4, held_and_planned, sp, timeout=300)):
            _print(rank, sp, rows)


def _print(rank: int, sp: bool, rows) -> None:
    for c, held, _, planned, _ in rows:
        pool = sum(roles["buffers"] for roles in held.values())
        state = sum(sum(roles.values()) for roles in held.values()) - pool
        total = state + pool
        print(f"| {c.describe()} | {'yes' if sp else 'no'} | {rank} | {state:,} | {total:,} | "
              f"{planned:,} | {(planned - total) / total:+.1%} |")


if __name__ == "__main__":
    main()
