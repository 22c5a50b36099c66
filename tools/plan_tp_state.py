"""``zf.plan``'s per-rank model state and buffer pool for a model tensor parallelism split,
against what zerofn holds: the (dp=2, tp=2) case of tests/test_plan_tensor_parallel.py on 4
gloo ranks, as a markdown table (bytes after two steps; the plan's is its forward peak
with the process and the allocator's overhead left out, rank 0's rows).

    python tools/plan_tp_state.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.ranks import run_ranks  # noqa: E402
from test_plan_tensor_parallel import held_and_planned  # noqa: E402


def main() -> None:
    print("| candidate | rank | model state held | + pool held | planned | error |")
    print("|---|---|---|---|---|---|")
    for rank, (rows, _, _) in enumerate(run_ranks(4, held_and_planned, timeout=300)):
        for c, held, _, planned in rows:
            pool = sum(roles["buffers"] for roles in held.values())
            state = sum(sum(roles.values()) for roles in held.values()) - pool
            total = state + pool
            print(f"| {c.describe()} | {rank} | {state:,} | {total:,} | {planned:,} | "
                  f"{(planned - total) / total:+.1%} |")


if __name__ == "__main__":
    main()
