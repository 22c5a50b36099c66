"""A small mixture of experts split by expert parallelism by hand, and the same model in one
process holding every expert (the reference).

On a ``("edp", "ep")`` mesh each expert-parallel rank owns ``EXPERTS / ep`` of the experts
(named by their global index, so a checkpoint names each once); a token goes to the rank
owning its expert and back through ``all_to_all_single`` over ``mesh["ep"]``, whose
backward brings the expert's gradient from every token that chose it. The expert a token
chooses is given with the batch (hash routing: no argmax that rounding could flip), and a
learned gate scales the expert's output, so the router trains too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._functional_collectives import all_to_all_single_autograd

DIM, EXPERTS, BLOCKS, TOKENS = 8, 4, 2, 6    # TOKENS: a data-parallel rank's per step
PATTERN = "blocks.*.moe.experts"


class LocalExperts(nn.Module):
    """The experts this rank owns, by global index: each runs on the tokens that chose it
    (none, at times: it runs on none, so that it still takes part in its gathers)."""

    def __init__(self, ids):
        super().__init__()
        self.experts = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in ids})

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for key, expert in self.experts.items():
            rows = (choice == int(key)).nonzero().squeeze(1)
            out = out.index_add(0, rows, torch.tanh(expert(x[rows])))
        return out


class MoE(nn.Module):
    """Top-1 mixture: ``x + gate * expert(x)``. With ``ep`` (the expert-parallel group and
    this rank's place in it) tokens travel to their expert's owner and back."""

    def __init__(self, ids, ep=None):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = LocalExperts(ids)
        self.ep = ep

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), -1).gather(1, choice[:, None])
        return x + gate * self._experts(x, choice)

    def _experts(self, x, choice):
        if self.ep is None:
            return self.experts(x, choice)
        group, size = self.ep, dist.get_world_size(self.ep)
        owner = choice // (EXPERTS // size)
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=size)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        sent, got = sent.tolist(), got.tolist()
        their_choice = torch.empty(sum(got), dtype=choice.dtype)
        dist.all_to_all_single(their_choice, choice[order], got, sent, group=group)
        theirs = all_to_all_single_autograd(x[order], got, sent, group)
        back = all_to_all_single_autograd(self.experts(theirs, their_choice), sent, got, group)
        return torch.empty_like(back).index_copy(0, order, back)


class Block(nn.Module):
    def __init__(self, ids, ep=None):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.moe = MoE(ids, ep)

    def forward(self, x, choice):
        return self.moe(torch.tanh(self.proj(x)), choice)


class MoEModel(nn.Module):
    """Embedding projection, ``BLOCKS`` mixture blocks, a head; MSE against ``y``."""

    def __init__(self, ids=range(EXPERTS), ep=None):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(ids, ep) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, choice, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, choice)
        return nn.functional.mse_loss(self.head(h), y)


def moe_mesh(edp: int = 2, ep: int = 2) -> dict:
    """The world as ``("edp", "ep")``: its "edp" and "ep" meshes, and "dp" (the two
    flattened), the whole data-parallel mesh the dense weights shard over; "root", the
    mesh itself."""
    mesh = init_device_mesh("cpu", (edp, ep), mesh_dim_names=("edp", "ep"))
    return {"root": mesh, "edp": mesh["edp"], "ep": mesh["ep"], "dp": mesh._flatten("dp")}


def reference(seed: int = 0) -> MoEModel:
    """Every expert, in one process."""
    torch.manual_seed(seed)
    return MoEModel()


def expert_parallel_meta(mesh) -> MoEModel:
    """This rank's part of the model, uninitialized (under ``torch.device("meta")``, on
    the meta device): every dense weight, its own experts."""
    ep = mesh["ep"]
    size, r = ep.size(), ep.get_local_rank()
    return MoEModel(range(r * EXPERTS // size, (r + 1) * EXPERTS // size), ep.get_group())


def expert_parallel(mesh, seed: int = 0) -> MoEModel:
    """This rank's part of ``reference(seed)``: every dense weight, its own experts."""
    model = expert_parallel_meta(mesh)
    model.load_state_dict(own_part(reference(seed).state_dict(), model))
    return model


def own_part(full: dict, model: nn.Module) -> dict:
    """The entries of a whole model's state dict that ``model`` (one rank's part) holds."""
    return {k: full[k] for k in model.state_dict()}


def moe_batches(steps: int, dp: int, seed: int = 1):
    """``steps`` global batches ``(x, choice, y)`` of ``dp * TOKENS`` tokens, every expert
    chosen by some."""
    g = torch.Generator().manual_seed(seed)
    n = dp * TOKENS
    return [(torch.randn(n, DIM, generator=g), torch.randperm(n, generator=g) % EXPERTS,
             torch.randn(n, DIM, generator=g)) for _ in range(steps)]
