"""zf.plan on a model tensor parallelism split, against what zerofn holds on each rank of
a (dp=2, tp=2) mesh: for tests/test_plan_tensor_parallel.py and tools/plan_tp_state.py."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from zerofn.core.units import local_of
from zerofn.planner import Candidate, memory
from zerofn.planner.probe import Machine

from .loops import zero
from .tp_models import make_tp_model, parallelize, tp_batches

# the process and the allocator's overhead left out (base 0, overhead 0): the plan's
# forward peak is then the model state and the pool alone
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={"2": {"latency_s": 1e-4, "bus_bw": 1e9}},
                  process={"base": 0, "overhead": 0.0}, free={})
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
