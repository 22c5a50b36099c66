"""``zerofn train`` under torchrun for the elastic, failure and multi-node tests: a tiny
GPT, two ranks, six steps, a checkpoint every two; its per-step losses as printed."""
from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")     # what tests start as processes
FAULTY = os.path.join(SCRIPTS, "faulty_train.py")
# A script's interpreter finds zerofn in this checkout and the tests' helpers (support/).
SCRIPT_PATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
STEPS = 6
JOB = ["--model", "tiny", "--layers", "2", "--steps", str(STEPS), "--batch", "4",
       "--log-every", "1", "--eval-batches", "1", "--stage", "3", "--save-every", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launcher: list[str], flags: list[str], fault: str | None = None,
             script: str = FAULTY, env: dict | None = None) -> subprocess.Popen:
    """Start ``torchrun LAUNCHER tests/scripts/faulty_train.py JOB FLAGS`` (no fault unless
    given), or ``torchrun LAUNCHER SCRIPT FLAGS``; ``env`` adds to the environment."""
    env = dict(os.environ, PYTHONPATH=SCRIPT_PATH, OMP_NUM_THREADS="1", **(env or {}))
    env.pop("ZEROFN_TEST_FAULT", None)
    if fault:
        env["ZEROFN_TEST_FAULT"] = fault
    job = JOB if script == FAULTY else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.2",
           *launcher, script, *job, *flags]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str, float]:
    """(exit code, output, seconds) of a started job."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the launcher and its ranks: no leftovers
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{out}") from None
    return proc.returncode, out, time.monotonic() - start


def run(flags: list[str], fault: str | None = None, restarts: int = 0, env: dict | None = None):
    return finish(torchrun(["--standalone", "--nproc-per-node", "2",
                            "--max-restarts", str(restarts)], flags, fault, env=env))


def losses(output: str) -> dict[int, str]:
    """{step: loss as printed}; a step printed twice (rerun after a restart) keeps the
    last."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"step\s+(\d+)/\d+\s+loss (\S+)", output)}


@functools.lru_cache(maxsize=None)
def uninterrupted(tmp_root: str) -> dict[int, str]:
    """The job's losses without failures (once per test session)."""
    code, out, _ = run(["--save-dir", os.path.join(tmp_root, "uninterrupted")])
    assert code == 0, out
    return losses(out)


def survivors(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker`` (a run's own directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found
