"""Drawing a run's batches from the corpus by step, and splitting each across ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import sample_batch


class Batches:
    """The training data's position: the global batch of step ``k`` is drawn by a
    generator seeded from (seed, k). Saved in checkpoints, so a resumed run reads on from
    the same place, and refuses a different seed or batch shape."""

    def __init__(self, data: torch.Tensor, seed: int, batch: int, context: int):
        self.data, self.seed, self.batch, self.context = data, seed, batch, context
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        return sample_batch(self.data, self.batch, self.context, generator)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batch": self.batch, "context": self.context,
                "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [f"{k} {state[k]} (now {mine[k]})" for k in ("seed", "batch", "context")
                  if state[k] != mine[k]]
        if differ:
            raise ValueError(f"the checkpoint's data was drawn with {', '.join(differ)}; "
                             f"resume with the same --seed, --batch and --context.")
        self.position = state["position"]


def micro_batches(x: torch.Tensor, y: torch.Tensor, grad_accum: int, device,
                  ranks: tuple[int, int] | None = None):
    """This rank's part of each of ``grad_accum`` micro-batches of one global batch (whose
    rows split evenly into them on every rank). ``ranks``: (how many ranks split the batch,
    this one's index among them), where not every rank reads its own rows (tensor
    parallelism's ranks read their data-parallel rank's); default the process group's."""
    world, rank = ranks or (dist.get_world_size(), dist.get_rank())
    shape = (grad_accum, world, -1, x.shape[1])
    for i in range(grad_accum):
        yield x.view(shape)[i, rank].to(device), y.view(shape)[i, rank].to(device)
