"""Importing every zerofn module and applying a transform leave the process as they found
it, as FSDP2's ``fully_shard`` does: ``sys.excepthook``, the exit handlers, the timeout of
the user's process group (``timeout=`` included: zerofn's goes on a group of its own),
glibc's mmap threshold and Lightning's strategy registries. Each process-wide change is
zerofn's only where asked (``zf.name_uncaught_errors()``, ``zf.return_large_frees()``,
``zf.finish_collectives_at_exit()``, ``register_strategies()``), and the check sees each
one of them once made.

One fresh interpreter runs it all (tests/scripts/process_state.py), since pytest itself
hooks some of these."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from support.jobs import ROOT, SCRIPT_PATH, SCRIPTS
SCRIPT = os.path.join(SCRIPTS, "process_state.py")


def changes() -> dict:
    """The script's report: what changed after the imports and the transforms, and after
    each change made on purpose."""
    done = subprocess.run([sys.executable, SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=SCRIPT_PATH, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_imports_and_transforms_change_nothing_process_wide():
    report = changes()
    print(f"\n{json.dumps(report, indent=1)}")
    assert report["after transforms"] == [], report["after transforms"]
    # Each change the check looks for, made as a user would ask for it, is seen: the
    # check can fail (and each only by its own key).
    planted = {"name_uncaught_errors": ["excepthook"], "background": ["atexit"],
               "register_strategies": ["lightning"], "_set_pg_timeout": ["user group timeout"],
               "return_large_frees": ["mallopt"], "finish_collectives_at_exit": ["atexit"]}
    if not report["lightning installed"]:
        del planted["register_strategies"]
    for change, keys in planted.items():
        assert report[change] == keys, (change, report[change])
