"""The tests' shared launches (support/shared_runs.py): one run per arguments, whose result
or failure every test that asks gets, without launching it again."""
from __future__ import annotations

import pytest

from support.shared_runs import shared


def test_a_shared_launch_runs_once_per_arguments_and_its_failure_reaches_every_caller():
    calls = []

    @shared
    def launch(world):
        calls.append(world)
        if world == 2:
            raise AssertionError("rank 1 of 2 failed")
        return 10 * world

    assert [launch(1), launch(1)] == [10, 10]
    for _ in range(2):
        with pytest.raises(AssertionError, match="rank 1 of 2 failed"):
            launch(2)
    assert calls == [1, 2]
