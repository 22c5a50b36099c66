"""What to run: the job the flags ask for, over the DeepSpeed config, over the defaults;
the zerofn transforms it maps to; and the model, optimizer and LR schedule it builds."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.config import Config
from zerofn.nanogpt import GPT, PRESETS, GPTConfig, init_weights

from . import tensor_parallel
from .args import PRECISIONS, SHAPE_FLAGS


@dataclass
class Job:
    """Every setting of the run, resolved."""
    cfg: GPTConfig
    stage: int
    precision: str
    offload: str | None
    offload_params: bool
    nvme_path: str | None
    state_dtype: str
    master_dtype: str
    offload_ratio: float | str                     # or "auto"
    device_budget: int | float | None
    overlap_step: bool
    grad_accum: int
    batch: int
    clip: float
    lr: float | None
    log_every: int
    steps: int
    eval_batches: int
    compile: str | None = None                     # torch.compile's backend
    tp: int = 1                                    # tensor-parallel ranks (--tp)
    on_nonfinite: str | None = None                # None: the sharding option's default
    tensorboard: dict | None = None                # zf.tensorboard's options
    options: dict = field(default_factory=dict)   # from the config: per transform
    optimizer: object = None                       # the config's factories, or None
    scheduler: object = None

    @property
    def data_parallel(self) -> int:
        """The ranks that split the batch: the world, less tensor parallelism's."""
        return dist.get_world_size() // self.tp

    @property
    def micro(self) -> int:
        return self.batch // (self.data_parallel * self.grad_accum)


def resolve(args, device: torch.device, world: int | None = None) -> Job:
    """The job the flags and the config ask for on ``device``; raises ValueError (the same
    on every rank) for settings that cannot run. ``world``: the ranks the launcher is about
    to start, where it checks the flags before any rank exists (no plan is made then: the
    planner probes the device from the ranks)."""
    launcher = world is not None
    world = world or dist.get_world_size()
    settings = _read_config(args.config) if args.config else None
    opts = dict(settings.transforms) if settings else {}
    mp = opts.get("mixed_precision", {})
    offload = dict(opts.get("offload") or {})
    config_precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mp.get("param_dtype"))
    cfg = replace(PRESETS[args.model], checkpoint=args.activation_checkpointing,
                  **{k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None})
    job = Job(
        cfg=cfg,
        # A config's stage 0 trains as ZeRO-1, as zerofn.deepspeed maps it.
        stage=_first(args.stage, settings and max(1, settings.stage), 3),
        precision=_first(args.precision, config_precision, "fp32"),
        offload=_first(args.offload, offload.get("device"), "none"),
        # The config's parameter offload goes with its device, not with --offload's.
        offload_params=_first(args.offload_params,
                              offload.get("params") if args.offload is None else None, False),
        nvme_path=_first(args.nvme_path, offload.get("path")),
        state_dtype=_first(args.state_dtype, STORED.get(offload.get("state_dtype")), "fp32"),
        master_dtype=_first(args.master_dtype, STORED.get(offload.get("master_dtype")), "fp32"),
        offload_ratio=_first(args.offload_ratio, offload.get("ratio"), 1.0),
        device_budget=args.device_budget,
        overlap_step=args.overlap_step,
        grad_accum=_first(args.grad_accum, settings and settings.gradient_accumulation_steps, 1),
        batch=_first(args.batch, settings and settings.train_batch_size, 16),
        clip=_first(args.clip, settings and settings.gradient_clipping, 1.0),
        lr=_first(args.lr, None if settings and settings.optimizer else 2e-3),
        log_every=_first(args.log_every, settings and settings.steps_per_print, 10),
        steps=args.steps, eval_batches=args.eval_batches, compile=args.compile, tp=args.tp,
        on_nonfinite=args.on_nonfinite,
        options=opts, optimizer=settings and settings.optimizer,
        scheduler=settings and settings.scheduler)
    if job.offload == "none":
        job.offload = None
    if args.tensorboard or "tensorboard" in opts:
        # The flag names the directory; the config's csv_monitor still applies.
        job.tensorboard = dict(opts.get("tensorboard", {}), every=job.log_every,
                               **({"logdir": args.tensorboard} if args.tensorboard else {}))
    _check_tp(job, args, world)     # (before a plan is made for a model it would not fit)
    if getattr(args, "plan", None) == "auto":
        from .planned import planned, refusals      # (the planner only when asked for)
        given = refusals(args)
        if given:
            raise ValueError(f"--plan auto chooses {', '.join(given)} itself: leave them out.")
        if not launcher:
            job = planned(job, args, device)
    _check(job, args, device, world)
    return job


