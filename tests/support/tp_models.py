"""A small transformer and the tensor-parallel plans torch's own ``parallelize_module``
applies to it, as torchtitan's Llama plan does: column-wise q/k/v and up, row-wise o and
down; in the sequence-parallel variant the norms run on sequence shards too.

The model is uneven on purpose where data parallelism shards it (vocab 97, ffn 132: rows
that do not divide by the data-parallel world), and even where tensor parallelism splits
it (width, heads and ffn divide by 2)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

VOCAB, WIDTH, HEADS, FFN, LAYERS, CONTEXT = 97, 32, 4, 132, 2, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        # The heads this rank holds: all, or a tensor-parallel share of them.
        q, k, v = (m(x).view(b, t, -1, WIDTH // HEADS).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, FFN), nn.Linear(FFN, WIDTH)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.mlp_norm, self.mlp = nn.LayerNorm(WIDTH), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def block_plan(sequence_parallel: bool) -> dict:
    """One block's plan: column-wise in, row-wise out; with sequence parallelism the norms
    run on sequence shards and each sub-layer gathers its input."""
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "mlp.up": ColwiseParallel()}
    if not sequence_parallel:
        return {**plan, "attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()}
    return {**plan, "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1))}


def parallelize(model: TPModel, tp_mesh, sequence_parallel: bool = False) -> TPModel:
    """torch's tensor parallelism over ``tp_mesh`` (1-D), in place."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if sequence_parallel:    # the blocks take and give sequence shards
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                    use_local_output=True)})
    return model


def make_tp_model(seed: int = 0) -> TPModel:
    torch.manual_seed(seed)
    return TPModel()


def tp_batches(steps: int, accum: int, rows: int, seed: int = 1):
    """Global batches: ``accum`` micro-batches of ``rows`` token rows each."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (rows, CONTEXT), generator=g),
              torch.randint(0, VOCAB, (rows, CONTEXT), generator=g)) for _ in range(accum)]
            for _ in range(steps)]


def mesh_clip(model, max_norm: float) -> None:
    """The global-norm clip FSDP2 + tensor parallelism needs: its gradients are DTensors of
    two meshes (the data-parallel one, and it joined with the tensor-parallel one), which
    torch's own ``clip_grad_norm_`` cannot stack (torchtitan clips the same way)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum((g.norm() ** 2).full_tensor() for g in grads).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
