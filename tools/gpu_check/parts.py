"""The parts that build zerofn and run its own tests and job on the GPU, and every part's
runner by name: each takes the command line's arguments and returns its result (status,
figures, lines for the report, and a failure's detail)."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

from . import benchmarks, muon, parity, planning, profiling
from .catalog import LIMIT
from .commands import pytest, run, tail
from .paths import TRACE_DIR


def part_build(args) -> dict:
    rc, out = run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                   "-e", "."], LIMIT["build"] / 2)
    how = "pip install -e ."
    if rc:   # e.g. site-packages not writable: build in place (tests import from the tree)
        how = "setup.py build_ext --inplace, after pip install failed"
        rc, out = run([sys.executable, "setup.py", "build_ext", "--inplace"], LIMIT["build"] / 2)
    if rc:
        return dict(status="failed", lines=["the build failed"], detail=tail(out, 30))
    rc, out = run([sys.executable, "-c", "import json, zerofn.optim as o; "
                   "print(json.dumps(o.kernel_info()))"], 120)
    if rc:
        return dict(status="failed", lines=["built, but zerofn._C does not load"],
                    detail=tail(out))
    info = json.loads(out.strip().splitlines()[-1])
    return dict(status="ok", figures=info,
                lines=[f"built by {how}",
                       f"CPU Adam kernels: {info.get('isa')} ({info.get('threads')} threads)"])


def with_build(names: list[str], built=None) -> list[str]:
    """``names``, led by a build where a part needs ``zerofn._C`` and it does not load: a
    freshly copied tree has sources only, and every part but the build imports it."""
    if "build" in names or not names:
        return names
    built = _extension_loads() if built is None else built
    return names if built else ["build"] + names


def _extension_loads() -> bool:
    return run([sys.executable, "-c", "import zerofn._C"], 120)[0] == 0


CUDA_TESTS = ["tests/test_cuda.py",
              "tests/test_offload_copies.py::test_cuda_copy_streams_train_like_blocking_copies[False]"]
SLEEPY_TEST = "tests/test_offload_copies.py::test_cuda_copy_streams_train_like_blocking_copies[True]"
COMPILE_TEST = "tests/test_cuda.py::test_inductor_compiled_models_train_as_eager_ones"


def part_tests(args) -> dict:
    return pytest(CUDA_TESTS + ["--deselect", COMPILE_TEST], LIMIT["tests"], log="tests")


def part_compile(args) -> dict:
    return pytest([COMPILE_TEST], LIMIT["compile"], log="compile")


def part_race(args) -> dict:
    start = time.perf_counter()
    held = pytest([SLEEPY_TEST], LIMIT["race"] / 2, log="race_held")
    # The sanitizer intercepts every kernel: it gets whatever the held-back run left.
    sanitized = pytest([CUDA_TESTS[1]], LIMIT["race"] - (time.perf_counter() - start) - 5,
                       {"TORCH_CUDA_SANITIZER": "1"}, log="race_sanitizer")
    ok = held["status"] == sanitized["status"] == "ok"
    return dict(status="ok" if ok else "failed",
                figures=dict(held_back=held["figures"], sanitizer=sanitized["figures"]),
                lines=["copies and collectives held back: " + "; ".join(held["lines"]),
                       "under TORCH_CUDA_SANITIZER=1: " + "; ".join(sanitized["lines"])],
                detail="\n\n".join(d for d in (held["detail"], sanitized["detail"]) if d) or None)


JOB = [sys.executable, "-m", "zerofn", "train", "--nproc", "1", "--steps", "200",
       "--log-every", "50", "--save-dir", os.path.join(TRACE_DIR, "job"),
       "--tensorboard", os.path.join(TRACE_DIR, "job_tb")]


def part_job(args) -> dict:
    shutil.rmtree(os.path.join(TRACE_DIR, "job"), ignore_errors=True)
    first_rc, first = run(JOB + ["--stop-at", "100"], LIMIT["job"] / 2)
    rc, out = run(JOB + ["--resume"], LIMIT["job"] / 2)
    keep = ("plan:", "step ", "first loss", "final loss")
    lines = [ln.strip() for ln in (first + out).splitlines() if ln.startswith(keep)]
    final = re.search(r"final loss ([\d.]+) after 200 steps", out)
    start = re.search(r"first loss ([\d.]+)", first)
    ok = first_rc == rc == 0 and final and start and float(final[1]) < float(start[1])
    return dict(status="ok" if ok else "failed", lines=[f"`{ln}`" for ln in lines],
                figures={"final_loss": float(final[1])} if final else {},
                detail=None if ok else tail(first + out, 30))


PART_RUNNERS = {"build": part_build, "tests": part_tests, "parity": parity.part_parity,
                "job": part_job, "largest": benchmarks.part_largest,
                "largest_int8": benchmarks.part_largest_int8,
                "compare": benchmarks.part_compare, "profile": profiling.part_profile,
                "race": part_race, "compile": part_compile, "nvme": benchmarks.part_nvme,
                "deepspeed": benchmarks.part_deepspeed, "split": benchmarks.part_split,
                "split_7b": benchmarks.part_split_7b, "split_ds": benchmarks.part_split_ds,
                "plan": planning.part_plan, "muon": muon.part_muon}
