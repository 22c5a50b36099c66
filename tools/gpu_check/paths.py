"""Where the check reads and writes: the project's root, and the report, results and logs it
keeps there."""
from __future__ import annotations

import os

PACKAGE = os.path.dirname(os.path.abspath(__file__))   # runnable: python3 tools/gpu_check
TOOLS = os.path.dirname(PACKAGE)
ROOT = os.path.dirname(TOOLS)
TESTS = os.path.join(ROOT, "tests")
REPORT = os.path.join(ROOT, "docs", "gpu.md")
RESULTS = os.path.join(ROOT, "docs", "gpu_results.json")
TRACE_DIR = os.path.join(ROOT, "build", "gpu_check")   # the profiler trace: too big for docs/
