"""The main job: train the small GPT on the built-in corpus with ZeRO on every rank.

    torchrun --standalone --nproc-per-node 2 -m zerofn.train --stage 3 --steps 200

Each rank draws the same global batch (one seeded generator per step) and trains on its
slice of it, exactly as under DDP. gloo on CPU, NCCL on GPUs (one per ``LOCAL_RANK``).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.data import load_corpus, sample_batch, split
from zerofn.nanogpt import GPT, GPTConfig

STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerofn.train", description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                   help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also params")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    p.add_argument("--batch", type=int, default=16,
                   help="global batch in sequences, split evenly across ranks")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    p.add_argument("--width", type=int, default=192, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--ffn", type=int, default=768, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--context", type=int, default=128, help="sequence length in bytes")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="global batches of held-out text for the final validation loss")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between progress lines when stdout is not a terminal")
    return p.parse_args(argv)


def setup() -> torch.device:
    """Join the process group; pick this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    # Ranks share the cores: more than one thread each only makes them fight.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(args, device: torch.device):
    """The model and AdamW, transformed to the requested ZeRO stage."""
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=256, width=args.width, heads=args.heads, ffn=args.ffn,
                    layers=args.layers, context=args.context)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    transform = zf.compose(*(getattr(zf, name)() for name in STAGES[args.stage]))
    return transform(model, opt)


def lr_at(step: int, args) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to a tenth."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def my_slice(data: torch.Tensor, args, generator, device):
    """This rank's part of one global batch."""
    x, y = sample_batch(data, args.batch, args.context, generator)
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_step(model, opt, x, y, args) -> torch.Tensor:
    loss = model(x, y)
    loss.backward()
    zf.clip_grad_norm_(model, args.clip)
    opt.step()
    opt.zero_grad()
    return loss


class Progress:
    """Rank 0's progress: one rewritten line on a terminal, plain lines otherwise."""

    def __init__(self, args, tokens_per_step: int):
        self.args, self.tokens_per_step = args, tokens_per_step
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()
        self.first_loss = None

    def wants(self, step: int) -> bool:
        """Whether to report this step (reporting costs a small all-reduce)."""
        return self.tty or step % self.args.log_every == 0 or step == self.args.steps - 1

    def show(self, step: int, loss: float) -> None:
        if self.first_loss is None:
            self.first_loss = loss
        if dist.get_rank() != 0:
            return
        rate = (step + 1) * self.tokens_per_step / (time.perf_counter() - self.start)
        line = f"step {step + 1:>5}/{self.args.steps}  loss {loss:.4f}  {rate:,.0f} tok/s"
        print(f"\r{line}", end="", flush=True) if self.tty else print(line, flush=True)

    def close(self) -> None:
        if self.tty and dist.get_rank() == 0:
            print()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, args, device) -> float:
    """Mean loss over held-out batches (fixed seed, so every run sees the same text)."""
    generator = torch.Generator().manual_seed(1234)
    losses = [model(*my_slice(data, args, generator, device)) for _ in range(args.eval_batches)]
    return mean_over_ranks(torch.stack(losses).mean())


def train(args, device) -> None:
    train_data, val_data = split(load_corpus())
    model, opt = build(args, device)
    progress = Progress(args, args.batch * args.context)
    loss = torch.zeros(())
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        loss = train_step(model, opt, *my_slice(train_data, args, generator, device), args)
        if progress.wants(step):
            progress.show(step, mean_over_ranks(loss))
    progress.close()
    final, val = mean_over_ranks(loss), evaluate(model, val_data, args, device)
    if dist.get_rank() == 0:
        print(f"first loss {progress.first_loss:.4f}, validation loss {val:.4f}")
        print(f"final loss {final:.4f} after {args.steps} steps "
              f"(ZeRO-{args.stage}, {dist.get_world_size()} ranks)", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = setup()
    if args.batch % dist.get_world_size():
        raise SystemExit(f"--batch {args.batch} must divide evenly over "
                         f"{dist.get_world_size()} ranks.")
    try:
        train(args, device)
    finally:
        # zerofn's runtime and the model refer to each other; left to interpreter
        # shutdown, that cycle's collectives state is torn down after torch's and the
        # process sometimes aborts ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
