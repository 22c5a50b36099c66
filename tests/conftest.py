"""pytest's set-up for tests/: the shared helpers on sys.path, the markers (select with
``-m``; tests/README.md says which files each covers), and the skips two of them imply."""
from __future__ import annotations

import os
import sys

import pytest

# tests/ on sys.path, so the shared helpers import as ``support`` here, in the ranks that
# run_ranks starts (they are given this process's sys.path) and in the interpreters tests
# start with PYTHONPATH set from it. pytest's default import mode adds it as well, but
# only as a side effect of how it imports test files.
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from support import SLOW  # noqa: E402 (found through the path above)
from support.shared_runs import SharedRuns  # noqa: E402

MARKERS = {
    "multirank": "runs ranks in processes of their own (run_ranks, spawned ranks, torchrun "
                 "or zerofn train jobs)",
    "cuda": "needs a CUDA device; skipped without one",
    "hf": "needs Hugging Face transformers",
    "deepspeed": "DeepSpeed compatibility (zerofn.deepspeed, its configs and checkpoints); "
                 "DeepSpeed itself is not needed",
    "timed": "asserts how long something takes or waits out a timeout (failures, stalls); "
             "scripts/test.sh runs these alone, after the rest, so that other tests' load "
             "cannot move their clocks",
    "slow(reason)": "runs only with ZEROFN_SLOW=1; skipped otherwise, saying why it is slow",
}


# The files whose tests take longest (minutes each on 2 cores), collected first and in this
# order: scripts/test.sh's workers take a file at a time in collection order, so a long
# file collected last would run alone at the end while the other workers idle.
LONGEST_FIRST = ("test_train.py", "test_bench_offload.py", "test_data_resume.py",
                 "test_tutorials.py", "test_plan.py", "test_trainer.py", "test_lightning.py",
                 "test_streamed_save.py", "test_checkpoint.py", "test_docs.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable: files whole


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_runtest_setup(item):
    slow = item.get_closest_marker("slow")
    if slow and not SLOW:
        pytest.skip(f"ZEROFN_SLOW=1 runs it: {slow.kwargs.get('reason', 'slow')}")
    if item.get_closest_marker("cuda"):
        import torch
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.fixture(scope="module")
def shared_runs():
    """``run_ranks`` for the tests of one file that assert on one run of the ranks: each
    (world, function, arguments) runs once (support/shared_runs.py)."""
    return SharedRuns()


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory) -> str:
    """A swap-file directory the runs of one file share."""
    return str(tmp_path_factory.mktemp("swap"))