def _first(*values):
    """The first value that is not None."""
    return next((v for v in values if v is not None), None)


def _read_config(path: str):
    """The DeepSpeed config; its warnings are shown once, by rank 0."""
    with warnings.catch_warnings():
        if not dist.is_initialized() or dist.get_rank() != 0:   # (the launcher's check)
            warnings.simplefilter("ignore")
        return zf.from_deepspeed_config(path)


def _check(job: Job, args, device: torch.device, world: int) -> None:
    dp = world // job.tp
    if min(job.batch, job.grad_accum) < 1 or job.batch % (dp * job.grad_accum):
        ranks = f"{dp} data-parallel rank" + "s" * (dp != 1) if job.tp > 1 else f"{world} ranks"
        raise ValueError(f"the global batch ({job.batch} sequences) must split evenly into "
                         f"{job.grad_accum} micro-batches on each of {ranks}; change "
                         f"--batch or --grad-accum.")
    if job.offload == "nvme" and not job.nvme_path:
        raise ValueError("--offload nvme needs --nvme-path DIR (a directory on the drive) or "
                         "the config's zero_optimization.offload_optimizer.nvme_path.")
    if job.offload == "nvme" and not os.path.isdir(job.nvme_path):
        raise ValueError(f"--nvme-path {job.nvme_path} (or the config's nvme_path) is not an "
                         f"existing directory on this rank's machine; create it first.")
    if job.offload_params and (job.offload is None or job.stage != 3):
        raise ValueError(f"--offload-params needs --stage 3 and --offload cpu or nvme (here "
                         f"stage {job.stage}, offload {job.offload or 'none'}): only ZeRO-3 "
                         f"shards the parameters.")
    if (job.state_dtype, job.master_dtype) != ("fp32", "fp32") and job.offload is None:
        raise ValueError(f"--state-dtype {job.state_dtype} --master-dtype {job.master_dtype}: "
                         f"low-precision state is stored off the device; add --offload cpu "
                         f"or nvme.")
    _check_auto(job, device)
    if job.on_nonfinite in ("raise", "ignore") and job.precision == "fp16":
        raise ValueError(f"--on-nonfinite {job.on_nonfinite} with --precision fp16: the loss "
                         f"scaler skips a step whose gradients overflow and lowers its scale; "
                         f"drop --on-nonfinite (or give skip), or use bf16.")
    if job.on_nonfinite == "skip" and job.overlap_step:
        raise ValueError("--on-nonfinite skip with --overlap-step: the host steps units during "
                         "backward, before any rank knows of a non-finite gradient, so the "
                         "step cannot be skipped; give raise (the default there) or ignore.")
    if job.offload_ratio != 1.0 and job.offload is None:
        raise ValueError(f"--offload-ratio {job.offload_ratio} is the share --offload keeps "
                         f"off the device: add --offload cpu or nvme.")
    if job.overlap_step and (job.offload != "cpu" or job.stage < 2 or job.clip
                             or job.precision == "fp16"):
        raise ValueError(f"--overlap-step steps the host's units during backward: it needs "
                         f"--offload cpu, --stage 2 or 3, --clip 0 and no fp16 (here offload "
                         f"{job.offload or 'none'}, stage {job.stage}, clip {job.clip}, "
                         f"{job.precision}).")
    if job.master_dtype == "bf16" and job.precision != "bf16":
        raise ValueError("--master-dtype bf16 needs --precision bf16: bf16 masters are the "
                         "rows the device computes with.")
    if args.save_every is not None and not args.save_dir:
        raise ValueError("--save-every needs --save-dir.")
    if args.resume and not args.save_dir:
        raise ValueError("--resume continues from --save-dir's latest checkpoint: give "
                         "--save-dir.")
    if args.steps < 1 or (args.stop_at is not None and not 1 <= args.stop_at <= args.steps):
        raise ValueError(f"--steps {args.steps} must be at least 1, and --stop-at between 1 "
                         f"and --steps.")
    if job.cfg.width % job.cfg.heads:
        raise ValueError(f"--width {job.cfg.width} must be a multiple of --heads "
                         f"{job.cfg.heads}.")


def _check_tp(job: Job, args, world: int) -> None:
    """--tp N: it divides the ranks and the heads; the planner does not plan a split model,
    and torch.compile does not trace it here (torch 2.13: dynamo meets the meta storage the
    split GPT was built with)."""
    if job.tp == 1:
        return
    tensor_parallel.check(job.cfg, job.tp, world)
    if getattr(args, "plan", None) == "auto":
        raise ValueError(f"--plan auto with --tp {job.tp}: the planner does not model "
                         f"activations under tensor parallelism; give the stage and offload "
                         f"flags yourself.")
    if job.compile:
        raise ValueError(f"--compile with --tp {job.tp} is not supported yet (torch.compile "
                         f"fails on the split model); drop one of the two.")


