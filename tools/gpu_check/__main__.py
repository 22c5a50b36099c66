"""The command line: ``python3 tools/gpu_check.py [options]`` (or ``python3 tools/gpu_check``):
which parts run, within what budget, and what each writes (the results, the report and
their copies)."""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import time
import traceback

if not __package__:
    # Run as a folder (python3 tools/gpu_check), Python puts the package's own folder first
    # on sys.path, where its modules would pass for top-level ones: tools/ goes there instead,
    # so that the package imports by its name, as it does from tools/gpu_check.py.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path
                                              if os.path.abspath(p or os.curdir) != _here]

import gpu_check  # noqa: E402 (found through the path above)
from gpu_check.catalog import LIMIT, PART_NAMES  # noqa: E402
from gpu_check.commands import tail  # noqa: E402
from gpu_check.parts import PART_RUNNERS, with_build  # noqa: E402
from gpu_check.paths import REPORT, RESULTS, ROOT, TRACE_DIR  # noqa: E402
from gpu_check.profiling import TRACE, profile_worker  # noqa: E402
from gpu_check.report import render, render_plan  # noqa: E402
from gpu_check.results import RUN_KEYS, environment, expand_pending, load_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=gpu_check.__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PART_NAMES),
                   help=f"comma-separated parts to run, in order: {', '.join(PART_NAMES)}; "
                   "'pending' stands for every part the results do not hold as passed")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="start a part only while its whole time limit fits in what is left "
                   "of SECONDS, so that a command under a time limit is never cut mid-part")
    p.add_argument("--plan", action="store_true",
                   help="write the report as 'not yet run', listing what the check runs")
    p.add_argument("--render", action="store_true",
                   help="rewrite the report from the results as they are, running no part "
                   "(after parts.toml or the renderer changed)")
    p.add_argument("--results", default=RESULTS, help="JSON the results accumulate in")
    p.add_argument("--report", default=REPORT, help="the markdown report to write")
    p.add_argument("--copy-to", metavar="DIR", help="also copy report, results and trace here")
    p.add_argument("--fresh", action="store_true", help="forget earlier results first")
    p.add_argument("--nvme-dir", default=os.path.join(ROOT, "build", "gpu_check", "nvme"),
                   help="where the NVMe part puts its swap file")
    p.add_argument("--deepspeed-wheel", help="a DeepSpeed wheel to install (offline)")
    p.add_argument("--worker", choices=("profile",), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in args.parts if s not in PART_NAMES + ["pending"]]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PART_NAMES)}")
    return args


def write_report(args, results: dict, save: bool = True) -> None:
    """The report (the plan with ``--plan``), and where ``save`` the results; then their
    copies, the trace and the logs with ``--copy-to``."""
    if save:
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    with open(args.report, "w") as f:
        f.write(render_plan() if args.plan else render(results))
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        for path in (args.report, args.results, TRACE,
                     *glob.glob(os.path.join(TRACE_DIR, "*.log"))):
            if os.path.exists(path):
                shutil.copy(path, args.copy_to)


def run_part(name: str, args, env: dict) -> dict:
    """The part's result, timed and marked with where it ran; a part that raises is a
    failed result, so the parts after it still run."""
    print(f"# {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        r = PART_RUNNERS[name](args)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        r = dict(status="failed", lines=[f"{type(e).__name__}: {first}"[:300]],
                 detail=tail(traceback.format_exc(), 30))
    r["seconds"] = time.perf_counter() - start
    r.update({k: env[k] for k in RUN_KEYS})
    print(f"# {name}: {r['status']} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return r


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "profile":
        return profile_worker(args)
    deadline = None if args.budget is None else time.perf_counter() + args.budget
    results = load_results(args.results, args.fresh)
    if args.plan or args.render:
        write_report(args, results, save=False)
        return
    results["env"] = environment()
    for name in with_build(expand_pending(args.parts, results["parts"])):
        left = math.inf if deadline is None else deadline - time.perf_counter()
        if left < LIMIT[name]:
            print(f"# {name}: not started, its limit ({LIMIT[name]:.0f} s) is more than the "
                  f"{left:.0f} s of budget left", file=sys.stderr, flush=True)
            continue
        results["parts"][name] = run_part(name, args, results["env"])
        write_report(args, results)
    print(render(results))


if __name__ == "__main__":
    main()
