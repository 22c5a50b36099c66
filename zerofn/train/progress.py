"""What rank 0 prints of the run: the banner (model, plan, batch, estimated and measured
model state per rank) and the progress lines, with the loss and peak memory gathered from
every rank."""
from __future__ import annotations

import datetime
import resource
import sys
import time

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.core.estimate import ROLES, estimate_placement
from zerofn.runtime import runtime_of

from .args import PRECISIONS
from .job import Job
from .tensor_parallel import local_params


def peak_memory(device: torch.device) -> int:
    """Peak bytes of this rank: allocated on the GPU, resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather_stats(loss: torch.Tensor, device: torch.device) -> tuple[float, int]:
    """(mean loss over ranks, largest peak memory of any rank): one small all-gather."""
    mine = torch.tensor([float(loss), float(peak_memory(device))], dtype=torch.float64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    stacked = torch.stack(every).cpu()
    return stacked[:, 0].mean().item(), int(stacked[:, 1].max().item())


def banner(job: Job, model, opt, args) -> str:
    """Parameters, world, plan and the estimated model state per rank."""
    world, dp = dist.get_world_size(), job.data_parallel
    n = job.cfg.params()
    batch_ranks = _ranks(world) if job.tp == 1 else f"{dp} data-parallel rank" + "s" * (dp != 1)
    rt = runtime_of(model)
    offload = "none" if job.offload is None else job.offload + \
        (" (params too)" if job.offload_params else "") + \
        (f" at {job.nvme_path}" if job.offload == "nvme" else "") + _share(job, rt) + \
        (", host step during backward" if job.overlap_step else "")
    units = len(rt.units)
    lines = [
        f"zerofn train: GPT '{args.model}' {n:,} parameters (width {job.cfg.width}, "
        f"{job.cfg.layers} layers, context {job.cfg.context}), {_ranks(world)} on "
        f"{dist.get_backend()}",
        f"plan: ZeRO-{job.stage}, {job.precision} compute" +
        ("" if job.precision == "fp32" else f", {job.master_dtype} masters") +
        ("" if job.state_dtype == "fp32" else f", {job.state_dtype} Adam state") +
        f", offload {offload}, "
        f"{units} units, activation checkpointing {'on' if job.cfg.checkpoint else 'off'}"
        + (f", torch.compile ({job.compile})" if job.compile else "")
        + (f", tensor parallel {job.tp} x data parallel {dp}" if job.tp > 1 else ""),
        f"batch: {job.batch} sequences of {job.cfg.context} bytes per step ({job.grad_accum} "
        f"x {job.micro} on each of {batch_ranks}); clip {job.clip or 'off'}; "
        f"{_optimizer_name(job, opt)}",
    ]
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):   # the estimate's optimizer
        reduce_dtype = job.options.get("mixed_precision", {}).get("reduce_dtype")
        # Under --tp: a tensor-parallel rank's parameters, sharded over the data-parallel ranks.
        est = estimate_placement(local_params(job.cfg, job.tp), dp, job.stage,
                                 PRECISIONS[job.precision],
                                 reduce_dtype=reduce_dtype, offload=job.offload,
                                 offload_params=job.offload_params,
                                 units_in_flight=rt.plan.offload.units_in_flight,
                                 largest_unit=dp * max(u.shard_numel for u in rt.units),
                                 ratio=offloaded_share(rt) if job.offload else 1.0,
                                 host_ring=rt.host_ring(),
                                 **_stored_dtypes(rt.plan.offload))
        lines.append("model state per rank, estimated: " + _places(est))
    return "\n".join(lines)


def _share(job: Job, rt) -> str:
    """Where offload's ``ratio`` put the units' optimizer state (auto: where it will)."""
    if job.offload_ratio == 1.0:
        return ""
    if job.offload_ratio == "auto":
        return f", ratio auto (placed after the first step, within {_budget(job)})"
    staying = rt.units_on_device()
    return (f", ratio {job.offload_ratio:g} ({offloaded_share(rt):.2f} in whole units): "
            f"{len(staying)} of {sum(bool(u.slots) for u in rt.units)} units keep their "
            f"state on the device" + (f" ({_names(staying)}: first in parameter order)"
                                      if staying else ""))


def _budget(job: Job) -> str:
    budget = job.device_budget
    if isinstance(budget, int):
        return f"a device budget of {_mb(budget)}"
    share = f"{budget:g}" if budget else "offload's default share"
    return f"{share} of the device memory free at set-up"


def _names(units) -> str:
    return ", ".join(u.name for u in units)


def offloaded_share(rt) -> float:
    """The share of the parameters whose optimizer state is offloaded, as placed."""
    sizes = {u: sum(s.numel for s in u.slots) for u in rt.units}
    return 1 - sum(sizes[u] for u in rt.units_on_device()) / max(1, sum(sizes.values()))


def _stored_dtypes(policy) -> dict:
    """The estimate's keywords for offload's stored dtypes (fp32: the defaults)."""
    if (policy.state_dtype, policy.master_dtype) == (torch.float32, torch.float32):
        return {}
    return dict(master_dtype=policy.master_dtype, state_dtype=policy.state_dtype)


def _optimizer_name(job: Job, opt) -> str:
    return f"{type(opt).__name__} lr {opt.defaults['lr']:g}, " + \
        (job.scheduler.cls.__name__ if job.scheduler else "warm-up + cosine")


def _places(by_place: dict, compute: str | None = None) -> str:
    """``device 1.2 MiB (params .., grads .., optimizer ..) | host ...``; the measured
    place named ``compute`` (the device's type) is shown as the device."""
    parts = []
    places = sorted(by_place, key=lambda p: p not in ("device", compute))   # device first
    for place in places:
        roles = by_place[place]
        total = sum(roles[r] for r in ROLES)
        if not total and place != "device" and place != compute:
            continue
        detail = ", ".join(f"{r} {_mb(roles[r])}" for r in ROLES)
        extra = f"; buffers {_mb(roles['buffers'])}" if roles.get("buffers") else ""
        name = f"device ({place})" if place == compute else place
        parts.append(f"{name} {_mb(total)} ({detail}{extra})")
    return " | ".join(parts)


def _ranks(n: int) -> str:
    return f"{n} rank" + "s" * (n != 1)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


class Progress:
    """Rank 0's progress: one rewritten line on a terminal, plain lines otherwise."""

    def __init__(self, args, job: Job, start: int):
        self.args, self.job, self.start = args, job, start
        self.tokens_per_rank = job.batch * job.cfg.context // dist.get_world_size()
        self.tty = sys.stdout.isatty()
        self.last_time, self.last_step = time.perf_counter(), start
        self.timed_from = None       # (time, step) after this run's first step: ETA's base
        self.first_loss = None
        self.skipped = 0
        self.unplaced = job.offload_ratio == "auto"    # printed once the step placed it
        self.waits_seen = (0, 0.0)     # checkpoint_waits() at the last line

    def wants(self, step: int, end: int) -> bool:
        """Whether to report this step (reporting costs a small all-gather)."""
        return self.tty or (step + 1) % self.job.log_every == 0 or step in (self.start, end - 1)

    def show(self, step: int, loss: float, lr: float, norm: float | None, peak: int,
             skipped: bool = False, waits: tuple[int, float] = (0, 0.0)) -> None:
        """``waits``: the runtime's ``checkpoint_waits()``, shown where steps waited for
        a background save since the last line."""
        now = time.perf_counter()
        waited = [w - seen for w, seen in zip(waits, self.waits_seen)]
        self.waits_seen = waits
        if self.first_loss is None:
            self.first_loss = loss
        if self.timed_from is None:
            self.timed_from = (now, step + 1)
        step_s = (now - self.last_time) / max(1, step + 1 - self.last_step)
        self.last_time, self.last_step = now, step + 1
        if dist.get_rank() != 0:
            return
        line = (f"step {step + 1:>5}/{self.args.steps}  loss {loss:.4f}  lr {lr:.3e}  "
                f"gnorm {_norm_text(norm, skipped, self.job.precision)}"
                f"  {step_s * 1e3:,.0f} ms  {self.tokens_per_rank / step_s:,.0f} tok/s/rank  "
                f"peak {peak / 2**20:,.0f} MiB  eta {self._eta(now, step)}" +
                (f"  checkpoint wait {waited[1] * 1e3:,.0f} ms ({waited[0]} step"
                 f"{'s' * (waited[0] != 1)})" if waited[0] else ""))
        print(f"\r{line}", end="", flush=True) if self.tty else print(line, flush=True)

    def placed(self, rt, step: int) -> None:
        """offload(ratio="auto")'s placement and its reason, once the step that made it (the
        first one not skipped) is done."""
        reason = rt.placement_reason() if self.unplaced else None
        if reason is None:
            return
        self.unplaced = False
        if dist.get_rank() == 0:
            staying = rt.units_on_device()
            line = f"placement after step {step + 1}: {reason}" + \
                (f"; on the device: {_names(staying)}" if staying else "")
            # (on a terminal, below the progress line it rewrites, once there is one)
            print("\n" * (self.tty and self.first_loss is not None) + line, flush=True)

    def _eta(self, now: float, step: int) -> str:
        t0, s0 = self.timed_from
        if step + 1 <= s0:
            return "-"
        left = (now - t0) / (step + 1 - s0) * (self.args.steps - step - 1)
        return str(datetime.timedelta(seconds=round(left)))

    def close(self) -> None:
        if self.tty and dist.get_rank() == 0:
            print()

    def finish(self, final: float, val: float, end: int) -> None:
        """The run's last lines: its first, validation and final (mean over ranks) loss."""
        if dist.get_rank() != 0:
            return
        if self.first_loss is not None:
            print(f"first loss {self.first_loss:.4f}, validation loss {val:.4f}")
        why = "fp16 overflow" if self.job.precision == "fp16" else "inf or nan gradients"
        skipped = f", {self.skipped} skipped ({why})" if self.skipped else ""
        print(f"final loss {final:.4f} after {end} steps (ZeRO-{self.job.stage}, "
              f"{_ranks(dist.get_world_size())}{skipped})", flush=True)


def measured(model) -> None:
    """The banner's last line, once optimizer state and gradients exist (after the first
    step, before its zero_grad): what this rank really holds."""
    if dist.get_rank() == 0:
        held = zf.model_state_bytes(model)
        print("model state per rank, measured on rank 0 (zf.model_state_bytes): "
              + _places(held, runtime_of(model).device.type), flush=True)


def _norm_text(norm: float | None, skipped: bool, precision: str) -> str:
    """The gradient norm as the progress line shows it ("-": none was taken), and why the
    step was skipped where it was."""
    why = "fp16 overflow" if precision == "fp16" else "inf or nan"
    return ("-" if norm is None else f"{norm:.3f}") + (f" (skipped: {why})" if skipped else "")
