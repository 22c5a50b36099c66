"""``zerofn plan``, ``zerofn probe`` and ``zerofn estimate``: the planner's command lines.

    zerofn plan 125m --batch 8 --world 2 --host-budget 6
    zerofn plan 125m --batch 8 --world 4 --optimizer muon   # Muon's owners, their balance
    zerofn plan width=4096,layers=32,heads=32,ffn=11008,vocab=32000,context=2048 \\
        --batch 1 --world 8 --precision bf16 --device-budget 80 --gpu --json
    zerofn probe                      # this machine's rates, probed once and cached
    zerofn estimate 7B --world 8      # model state alone: the stage 0-3 table, bf16 + Adam
    zerofn estimate --model 1b --world 2 --offload cpu --offload-params
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from torch import nn

from zerofn.core.estimate import DTYPES, HOST_RING_DEPTH, count_params, parse_count, table
from zerofn.core.plan import OffloadPolicy

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
                        "(async: its copies, within save_checkpoint's default staging_bytes, "
                        "beside the steps that follow)")
    p.add_argument("--gpu", action="store_true",
                   help="plan for a GPU, with a GPU's probe: this machine's where it has one, "
                        "else --probe (`zerofn probe` run on the GPU machine)")
    p.add_argument("--probe", help="a probe's JSON (default this machine's, cached)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                   help="adamw (default); muon: torch.optim.Muon over the blocks' matrices, "
                        "AdamW over the rest; adafactor: torch.optim.Adafactor over every "
                        "parameter. Muon's and Adafactor's parameters are each stepped whole "
                        "by one owner rank: the plan counts their state there and prints the "
                        "owners' balance")
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
                      margin=args.margin, saves=None if args.saves == "none" else args.saves,
                      optimizers=OPTIMIZERS[args.optimizer](model))
    except NoPlanFits as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(dumps(result) if args.json else result.table(None if args.all else 20))
    return 0


def _muon_and_adamw(model: nn.Module) -> tuple:
    """Muon over the blocks' matrices, AdamW over the rest (embeddings, head, norms,
    biases), as torch's Muon documentation pairs them and docs/optimizers.md builds them."""
    named = [(n, p) for n, p in model.named_parameters()]
    matrices = [p for n, p in named if n.startswith("blocks.") and p.ndim == 2]
    taken = {id(p) for p in matrices}
    return (torch.optim.Muon(matrices), torch.optim.AdamW([p for _, p in named
                                                           if id(p) not in taken]))


# ``zerofn plan --optimizer``: the optimizers each name builds over the (meta) model
OPTIMIZERS = {"adamw": lambda model: None, "muon": _muon_and_adamw,
              "adafactor": lambda model: torch.optim.Adafactor(model.parameters())}


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


# -- zerofn estimate --------------------------------------------------------------------
def _description(n: int, world: int, precision: str, optimizer_states: int,
                 offload: str | None, offload_params: bool, master: str = "fp32",
                 state: str = "fp32") -> str:
    masters = "" if precision == master == state else \
        f", {master} masters" + (f" and {state} optimizer state" if state != master else "")
    where = "" if offload is None else f", offload {offload}" + \
        (" (params too)" if offload_params else "")
    return (f"{n / 1e9:,.3g}B parameters, {world} rank{'s' * (world != 1)}, {precision} compute"
            f"{masters}, {optimizer_states} optimizer state(s) per parameter{where}.\n"
            f"Model-state bytes per rank in GB (10^9 bytes); communication buffers and "
            f"activations come on top.")