def _check_auto(job: Job, device: torch.device) -> None:
    """--offload-ratio auto and its --device-budget (offload's own checks, in flags)."""
    if job.device_budget is not None and job.offload_ratio != "auto":
        raise ValueError(f"--device-budget {job.device_budget} is what --offload-ratio auto "
                         f"places optimizer state within: add --offload-ratio auto.")
    if job.offload_ratio != "auto":
        return
    here = [f"--offload {job.offload or 'none'}"] + ["--offload-params"] * job.offload_params \
        + [f"--{k}-dtype {v}" for k, v in (("state", job.state_dtype),
                                           ("master", job.master_dtype)) if v != "fp32"]
    if here != ["--offload cpu"]:
        raise ValueError(f"--offload-ratio auto moves --offload cpu's fp32 state to the "
                         f"device: it needs --offload cpu without --offload-params, "
                         f"--state-dtype or --master-dtype (here {' '.join(here)}); with "
                         f"those, give a ratio from 0 to 1.")
    if device.type == "cpu" and not isinstance(job.device_budget, int):
        raise ValueError("--offload-ratio auto on a CPU device needs --device-budget in "
                         "bytes (a whole number): the host is the device there, and a share "
                         "is of a GPU's free memory.")


STORED = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}


def _stored(job: Job) -> dict:
    """offload()'s stored dtypes from the job's names for them."""
    dtype = {name: dtype for dtype, name in STORED.items()}
    return dict(state_dtype=dtype[job.state_dtype], master_dtype=dtype[job.master_dtype])


def config(job: Job, group=None) -> Config:
    """zerofn's configuration for the job: the config file's options where the flags leave
    them. ``group``: the data-parallel mesh under --tp (None: the world)."""
    opts = job.options
    shared = dict(opts.get("shard_optimizer", {}), init=init_weights)
    if group is not None:
        shared.update(group=group, init=tensor_parallel.init_in_head_groups(job.tp))
    if job.on_nonfinite is not None:
        shared["on_nonfinite"] = job.on_nonfinite
    mp = dict(opts.get("mixed_precision", {}))
    dtype = PRECISIONS[job.precision]
    if mp.get("param_dtype", torch.float32) != dtype:   # the config's scaling was for another
        mp = {"reduce_dtype": mp.get("reduce_dtype")}
    precision = dict(mp, param_dtype=dtype) \
        if dtype != torch.float32 or mp.get("reduce_dtype") is not None else None
    offload = None if job.offload is None else dict(
        device=job.offload, params=job.offload_params, path=job.nvme_path,
        units_in_flight=opts.get("offload", {}).get("units_in_flight", 2),
        ratio=job.offload_ratio, device_budget=job.device_budget,
        overlap_step=job.overlap_step, **_stored(job))
    return Config(job.stage, sharding=shared, params=opts.get("shard_params", {}),
                  precision=precision, offload=offload, tensorboard=job.tensorboard)


def transforms(job: Job, group=None) -> list:
    """zerofn's transforms for the job (over ``group``, as ``config``)."""
    return config(job, group).transforms()


# -- building -----------------------------------------------------------------------------
def build(job: Job, seed: int):
    """The model built on the meta device (under --tp split over tensor-parallel ranks),
    its optimizer and LR schedule, transformed: each rank materializes and initializes only
    its rows."""
    with torch.device("meta"):
        model = GPT(job.cfg)
    group = None
    if job.tp > 1:
        group = tensor_parallel.split(model, job.tp)["dp"]
    if job.optimizer is not None:
        kwargs = dict(job.optimizer.kwargs, **({"lr": job.lr} if job.lr is not None else {}))
        opt = job.optimizer.cls(model.parameters(), **kwargs)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.1,
                                betas=(0.9, 0.95))
    torch.manual_seed(seed)            # the same on every rank: one model, not several
    model, opt = zf.compose(*transforms(job, group))(model, opt)
    if job.compile:
        model.compile(backend=job.compile)
    sched = job.scheduler(opt) if job.scheduler is not None else \
        torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(job.steps))
    return model, opt, sched


def warmup_cosine(steps: int):
    """Linear warm-up over the first 5 % of steps, then cosine decay to a tenth: the factor
    of the peak rate at each step."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor
