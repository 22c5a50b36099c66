"""``zerofn train --plan auto``: the job's stage, offload, stored dtypes, activation
checkpointing and micro-batch × accumulation from the plan's choice (zerofn.planner),
within ``--device-budget`` and ``--host-budget`` (where not given, what is free at
start). Rank 0 plans (its machine's probe) and every rank takes its choice, so ranks of
machines with different probes cannot differ."""
from __future__ import annotations

import json
from dataclasses import replace

import torch
import torch.distributed as dist

from zerofn.nanogpt import GPT
from zerofn.planner.probe import Machine, load_or_probe
from zerofn.planner.search import NoPlanFits, candidates, free_budgets, plan
from zerofn.runtime.agree import from_first

CHOSEN = ("stage", "offload", "offload_params", "offload_ratio", "state_dtype",
          "master_dtype", "grad_accum", "activation_checkpointing")


def refusals(args) -> list[str]:
    """Flags ``--plan auto`` chooses itself, given too."""
    return [f"--{name.replace('_', '-')}" for name in CHOSEN
            if getattr(args, name, None) not in (None, False)]


def planned(job, args, device: torch.device):
    """``job`` with the plan's choice in it; prints the choice and why on rank 0. Raises
    ValueError on every rank when nothing fits (naming the smallest budget that would)."""
    world = dist.get_world_size()
    choice, message = None, None
    if dist.get_rank() == 0:
        try:
            result = _plan(job, args, device, world)
            choice, message = result.choice.to_json(), result.reason
        except (NoPlanFits, ValueError, OSError) as e:     # told to every rank below
            message = str(e)
    choice, message = from_first((choice, message), dist.group.WORLD)
    if choice is None:
        raise ValueError(f"--plan auto (rank 0's plan): {message}")
    if dist.get_rank() == 0:
        print(f"zerofn plan: {message}", flush=True)
    job.stage, job.offload = choice["stage"], choice["offload"]
    job.offload_params, job.offload_ratio = choice["params"], choice["ratio"]
    job.state_dtype, job.master_dtype = choice["state_dtype"], choice["master_dtype"]
    job.grad_accum = choice["accum"]
    job.cfg = replace(job.cfg, checkpoint=choice["checkpoint"])
    return job


def _plan(job, args, device, world):
    per_rank = job.batch // world
    if per_rank < 1 or job.batch % world:
        raise ValueError(f"--batch {job.batch} does not split over {world} ranks.")
    if job.precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision {job.precision}: the plan weighs fp32 and bf16.")
    with torch.device("meta"):
        model = GPT(replace(job.cfg, checkpoint=False))
    x = torch.zeros(1, job.cfg.context, dtype=torch.long)
    on_gpu = device.type == "cuda"
    # zerofn train runs stages 1-3 (no DDP) and NVMe only where a path is given
    pool = [c for c in candidates(per_rank, job.precision, job.nvme_path is not None)
            if c.stage]
    free = free_budgets(on_gpu)     # where a budget is not given: what is free now
    saves = "async" if args.save_dir else None     # (the loop saves in the background)
    budget = _device_budget(job.device_budget, on_gpu)
    return plan(model, (x, x), world=world, batch=per_rank, precision=job.precision,
                device_budget=free.get("device") if budget is None else budget,
                host_budget=free["host"] if args.host_budget is None else args.host_budget,
                machine=_machine(args.probe), on_gpu=on_gpu, only=pool, saves=saves)


def _device_budget(budget, on_gpu: bool):
    """Bytes as given; a share of the device's free memory on a GPU."""
    if budget is None or isinstance(budget, int):
        return budget
    if not on_gpu:
        raise ValueError("--device-budget as a share needs a GPU; on a CPU give bytes.")
    return budget * torch.cuda.mem_get_info()[0]


def _machine(path):
    if path is None:
        return load_or_probe()
    with open(path) as f:
        return Machine.from_json(json.load(f))