def estimate_main(argv=None, prog: str = "zerofn estimate") -> int:
    """``zerofn estimate``: model-state bytes per rank by stage, place and role, before
    building anything, from zerofn/core/estimate.py's formulas (``zerofn plan`` adds
    activations, buffers, the process and step time; docs/plan.md)."""
    p = argparse.ArgumentParser(prog=prog, description="Model-state bytes per rank by place "
                                "(device, host, NVMe) and role, before building anything.")
    p.add_argument("size", nargs="?", help="parameter count: 7e9, 7B, 1.3B, 350M ...")
    p.add_argument("--model", help="a `zerofn train` preset instead of SIZE "
                                   "(tiny, small, 125m, 350m, 1b)")
    p.add_argument("--world", type=int, default=8, help="ranks sharing the state (default 8)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                   help="one ZeRO stage (default: every stage the offload allows)")
    p.add_argument("--precision", choices=sorted(DTYPES), default="bf16",
                   help="compute dtype (default bf16; masters and optimizer state are fp32)")
    p.add_argument("--optimizer-states", type=int, default=2,
                   help="state tensors per parameter (Adam 2, SGD with momentum 1)")
    p.add_argument("--offload", choices=("cpu", "nvme"), help="offload the optimizer")
    p.add_argument("--offload-params", action="store_true",
                   help="ZeRO-3: offload the parameter shards too")
    p.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="how the optimizer's moments are stored (offload's state_dtype; "
                        "int8: 8-bit codes and a scale per 256)")
    p.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="how the masters are stored (offload's master_dtype; bf16 needs "
                        "--precision bf16)")
    p.add_argument("--units-in-flight", type=int, default=OffloadPolicy.units_in_flight,
                   help="NVMe staging buffers in host memory (default %(default)s, as "
                        "offload's)")
    p.add_argument("--largest-unit",
                   help="parameters of the largest unit (one block, or the embeddings and "
                        "head), which sizes NVMe's staging buffers and CPU offload's host "
                        "ring; --model knows it")
    args = p.parse_args(argv)
    try:
        model = _estimate_model(args)
        largest = parse_count(args.largest_unit) if args.largest_unit else None
        if args.world < 1 or args.units_in_flight < 1:
            raise ValueError(f"--world {args.world}, --units-in-flight "
                             f"{args.units_in_flight}: at least 1 of each.")
        stages = [args.stage] if args.stage is not None else \
            [3] if args.offload_params else [1, 2, 3] if args.offload else [0, 1, 2, 3]
        text = table(model, args.world, stages, DTYPES[args.precision], args.optimizer_states,
                     args.offload, args.offload_params, units_in_flight=args.units_in_flight,
                     largest_unit=largest, **_stored_dtypes(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = count_params(model)
    print(_description(n, args.world, args.precision, args.optimizer_states, args.offload,
                       args.offload_params, args.master_dtype, args.state_dtype))
    print(text)
    ringed = args.offload == "cpu" and not args.offload_params and args.optimizer_states == 2
    if args.offload == "nvme" or ringed:
        counted = largest is not None or isinstance(model, nn.Module)
        staged = f"NVMe offload stages {args.units_in_flight} units" if args.offload == "nvme" \
            else f"CPU offload passes gradients and rows through {HOST_RING_DEPTH} units"
        print(f"{staged} in host memory: " + ("counted under host." if counted else
                                              "not counted (give --largest-unit, or --model)."))
    return 0


def _stored_dtypes(args) -> dict:
    """``--master-dtype``/``--state-dtype`` as ``estimate_placement`` takes them, checked as
    ``offload()`` checks them."""
    if (args.master_dtype, args.state_dtype) == ("fp32", "fp32"):
        return {}
    if args.offload is None:
        raise ValueError("--master-dtype/--state-dtype describe the state offload stores: "
                         "add --offload cpu or nvme.")
    if args.master_dtype == "bf16" and args.precision != "bf16":
        raise ValueError("--master-dtype bf16 needs --precision bf16: bf16 masters are the "
                         "rows the device computes with.")
    state = torch.int8 if args.state_dtype == "int8" else DTYPES[args.state_dtype]
    return dict(master_dtype=DTYPES[args.master_dtype], state_dtype=state)


def _estimate_model(args) -> int | nn.Module:
    """The parameter count given, or the preset GPT, built on the meta device (no memory)."""
    if (args.size is None) == (args.model is None):
        raise ValueError("give a parameter count (e.g. 7B) or --model PRESET, one of them.")
    if args.model is None:
        return parse_count(args.size)
    from zerofn.nanogpt import GPT, PRESETS
    if args.model not in PRESETS:
        raise ValueError(f"--model {args.model!r}: the presets are {', '.join(PRESETS)}.")
    with torch.device("meta"):
        return GPT(PRESETS[args.model])
