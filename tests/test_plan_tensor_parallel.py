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
from support.loops import zero
from support.ranks import run_ranks
from support.tp_models import make_tp_model, parallelize, tp_batches
from zerofn.core.units import local_of
from zerofn.planner import Candidate, memory
from zerofn.planner.probe import Machine

pytestmark = pytest.mark.multirank

# the process and the allocator's overhead left out (base 0, overhead 0): the plan's
# forward peak is then the model state and the pool alone
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={"2": {"latency_s": 1e-4, "bus_bw": 1e9}},
                  process={"base": 0, "overhead": 0.0}, free={})
PUBLISHED = 0.054      # docs/plan.md: the grid's worst memory |error|
CANDIDATES = [Candidate(stage=s) for s in (1, 2, 3)] + [Candidate(stage=3, offload="cpu")]


def held_and_planned(rank, world, sp: bool = False):
    """Per candidate, on this rank: what zerofn holds after two steps
    (``zf.model_state_bytes``), the memory model's roles for this data-parallel rank's
    rows, and ``zf.plan``'s forward peak (rank 0's rows: the most). ``sp``: the
    sequence-parallel variant (norms, embedding and head split too)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    me = dp.get_local_rank()
    [(x, y)] = tp_batches(1, 1, 4)[0]
    x, y = x.chunk(2)[me], y.chunk(2)[me]
    split = parallelize(make_tp_model(), mesh["tp"], sp)
    planned = zf.plan(split, (x, y), group=dp, machine=MACHINE, on_gpu=False,
                      only=CANDIDATES, saves=None)
    peaks = {r.candidate: r.phases["forward"]["host"] for r in planned.rows}
    # torch keeps a shorter tensor-parallel piece (97 rows over 2) in a storage of the
    # longer one's size, which ZeRO-1/2 hold as the model's parameter; shapes do not say it
    padded = sum(local_of(p).untyped_storage().nbytes() - local_of(p).nbytes
                 for p in split.parameters())
    out = []
    for c in CANDIDATES:
        model = parallelize(make_tp_model(), mesh["tp"], sp)
        shape = memory.shape_of(model, dp.size(), me)
        extra = (zf.offload("cpu"),) if c.offload else ()
        model = zf.compose(zero(c.stage, group=dp), *extra)(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
        out.append((c, zf.model_state_bytes(model), memory.model_state(c, shape), peaks[c],
                    padded if c.stage < 3 else 0))
    return out, planned.notes, planned.reason


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
