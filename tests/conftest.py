"""pytest's set-up for tests/."""
from __future__ import annotations

import os
import sys

# tests/ on sys.path, so the shared helpers import as ``support`` here, in the ranks that
# run_ranks starts (they are given this process's sys.path) and in the interpreters tests
# start with PYTHONPATH set from it. pytest's default import mode adds it as well, but
# only as a side effect of how it imports test files.
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
