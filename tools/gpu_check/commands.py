"""Running a part's commands: a subprocess killed whole on its timeout, and pytest's summary
as a part's result."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from .paths import ROOT, TRACE_DIR


def run(cmd: list[str], timeout: float, env: dict | None = None,
        cwd: str = ROOT) -> tuple[int, str]:
    """``(exit status, stdout+stderr)``; a timeout is status 124 with what was printed, and
    a command that cannot start is status 127.

    The command runs in a session of its own, killed whole on a timeout: the ranks a test
    spawns would otherwise outlive it, holding the GPU's memory through the next parts."""
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **(env or {})},
                                start_new_session=True)
    except OSError as e:
        return 127, f"{cmd[0]}: {e}"
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out + f"\n(timed out after {timeout:.0f} s)"


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def pytest_result(rc: int, out: str) -> dict:
    """Pass/fail counts and the failing tests from pytest's summary."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    ok = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped")
    return dict(status="ok" if ok else "failed", figures=counts,
                lines=[f"pytest: {', '.join(f'{v} {k}' for k, v in counts.items()) or 'no summary'}"]
                + [f"failed: `{f}`" for f in failed],
                detail=None if ok else tail(out, 30))


def pytest(targets: list[str], timeout: float, env: dict | None = None, log: str = "") -> dict:
    """The tests' result; their whole output goes to ``TRACE_DIR/<log>.log`` where ``log`` is
    given (the report keeps only its tail)."""
    rc, out = run([sys.executable, "-m", "pytest", "-q", "-rfEs", *targets], timeout, env)
    if log:
        os.makedirs(TRACE_DIR, exist_ok=True)
        with open(os.path.join(TRACE_DIR, f"{log}.log"), "w") as f:
            f.write(out)
    return pytest_result(rc, out)
