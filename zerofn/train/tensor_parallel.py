"""--tp N: the GPT split by torch's tensor parallelism over the "tp" dimension of a (dp, tp)
mesh, before zerofn shards it over "dp" (docs/parallelism.md's order).

Each block's attention and MLP are split the Megatron way: the fused q/k/v projection and
the MLP's first layer column-wise (each rank computes its heads and its share of the hidden
units), the attention's output projection and the MLP's second layer row-wise (their
partial sums all-reduced over tp). Embeddings, norms and the tied head stay whole on every
tensor-parallel rank.

The fused projection's rows are q's, then k's, then v's, head by head; a column-wise split
of that order would give the first rank all of q and half of k. So under --tp N its rows
are kept in head-group order instead, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``q_r``: the
rows of rank r's heads), which the attention's view reads the same way at every N. The
init draws the weights in the usual order and then reorders them, so a run starts from the
same model at any --tp and the losses follow the --tp 1 run's."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from zerofn.nanogpt import GPT, Attention, GPTConfig, init_weights

BLOCK_PLAN = {"attn.qkv": ColwiseParallel, "attn.proj": RowwiseParallel,
              "fc": ColwiseParallel, "out": RowwiseParallel}


def check(cfg: GPTConfig, tp: int, world: int) -> None:
    """ValueError, the same on every rank (and in the launcher), where --tp cannot split."""
    if world % tp:
        raise ValueError(f"--tp {tp} must divide the {world} ranks (--nproc): the ranks form "
                         f"a (data-parallel, {tp}) grid.")
    if cfg.heads % tp:
        raise ValueError(f"--tp {tp} must divide --heads {cfg.heads}: each tensor-parallel "
                         f"rank computes whole attention heads.")


def split(model: GPT, tp: int) -> DeviceMesh:
    """Split ``model``'s blocks over the "tp" dimension of a new (dp, tp) mesh on the job's
    device type (launch.py's ``setup``), in place; the mesh. Rank r is data-parallel rank
    r // tp (init_device_mesh's row-major grid)."""
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(kind, (dist.get_world_size() // tp, tp),
                            mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {name: style() for name, style in BLOCK_PLAN.items()})
    return mesh


def data_parallel_rank(tp: int) -> int:
    """This rank's data-parallel index: the tensor-parallel ranks of one read the same rows."""
    return dist.get_rank() // tp


def init_in_head_groups(tp: int):
    """zerofn's ``init=`` under --tp: ``init_weights``, then each fused q/k/v projection (whole
    here: the transforms take this rank's piece after) reordered into head groups."""
    def init(module: nn.Module) -> None:
        init_weights(module)
        if isinstance(module, Attention):
            weight = module.qkv.weight
            weight.copy_(in_head_groups(weight, tp))
    return init


def in_head_groups(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The fused projection's rows ``[q | k | v]`` reordered as ``tp`` groups of
    ``[q_r k_r v_r]`` (a copy)."""
    three_width, width = weight.shape
    return weight.reshape(3, tp, three_width // (3 * tp), width).transpose(0, 1) \
        .reshape(three_width, width).clone()


def local_params(cfg: GPTConfig, tp: int) -> int:
    """The parameters one tensor-parallel rank holds: the split layers' share, the rest
    whole."""
    split_per_block = 4 * cfg.width * cfg.width + 2 * cfg.width * cfg.ffn + cfg.ffn
    return cfg.params() - cfg.layers * split_per_block * (tp - 1) // tp


class HeadGroups:
    """A checkpoint's q/k/v row order (the --tp that saved it), saved with it and checked on
    resume: rows saved in one order and read in another would be another model, silently."""

    def __init__(self, tp: int):
        self.tp = tp

    def state_dict(self) -> dict:
        return {"tp": self.tp}

    def load_state_dict(self, state: dict) -> None:
        if state["tp"] != self.tp:
            raise ValueError(f"the checkpoint was saved by a --tp {state['tp']} run, whose fused "
                             f"q/k/v rows lie in {state['tp']} head groups (now --tp "
                             f"{self.tp}); resume it with --tp {state['tp']}.")
