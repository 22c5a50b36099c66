"""Generate the DeepSpeed checkpoints that tests/test_deepspeed_convert.py converts.

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python tools/make_deepspeed_checkpoints.py [--only NAME ...]

Run it with a python that has DeepSpeed installed (its CPU accelerator is enough). For each
case in ``CASES`` it launches real DeepSpeed on ``case.world`` gloo ranks (torchrun), trains
``TinyLM`` for ``BEFORE`` steps on fixed data, saves a checkpoint with
``engine.save_checkpoint``, then trains ``AFTER`` more steps. Into
``tests/data/deepspeed_checkpoints/<case>/`` it writes:

    checkpoint/            DeepSpeed's save dir: ``latest`` and ``global_step3/``
    reference.pt           what the test compares against, all taken from DeepSpeed itself:
                           the full fp32 master weights and Adam moments of every trainable
                           parameter (``deepspeed.utils.safe_get_full_fp32_param`` /
                           ``safe_get_full_optimizer_state``), DeepSpeed's own consolidation
                           (``get_fp32_state_dict_from_zero_checkpoint``, where it supports the
                           checkpoint), the step counters, the loss scale, and the global
                           mean loss of every step (the last ``AFTER`` are the next-step losses)

Seeds and data are fixed, so a rerun writes checkpoints equal in meaning (the same tensors
and values; the pickle bytes may differ). DeepSpeed copies its recovery scripts
(zero_to_fp32.py, zero_to_torch.py) into every save dir; they are DeepSpeed's code, not
test data, so they are deleted.

This module also defines the model, its parameter groups and the data, which the test
imports; DeepSpeed is imported only inside the worker.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                   "deepspeed_checkpoints")
CONFIG = dict(vocab=23, width=12, ffn=18, layers=2, context=6)
ROWS = 12           # global batch rows: divisible by every world size used (1, 2, 3, 4)
BEFORE, AFTER = 3, 2
CLIP = 1.0          # DeepSpeed's default gradient_clipping, written out
LR, NO_DECAY_LR, WEIGHT_DECAY = 1e-3, 2e-3, 0.1
CLIENT_STATE = {"epoch": 1, "samples_seen": BEFORE * ROWS}


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    world: int
    dtype: str                      # "fp32", "bf16" or "fp16"
    offload: bool = False           # zero_optimization.offload_optimizer: cpu
    ds_optimizer: bool = False      # DeepSpeed builds its own AdamW from the config
    grad_accum_fp32: bool = False   # bf16 + ZeRO-1 + fp32 accumulation: DeepSpeed's BF16_Optimizer
    sub_group_size: int | None = None   # ZeRO-3: several flat sub-groups per param group
    parameter_alignment: bool = False   # ZeRO-1/2: parameters 16-byte aligned in the flat buffer


# Fewer combinations than the full cross product, each code path of the converter at least
# once: ZeRO-1/2 flat partitions (lean and padded, with per-parameter alignment padding),
# BF16_Optimizer's files, ZeRO-3's per-parameter partitions with sub-groups, uneven worlds,
# fp16 loss scaling, offload, DeepSpeed's own CPU Adam.
CASES = {c.name: c for c in [
    Case("zero1_fp32_w1", 1, 1, "fp32"),
    Case("zero1_bf16_w2", 1, 2, "bf16", grad_accum_fp32=True),
    Case("zero2_bf16_w3", 2, 3, "bf16", parameter_alignment=True),
    Case("zero2_fp16_w2", 2, 2, "fp16"),
    Case("zero2_fp32_w2_offload", 2, 2, "fp32", offload=True, ds_optimizer=True),
    Case("zero3_fp32_w3", 3, 3, "fp32", sub_group_size=300),
    Case("zero3_bf16_w2_offload", 3, 2, "bf16", offload=True),
]}


class Block(nn.Module):
    """One pre-norm transformer block with a single causal attention head."""

    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, ffn)
        self.out = nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = (q @ k.transpose(-2, -1) / x.shape[-1] ** 0.5).masked_fill(~causal, float("-inf"))
        x = x + self.proj(att.softmax(-1) @ v)
        return x + self.out(F.gelu(self.fc(x)))


class TinyLM(nn.Module):
    """A tiny, uneven language model (2.5k parameters), defined here so the committed
    checkpoints never depend on a model that changes elsewhere: the head is tied to the
    token embedding, the position embedding is frozen, ``gain`` has fewer elements than a
    world of 3 has ranks, and ``shift`` is a persistent integer buffer."""

    def __init__(self):
        super().__init__()
        vocab, width, ffn = CONFIG["vocab"], CONFIG["width"], CONFIG["ffn"]
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(CONFIG["context"], width)
        self.blocks = nn.ModuleList(Block(width, ffn) for _ in range(CONFIG["layers"]))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.gain = nn.Parameter(torch.tensor([1.0, 0.8]))
        self.register_buffer("shift", torch.tensor([3]))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.normal_(m.bias, std=0.02)
        self.pos.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        idx = (idx + self.shift) % CONFIG["vocab"]
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)) * self.gain.mean()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model: nn.Module) -> list[dict]:
    """Matrices with weight decay; vectors without, at a higher learning rate."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0,
             "lr": NO_DECAY_LR}]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch; rank r of a world w trains rows r*ROWS/w onwards."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (ROWS, CONFIG["context"])
    return (torch.randint(0, CONFIG["vocab"], shape, generator=g),
            torch.randint(0, CONFIG["vocab"], shape, generator=g))


