"""FSDP2's order under zerofn, in figures: the transforms applied to the model alone, the
optimizer built after over ``model.parameters()`` (found at its first step), a loop with
torch's own clip over ``model.parameters()``, accumulation 2 and ``opt.zero_grad()``.
Each configuration's final weights against plain single-process PyTorch on the same
global batches, against FSDP2 running the same loop (``fully_shard`` per block, then the
root; bf16 under ``MixedPrecisionPolicy(bf16, bf16)``, zerofn's default reduction), and
whether they equal bit for bit the documented order's (the optimizer given to the
transform). int8 moments have no FSDP2 or PyTorch twin: their rows are against bf16
FSDP2 (a bound on the state's rounding, not parity).

    python3 tools/fsdp2_order.py [--steps 6]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig

CFG = GPTConfig(vocab=97, width=48, heads=3, ffn=130, layers=3, context=12)
ACCUM, CLIP, ROWS = 2, 0.05, 4        # micro-batches a step; global rows a micro-batch
STAGES = {1: ("shard_optimizer",), 2: ("shard_optimizer", "shard_grads"),
          3: ("shard_optimizer", "shard_grads", "shard_params")}
EXTRAS = {"": lambda: (), "+ offload cpu": lambda: (zf.offload("cpu"),),
          "+ bf16, int8 state": lambda: (zf.mixed_precision(torch.bfloat16),
                                         zf.offload("cpu", state_dtype=torch.int8))}


def data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, CFG.vocab, (ROWS, CFG.context), generator=g)
             for _ in range(ACCUM)] for _ in range(steps)]


def model_and(make_opt=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    return model if make_opt is None else (model, make_opt(model))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def loop(model, opt, batches, rank: int, world: int) -> None:
    for micro in batches:
        for x in micro:
            mine = x.chunk(world)[rank]
            (model(mine, mine) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()


def weights(model, opt) -> dict:
    if zf.is_transformed(model):
        return {k: v.float() for k, v in zf.get_state_dict(model, opt, full=True)[0].items()}
    full = StateDictOptions(full_state_dict=True)
    return {k: v.float() for k, v in get_model_state_dict(model, options=full).items()}


def zerofn_run(stage: int, extra: str, batches, rank, world, after: bool) -> dict:
    transform = zf.compose(*(getattr(zf, n)() for n in STAGES[stage]), *EXTRAS[extra]())
    if after:
        model = transform(model_and())
        opt = adamw(model)
    else:
        model, opt = transform(*model_and(adamw))
    loop(model, opt, batches, rank, world)
    return weights(model, opt)


def fsdp2_run(bf16: bool, batches, rank, world) -> dict:
    model = model_and()
    mp_policy = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    opt = adamw(model)
    loop(model, opt, batches, rank, world)
    return weights(model, opt)


def gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def worker(rank: int, init: str, world: int, steps: int, plain: dict, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    batches = data(steps)
    fsdp2 = {bf16: fsdp2_run(bf16, batches, rank, world) for bf16 in (False, True)}
    for stage in STAGES:
        for extra in EXTRAS:
            after = zerofn_run(stage, extra, batches, rank, world, True)
            before = zerofn_run(stage, extra, batches, rank, world, False)
            bf16 = "bf16" in extra
            if rank == 0:
                out[(world, stage, extra)] = (
                    None if bf16 else gap(after, plain), gap(after, fsdp2[bf16]),
                    all(torch.equal(after[k], before[k]) for k in after))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    model, opt = model_and(adamw)
    loop(model, opt, data(args.steps), 0, 1)
    plain = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out = mp.Manager().dict()
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=("file://" + os.path.join(tmp, "store"), world, args.steps,
                                   plain, out), nprocs=world)
    print(f"nanoGPT {CFG.params():,} params, AdamW lr 1e-3, {args.steps} steps, "
          f"accumulation {ACCUM}, torch's clip at {CLIP}; the optimizer built after the "
          "transform")
    print("world  configuration               vs PyTorch   vs FSDP2     = given order")
    for (world, stage, extra), (torch_gap, fsdp2_gap, same) in sorted(out.items()):
        shown = "-" if torch_gap is None else f"{torch_gap:.1e}"
        print(f"{world:5}  ZeRO-{stage} {extra:19} {shown:>10}   {fsdp2_gap:.1e}      "
              f"{'bit for bit' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main()
