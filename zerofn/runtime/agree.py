"""Cross-rank agreement: one small object collective before the real ones.

A rank that finds a problem (a bad file, a mismatched argument) must not raise alone: the
others would go on into the next collective and wait there for it until the timeout. So
each check gathers what every rank found and every rank raises the same error, or none
does.
"""
from __future__ import annotations

import torch.distributed as dist


def gather(obj, group) -> list:
    """Every rank's ``obj``, in rank order, on every rank of ``group``."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def agree_or_raise(problems: list[str], group, what: str) -> None:
    """Raise ``ValueError("<what> (rank r): ...")`` on every rank if any rank has problems,
    naming the first such rank and its problems; return on every rank otherwise."""
    for rank, probs in enumerate(gather(problems, group)):
        if probs:
            raise ValueError(f"{what} (rank {rank}): " + "; ".join(probs))


def from_first(obj, group):
    """Rank 0's ``obj`` (of ``group``) on every rank: what rank 0 alone read or did."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
