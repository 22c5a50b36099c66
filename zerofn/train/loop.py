"""The run: its optimizer steps, the validation loss on held-out text at the end, and the
checkpoints it saves and resumes from."""
from __future__ import annotations

import contextlib

import math

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.data import load_corpus, sample_batch, split
from zerofn.data.batches import Batches, micro_batches
from zerofn.runtime import runtime_of

from .errors import fp16_kernels_missing
from .job import Job, build, resolve
from .launch import restarted
from .progress import Progress, banner, gather_stats, measured
from .tensor_parallel import HeadGroups, data_parallel_rank


def train(args, device) -> None:
    """The run on this rank: the job built, resumed where its checkpoint is, trained to
    --stop-at (else --steps) and evaluated."""
    job = resolve(args, device)
    train_data, val_data = split(load_corpus())
    model, opt, sched = build(job, args.seed)
    data = Batches(train_data, args.seed, job.batch, job.cfg.context)
    start = resume(args, model, opt, sched, data, job.tp)
    runtime_of(model).set_step(start + 1)   # failures name the run's own step
    zf.set_log_step(model, start)     # a resumed run's series go on from its step
    end = args.stop_at or args.steps
    if start >= end:
        if start > end:
            raise ValueError(f"the checkpoint in {args.save_dir} is at step {start}, past the "
                             f"end of this run (step {end}); raise --stop-at or --steps.")
        if dist.get_rank() == 0:
            print(f"the checkpoint in {args.save_dir} is at step {end}: nothing left to "
                  f"train.", flush=True)
        return
    if dist.get_rank() == 0:
        print(banner(job, model, opt, args), flush=True)
    progress = Progress(args, job, start)
    loss = torch.zeros(())
    for step in range(start, end):
        lr = opt.param_groups[0]["lr"]
        try:
            loss, norm = train_step(model, opt, sched, data.next(), job, device)
        except RuntimeError as e:
            message = fp16_kernels_missing(e, job.precision)
            if message is None:
                raise
            raise ValueError(message) from e
        progress.placed(runtime_of(model), step)
        if step == start:
            measured(model)
        opt.zero_grad()
        # This rank's loss and data (kept as tensors; read on zf.tensorboard's logging steps).
        zf.log(model, loss=loss, tokens=job.batch * job.cfg.context // dist.get_world_size(),
               samples=job.batch // dist.get_world_size())
        progress.skipped += runtime_of(model).step_skipped()
        if args.save_dir and ((args.save_every and (step + 1) % args.save_every == 0)
                              or step + 1 == end):
            save(args, model, opt, sched, data, step + 1, job.tp)
        if progress.wants(step, end):
            mean_loss, peak = gather_stats(loss, device)
            rt = runtime_of(model)
            progress.show(step, mean_loss, lr, None if norm is None else norm.item(), peak,
                          rt.step_skipped(), rt.checkpoint_waits())
    progress.close()
    zf.flush_logs(model)
    final, _ = gather_stats(loss, device)
    progress.finish(final, evaluate(model, val_data, job, device), end)


def train_step(model, opt, sched, batch, job: Job, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over the micro-batches, clip, step. Returns this rank's mean
    loss and the global gradient norm (inf or nan where a gradient was: the step is then
    skipped unless --on-nonfinite ignore; None under --overlap-step, which takes none)."""
    loss = torch.zeros((), device=device)
    micro = list(micro_batches(*batch, job.grad_accum, device,
                               (job.data_parallel, data_parallel_rank(job.tp))))
    for i, (x, y) in enumerate(micro):
        # (under --overlap-step only the last backward reduces: the host steps on it)
        quiet = job.overlap_step and i < len(micro) - 1
        with model.no_sync() if quiet else contextlib.nullcontext():
            micro_loss = model(x, y) / job.grad_accum
            zf.scale_loss(model, micro_loss).backward()     # fp16 loss scaling; a no-op otherwise
        loss += micro_loss.detach().float()
    if job.overlap_step:     # stepped during backward: there is no norm to take first
        opt.step()
        sched.step()
        return loss, None
    # The norm is reported every step, so without clipping it is measured with no limit.
    norm = zf.clip_grad_norm_(model, job.clip if job.clip > 0 else math.inf)
    opt.step()
    if not runtime_of(model).step_skipped():   # DeepSpeed leaves the schedule alone then
        sched.step()
    return loss, norm


@torch.no_grad()
def evaluate(model, data: torch.Tensor, job: Job, device) -> float:
    """Mean loss over held-out batches (fixed seed, so every run sees the same text)."""
    generator = torch.Generator().manual_seed(1234)
    dp, rank = job.data_parallel, data_parallel_rank(job.tp)
    losses = []
    for _ in range(job.eval_batches):
        x, y = sample_batch(data, job.batch, job.cfg.context, generator)
        losses.append(model(x.chunk(dp)[rank].to(device), y.chunk(dp)[rank].to(device)))
    total = torch.stack(losses).float().mean()
    dist.all_reduce(total)     # (a data-parallel rank's tensor-parallel ranks agree)
    return total.item() / dist.get_world_size()


def save(args, model, opt, sched, data: Batches, step: int, tp: int) -> None:
    zf.save_checkpoint(args.save_dir, model, opt, step=step, keep=args.keep, async_save=True,
                       sched=sched, data=data, rng=zf.RNGState(), qkv_order=HeadGroups(tp))


def resume(args, model, opt, sched, data: Batches, tp: int) -> int:
    """The step to start from: the checkpoint's under --resume or after torchrun restarted
    the job (a rank failed: ``--max-restarts``), else 0."""
    if not (args.resume or args.save_dir and restarted(runtime_of(model).device)):
        return 0
    extras = {"sched": sched, "data": data, "rng": zf.RNGState(), "qkv_order": HeadGroups(tp)}
    # What a checkpoint may lack: the generators' states where another number of ranks
    # saved it (per rank; training draws from no global generator, so nothing changes), and
    # the q/k/v order where a run before --tp existed saved it (the usual order: --tp 1's).
    optional = {"rng": "per-rank state 'rng'", "qkv_order": "extra.qkv_order"}
    while True:
        try:
            state = zf.load_checkpoint(args.save_dir, model, opt, **extras)
            break
        except ValueError as e:
            lacking = [k for k, words in optional.items() if k in extras and words in str(e)]
            if not lacking:
                raise
            if "qkv_order" in lacking and tp > 1:
                raise ValueError(f"the checkpoint in {args.save_dir} was saved without --tp "
                                 f"(its q/k/v rows in the usual order); resume it with --tp "
                                 f"1.") from None
            del extras[lacking[0]]
    if "rng" not in extras and dist.get_rank() == 0:
        print("the checkpoint was saved by another number of ranks: its random "
              "generator states are not restored (training draws none)", flush=True)
    if state is None:
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.save_dir} yet: starting at step 0", flush=True)
        return 0
    if dist.get_rank() == 0:
        print(f"resumed from {args.save_dir} at step {state['step']}", flush=True)
    return state["step"]
