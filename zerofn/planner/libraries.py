"""Resident memory the model's own libraries add to a training process.

The probe measures a process with torch, zerofn and a process group up (probe.py). A
model built from another installed library (transformers, timm, ...) brings that
library's code and data into every rank's process: transformers' Llama or GPT-2 modules
add about 73 MiB on this machine, a tenth of a small model's peak. It is measured here, in
a fresh process, as the rise of its resident memory when it imports the modules the
model's classes come from after torch and zerofn; each set of modules once per process.
Only installed packages are imported (a module of the user's own, a script perhaps, is
not run).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

from torch import nn

_MEASURED: dict[tuple[str, ...], int] = {}
OWN = ("torch", "zerofn", "builtins", "__main__")

_SCRIPT = """
import json, sys
import torch, zerofn
from zerofn.runtime.memory import proc_bytes
before = proc_bytes("VmRSS")
for name in sys.argv[1:]:
    __import__(name)
print("RESULT " + json.dumps(proc_bytes("VmRSS") - before))
"""


def modules_of(model: nn.Module) -> tuple[str, ...]:
    """The installed modules, other than torch's and zerofn's, that define the classes of
    ``model``'s modules."""
    names = {type(m).__module__ for m in model.modules()}
    return tuple(sorted(n for n in names if n.split(".")[0] not in OWN and _installed(n)))


def _installed(name: str) -> bool:
    """Whether module ``name`` lives in an installed package (site-packages), not a file
    of the user's."""
    spec = importlib.util.find_spec(name.split(".")[0])
    origin = getattr(spec, "origin", None) or next(iter(getattr(
        spec, "submodule_search_locations", None) or []), None)
    if origin is None:
        return False
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(os.path.realpath(origin).startswith(os.path.realpath(r) + os.sep)
               for r in roots)


def resident_bytes(model: nn.Module) -> int:
    """Bytes the modules ``modules_of(model)`` add to a fresh process's resident memory
    once torch and zerofn are imported (0 where there are none)."""
    modules = modules_of(model)
    if not modules:
        return 0
    if modules not in _MEASURED:
        _MEASURED[modules] = _measure(modules)
    return _MEASURED[modules]


def _measure(modules: tuple[str, ...]) -> int:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *modules], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"measuring what importing {', '.join(modules)} adds to a process "
                           f"failed: {done.stderr[-2000:]}")
    return max(0, int(json.loads(line[len("RESULT "):])))
