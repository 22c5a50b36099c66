"""``import zerofn`` leaves the DeepSpeed adapter unloaded, and ``import zerofn.deepspeed``
its engine, until one of their names is used; each check runs in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code: str) -> str:
    """Run ``code`` in a new Python from the repository root (this checkout's zerofn)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_zerofn_loads_no_deepspeed_module():
    loaded = run("import sys, zerofn\n"
                 "print(sorted(m for m in sys.modules if m.startswith('zerofn.deepspeed')))")
    assert loaded.strip() == "[]"


def test_the_face_resolves_its_deepspeed_names():
    run("""
import zerofn
assert {"from_deepspeed_config", "deepspeed"} <= set(dir(zerofn))
assert set(zerofn.__all__) <= set(dir(zerofn))
lazy = zerofn.from_deepspeed_config
from zerofn.deepspeed.config import from_deepspeed_config
assert lazy is from_deepspeed_config
assert all(hasattr(zerofn, name) for name in zerofn.__all__)
assert not hasattr(zerofn, "no_such_name")   # an AttributeError, as for any module
""")


def test_submodule_attribute_works_without_importing_it():
    run("import zerofn\nassert zerofn.deepspeed.initialize.__module__ == 'zerofn.deepspeed.engine'")


def test_deepspeed_loads_its_engine_on_first_use():
    run("""
import sys
import zerofn.deepspeed as deepspeed
assert "zerofn.deepspeed.engine" not in sys.modules
assert {"initialize", "DeepSpeedEngine", "engine"} <= set(dir(deepspeed))
init = deepspeed.initialize
engine = sys.modules["zerofn.deepspeed.engine"]
assert init is engine.initialize and deepspeed.engine is engine
from zerofn.deepspeed import DeepSpeedEngine, add_config_arguments, init_distributed
assert DeepSpeedEngine is engine.DeepSpeedEngine
assert all(hasattr(deepspeed, name) for name in deepspeed.__all__)
assert not hasattr(deepspeed, "no_such_name")
""")


def test_import_zerofn_installs_nothing_process_wide():
    """No exit handler, exception hook or process-group setting at import: the background
    saver registers its exit wait at the first async save, the failure watch its hook
    when a transform installs it."""
    out = run("import atexit, sys, torch, torch.distributed.checkpoint\n"
              "n, hook = atexit._ncallbacks(), sys.excepthook\n"
              "import zerofn, zerofn.io.checkpoint.api as api\n"
              "print(atexit._ncallbacks() - n, sys.excepthook is hook, api._background)")
    assert out.split() == ["0", "True", "None"]
