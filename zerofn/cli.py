"""The ``zerofn`` command line: one entry point for the project's tools.

    zerofn train [...]                 the main job (zerofn/train/); --help lists its flags
    zerofn plan 125m --batch 8 --world 2 [--host-budget GB]   what to turn on, and if it fits
    zerofn probe                       this machine's rates for the plan (cached)
    zerofn estimate 7B --world 8       the plan's model-state view: bytes by stage, place, role
    zerofn consolidate to-full CKPT OUT.safetensors
    zerofn convert deepspeed CKPT OUT  a DeepSpeed ZeRO checkpoint into a zerofn checkpoint
    zerofn verify CKPT                 a checkpoint's contents, checksums and safety, offline
    zerofn report LOGDIR               PNG plots of a zf.tensorboard log directory

Each subcommand is its module's own command line, imported only when it runs.
"""
from __future__ import annotations

import sys

USAGE = __doc__.split("\n\n")[1].rstrip()


def main(argv=None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns its exit code.

    Example:
        >>> main(["estimate", "7B", "--world", "8"])   # prints the stage 0-3 table
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: zerofn COMMAND [ARGS]\n\n{USAGE}\n\n`zerofn COMMAND --help` "
              f"describes each.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from . import train
        train.main(rest)
        return 0
    if command in ("plan", "probe", "estimate"):
        from .planner import cli as planner_cli
        run = {"plan": planner_cli.plan_main, "probe": planner_cli.probe_main,
               "estimate": planner_cli.estimate_main}[command]
        return run(rest, prog=f"zerofn {command}")
    if command == "consolidate":
        from . import consolidate
        return consolidate.main(rest, prog="zerofn consolidate")
    if command == "convert":
        return _convert(rest)
    if command == "verify":
        from .io.checkpoint import audit
        return audit.main(rest, prog="zerofn verify")
    if command == "report":
        from . import report           # matplotlib, only here
        return report.main(rest, prog="zerofn report")
    print(f"zerofn: unknown command {command!r}; the commands are train, plan, probe, estimate, "
          f"consolidate, convert, verify, report (see `zerofn --help`).", file=sys.stderr)
    return 2


def _convert(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: zerofn convert deepspeed CKPT OUT [--tag TAG] [--trusted]\n\nConvert "
              "another framework's checkpoint into a zerofn checkpoint. Sources: deepspeed.")
        return 0 if argv else 2
    if argv[0] != "deepspeed":
        print(f"zerofn convert: unknown source {argv[0]!r}; zerofn converts from: deepspeed.",
              file=sys.stderr)
        return 2
    from .deepspeed import convert     # loads torch pickles only when asked to
    return convert.main(argv[1:], prog="zerofn convert deepspeed")


if __name__ == "__main__":
    sys.exit(main())