def rank_rows(batch, rank: int, world: int):
    per = ROWS // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def ds_config(case: Case) -> dict:
    zero = {"stage": case.stage}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if case.sub_group_size:
        zero["sub_group_size"] = case.sub_group_size
    if case.parameter_alignment:
        zero["parameter_alignment"] = True
    cfg = {"train_micro_batch_size_per_gpu": ROWS // case.world, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP, "steps_per_print": 10 ** 9, "zero_optimization": zero,
           "bf16": {"enabled": case.dtype == "bf16"}, "fp16": {"enabled": case.dtype == "fp16"}}
    if case.grad_accum_fp32:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if case.ds_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
    elif case.offload:   # keep the client's torch AdamW under offload
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# -- the worker: one rank of real DeepSpeed ----------------------------------------------
def worker(case: Case, out: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if case.dtype == "fp16":
        # DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has fp16
        # kernels for this CPU; torch computes fp16 on any CPU, and the checkpoint format
        # does not depend on the device, so only this gate is lifted.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(0)
    model = TinyLM()
    groups = param_groups(model)
    optimizer = None if case.ds_optimizer else torch.optim.AdamW(groups, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(case),
                                      model_parameters=groups if case.ds_optimizer else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(out, "checkpoint")
    losses, ref = [], None
    for step in range(BEFORE + AFTER):
        x, y = rank_rows(global_batch(step), rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step + 1 == BEFORE:
            engine.save_checkpoint(ckpt, client_state=CLIENT_STATE)
            ref = reference(engine)
    after = reference(engine)
    if rank == 0:
        ref["losses"], ref["after"] = losses, after
        ref["zero_to_fp32"] = consolidated(case, ckpt)
        torch.save(ref, os.path.join(out, "reference.pt"))
    dist.barrier()


def reference(engine) -> dict:
    """DeepSpeed's own full view of the state just saved (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    ref = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 (ZeRO-1/2, BF16_Optimizer) links each parameter to its slice of
        # the optimizer state right after the first group's first step, before the other
        # groups have any state, and never again: ask it to link once more now.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            ref["master"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                ref[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    ref.update(global_step=engine.global_steps, skipped_steps=engine.skipped_steps,
               adam_step=engine.global_steps - engine.skipped_steps,
               loss_scale=float(getattr(engine.optimizer, "loss_scale", 1.0)))
    return ref


def consolidated(case: Case, ckpt: str):
    """DeepSpeed's zero_to_fp32 result, where it supports the checkpoint (it rejects
    BF16_Optimizer's, which hold no zero_stage)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if case.grad_accum_fp32:
        return None
    return {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt).items()}


# -- the launcher ----------------------------------------------------------------------
def generate(case: Case, root: str) -> None:
    out = os.path.join(root, case.name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={case.world}", os.path.abspath(__file__), "--worker", case.name, out]
    subprocess.run(cmd, env=env, check=True)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        path = os.path.join(out, "checkpoint", script)
        if os.path.exists(path):
            os.remove(path)
    print(f"{case.name}: {asdict(case)} -> {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT, help="where the case directories go")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to regenerate")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(CASES[args.worker[0]], args.worker[1])
        return
    for name in args.only or CASES:
        generate(CASES[name], os.path.abspath(args.out))


if __name__ == "__main__":
    main()
