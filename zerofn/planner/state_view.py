"""``zerofn estimate``: the plan's model-state view: model-state bytes per rank by stage,
place and role, before building anything, from zerofn/core/estimate.py's formulas
(``zerofn plan`` adds activations, buffers, the process and step time; docs/plan.md).

    zerofn estimate 7B --world 8                       # the stage 0-3 table, bf16 + Adam
    zerofn estimate --model 1b --world 2 --offload cpu --offload-params
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from zerofn.core.estimate import DTYPES, HOST_RING_DEPTH, count_params, parse_count, table
from zerofn.core.plan import OffloadPolicy


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


def main(argv=None, prog: str = "python -m zerofn estimate") -> int:
    """The command line (``zerofn estimate``); ``prog`` names it in the help."""
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
        model = _model(args)
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


def _model(args) -> int | nn.Module:
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

