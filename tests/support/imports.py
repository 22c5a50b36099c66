"""What a fresh interpreter holds once it imported zerofn's public modules: one process
that the tests of zerofn's optional dependencies share. It imports every module any of
them names, so a package absent here is absent after each one's imports."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PUBLIC = ("zerofn", "zerofn.cli", "zerofn.consolidate", "zerofn.integrations",
          "zerofn.pretrained")


@functools.lru_cache(maxsize=None)
def loaded_by_zerofn() -> frozenset[str]:
    """The names in ``sys.modules`` after ``import`` of PUBLIC (this checkout's zerofn), run
    once per session."""
    code = f"import sys\nimport {', '.join(PUBLIC)}\nprint('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    loaded = frozenset(done.stdout.split())
    assert set(PUBLIC) <= loaded, done.stdout     # what was asked for was read back
    return loaded
