"""``zf.plan`` for a model tensor parallelism split (``parallelize_module`` on a (dp=2, tp=2)
mesh of 4 gloo ranks): each rank's model state is its local tensors' over the
data-parallel ranks, predicted byte for byte per role (as tests/test_plan.py holds plain
models to); the plan's own peak of model state and buffer pool is what zerofn holds on
the ranks whose rows it describes, and within the planner's published accuracy on every
rank; what it cannot predict is said or refused."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from support.errors import error_of
from support.ranks import run_ranks
from support.tp_models import make_tp_model, parallelize, tp_batches
from support.tp_plan import held_and_planned

pytestmark = pytest.mark.multirank

PUBLISHED = 0.054      # docs/plan.md: the grid's worst memory |error|


@pytest.mark.parametrize("sp", [False, True])
def test_plan_predicts_each_ranks_model_state_over_the_data_parallel_ranks(sp):
    for rank, (rows, notes, reason) in enumerate(run_ranks(4, held_and_planned, sp,
                                                           timeout=300)):
        assert notes and "not its activations" in notes[0] and notes[0] in reason
        for c, held, modelled, peak, padded in rows:
            roles = ("params", "grads", "optimizer") if c.offload is None else ("optimizer",)
            place, where = ("device", "cpu") if c.offload is None else ("host", "host")
            for role in roles:
                unseen = padded if role == "params" else 0
                assert held[where][role] == modelled[place][role] + unseen, \
                    (c.describe(), rank, role, held[where][role], modelled[place][role])
            total = sum(sum(roles.values()) for roles in held.values())
            # the plan's is this tensor-parallel piece's at dp rank 0 (ranks 0 and 1), which
            # holds the most rows; offloaded, the host's gradient rows are not counted byte
            # for byte (as for plain models)
            assert abs(peak - total) <= PUBLISHED * total, (c.describe(), rank, peak, total)
            if rank < 2 and c.offload is None:
                assert peak + padded == total, (c.describe(), rank, peak, total)


def refused(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    [(x, y)] = tp_batches(1, 1, 4)[0]
    split = parallelize(make_tp_model(), mesh["tp"])
    return {"world": error_of(zf.plan, split, (x, y), world=2),
            "2-D": error_of(zf.plan, split, (x, y), group=mesh),
            "sizes": error_of(zf.plan, split, (x, y), world=4, group=mesh["dp"]),
            "auto": error_of(zf.auto, split, torch.optim.AdamW(split.parameters()), (x, y))}


def test_what_the_plan_cannot_predict_is_refused_naming_what_to_do():
    for out in run_ranks(4, refused, timeout=300):
        assert "give zf.plan the data-parallel ranks as the transforms take them, " \
               "group=mesh['dp']" in out["world"], out["world"]
        assert "group= is a 2-D DeviceMesh" in out["2-D"], out["2-D"]
        assert "world=4 but group= has 2 ranks" in out["sizes"], out["sizes"]
        assert out["auto"].startswith("zf.auto does not apply a plan to a model tensor "
                                      "parallelism split"), out["auto"]
