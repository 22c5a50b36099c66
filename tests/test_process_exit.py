"""A process that trained with zerofn on gloo and called ``zf.finish_collectives_at_exit()``
(the front doors call it) ends without the exit abort ("terminate called without an active
exception"): at exit the collectives' threads release what they hold before Python
finalizes ([Note: the exit abort] in zerofn/runtime/process_exit.py)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from zerofn.runtime import process_exit

TOOL = Path(__file__).resolve().parents[1] / "tools" / "teardown_aborts.py"


def test_runs_ending_on_collectives_of_temporaries_never_abort():
    """Four runs of two ranks (ZeRO-3 steps, then 100 all_reduces of temporary tensors and
    the script's end): without the call, about half such runs abort (the tool's figures)."""
    env = {**os.environ, "PYTHONPATH": str(TOOL.parents[1])}
    done = subprocess.run([sys.executable, str(TOOL), "--runs", "4", "--arms", "with",
                           "--fail-on", "with"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 runs of 2 processes, 0 aborted, 0 failed otherwise" in done.stdout


def test_the_settle_waits_while_another_thread_runs():
    """A thread hashing without the GIL is running the whole time: the settle waits it out.
    It hashes 16 times what the caller hashed alone; the settle waits at least 4 times as
    long as that took."""
    small = os.urandom(1 << 24)
    large = small * 16
    start = time.monotonic()
    hashlib.sha256(small)
    alone = time.monotonic() - start
    hashing = threading.Thread(target=hashlib.sha256, args=(large,))
    hashing.start()
    waited = process_exit.settle(longest=60)
    hashing.join()
    assert waited >= 4 * alone


def test_the_settle_ends_when_no_other_thread_runs():
    assert process_exit.settle(longest=30) < 30
