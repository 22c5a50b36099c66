"""``zerofn plan`` and ``zerofn probe``: the planner's command lines.

    zerofn plan 125m --batch 8 --world 2 --host-budget 6
    zerofn plan width=4096,layers=32,heads=32,ffn=11008,vocab=32000,context=2048 \\
        --batch 1 --world 8 --precision bf16 --device-budget 80 --gpu --json
    zerofn probe                      # this machine's rates, probed once and cached
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from .probe import cache_path, load_or_probe
from .search import MARGIN, NoPlanFits, dumps, plan

GB = 1e9


def model_from(text: str):
    """A ``zerofn train`` preset (tiny, small, 125m, 350m, 1b), or a GPT described by
    ``key=value`` pairs of zerofn.nanogpt's GPTConfig; built on the meta device."""
    from zerofn.nanogpt import GPT, PRESETS, GPTConfig
    if text in PRESETS:
        cfg = PRESETS[text]
    elif "=" in text:
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        pairs = dict(kv.split("=", 1) for kv in text.split(","))
        unknown = set(pairs) - fields
        if unknown:
            raise ValueError(f"{', '.join(sorted(unknown))}: a GPT is described by "
                             f"{', '.join(sorted(fields))}.")
        cfg = GPTConfig(**{k: int(v) for k, v in pairs.items()})
    else:
        raise ValueError(f"{text!r}: give a preset ({', '.join(PRESETS)}) or a GPT as "
                         f"key=value pairs (width=1024,layers=8,...).")
    with torch.device("meta"):
        return GPT(cfg), cfg


def plan_main(argv=None, prog: str = "zerofn plan") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Every way to train the model at "
                                "this world size, its predicted peak memory and step time, "
                                "and the choice (docs/plan.md).")
    p.add_argument("model", help="a preset (tiny, small, 125m, 350m, 1b) or "
                                 "width=...,layers=...,heads=...,ffn=...,vocab=...,context=...")
    p.add_argument("--batch", type=int, required=True, help="sequences per rank per step")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--context", type=int, help="tokens per sequence (default the model's)")
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument("--device-budget", type=float, help="GB per rank on the device")
    p.add_argument("--host-budget", type=float, help="GB of host memory per rank")
    p.add_argument("--disk", type=float, help="GB of NVMe per rank")
    p.add_argument("--no-nvme", action="store_true", help="leave NVMe offload out")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help="a candidate fits where its predicted peaks this share above them "
                        f"are within the budgets (default {MARGIN}: the model's error)")
    p.add_argument("--saves", choices=("sync", "async", "none"), default="sync",
                   help="how the run saves checkpoints: its save phase's host memory "
                        "(async: a host copy of the state first)")
    p.add_argument("--gpu", action="store_true",
                   help="plan for a GPU, with a GPU's probe: this machine's where it has one, "
                        "else --probe (`zerofn probe` run on the GPU machine)")
    p.add_argument("--probe", help="a probe's JSON (default this machine's, cached)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--all", action="store_true", help="every candidate in the table")
    args = p.parse_args(argv)
    try:
        model, cfg = model_from(args.model)
        if args.batch < 1 or args.world < 1:
            raise ValueError("--batch and --world are at least 1.")
        x = torch.zeros(args.batch, args.context or cfg.context, dtype=torch.long)
        if args.gpu and args.probe is None and not torch.cuda.is_available():
            raise ValueError(_NO_GPU_PROBE.format(what="this machine has no GPU"))
        machine = _machine(args.probe)
        if args.gpu and not machine.extra.get("cuda"):
            raise ValueError(_NO_GPU_PROBE.format(
                what=f"the probe {args.probe or cache_path()} measured a CPU ({machine.device})"))
        result = plan(model, (x, x), world=args.world, precision=args.precision,
                      device_budget=_bytes(args.device_budget),
                      host_budget=_bytes(args.host_budget), disk_budget=_bytes(args.disk),
                      machine=machine, on_gpu=args.gpu or None, nvme=not args.no_nvme,
                      margin=args.margin, saves=None if args.saves == "none" else args.saves)
    except NoPlanFits as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(dumps(result) if args.json else result.table(None if args.all else 20))
    return 0


_NO_GPU_PROBE = ("--gpu plans with a GPU's rates and memory, but {what}: run `zerofn probe` on "
                 "the GPU machine and give its JSON here with --probe FILE.")


def probe_main(argv=None, prog: str = "zerofn probe") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Measure this machine's rates and "
                                "memory for the planner, and cache them.")
    p.add_argument("--refresh", action="store_true", help="probe again, not the cache")
    p.add_argument("--nvme-path", help="the directory NVMe offload would use")
    p.add_argument("--cache", help=f"the cache file (default {cache_path()})")
    args = p.parse_args(argv)
    machine = load_or_probe(args.cache, refresh=args.refresh, nvme_path=args.nvme_path)
    print(json.dumps(machine.to_json(), indent=1))
    return 0


def _machine(path):
    if path is None:
        return load_or_probe()
    from .probe import Machine
    with open(path) as f:
        return Machine.from_json(json.load(f))


def _bytes(gb):
    return None if gb is None else gb * GB
