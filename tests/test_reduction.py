"""Gradient reduction: the in-flight bound (bytes, never fewer than two collectives in
flight), averaging inside the collective where the backend does it (NCCL), and gradient
shards lent from the pool under offload."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import zerofn as zf
import zerofn.runtime.comm as comm_module
from support.compare import TOL, max_errors
from support.experts import EXPERT_CONFIGS, HSDP, expert_runs
from support.loops import build_parity, train_reference, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.runtime.comm import Comm
from zerofn.runtime.runtime import runtime_of

pytestmark = pytest.mark.multirank


def world_2_runs(rank, world):
    """The two-rank runs of the tests below, in one launch: averaging_runs last, as it
    replaces zerofn's reduce-scatter for the rest of it."""
    return {"lent": lent_shard_runs(rank, world), "zero1": zero1_runs(rank, world),
            "gated": gated_runs(rank, world), "averaging": averaging_runs(rank, world)}


@pytest.fixture(scope="module")
def at_world_2() -> dict:
    """world_2_runs' results, each a list over the two ranks."""
    per_rank = run_ranks(2, world_2_runs, timeout=400)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


class Work:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait(self):
        self.log.append(self.name)


def in_flight_order(rank, world):
    comm = Comm(dist.group.WORLD, 1000, torch.device("cpu"))         # 1000 fp32 elements: 4000 bytes
    waited, done = [], []
    for i in range(4):                           # each far over the bound
        comm.enqueue(Work(i, waited), 10_000, lambda i=i: done.append(i))
    big = list(waited)
    comm.make_room(10_000)                       # host collectives: waited for room
    after_room = list(waited)
    for i in range(4, 7):                        # small ones: the bytes decide
        comm.enqueue(Work(i, waited), 1000, lambda i=i: done.append(i))
    small = list(waited)
    comm.enqueue(None, 3000, lambda: done.append("no work"))
    over = list(waited)
    comm.drain()
    return big, after_room, small, over, waited, done, side_stream_order()


def side_stream_order():
    """Reductions on a device's side stream (no work to wait): two stay in flight."""
    comm = Comm(dist.group.WORLD, 1000, torch.device("cpu"))
    done = []
    for i in range(3):
        comm.enqueue(None, 10_000, lambda i=i: done.append(i))
    after_enqueue = list(done)
    comm.make_room(10_000)
    after_room = list(done)
    comm.drain()
    return after_enqueue, after_room, done


def test_two_collectives_stay_in_flight_and_the_rest_is_bounded_in_bytes():
    big, after_room, small, over, waited, done, side = run_ranks(1, in_flight_order)[0]
    assert big == [0, 1]
    assert after_room == [0, 1, 2, 3]             # [Note: host collectives]
    assert side == ([0], [0], [0, 1, 2])          # on a side stream two stay for room too
    # three small ones (3000 bytes) fit the bound
    assert small == [0, 1, 2, 3]
    # 3000 more bytes do not: the oldest go until the rest fits
    assert over == [0, 1, 2, 3, 4, 5]
    assert waited == [0, 1, 2, 3, 4, 5, 6] and done == [0, 1, 2, 3, 4, 5, 6, "no work"]


def averaging_runs(rank, world):
    """ZeRO-2 and ZeRO-3 with the collectives of a backend that averages (NCCL): the
    reduce-scatter gets AVG, and the gradients must not be divided again."""
    ops = []

    def reduce_scatter_mean(out, full, op, group, async_op):
        ops.append(op)
        total = full.clone()
        dist.all_reduce(total, group=group)
        out.copy_(total.view(world, -1)[rank] / world)
        return _Done() if async_op else None

    comm_module._reduce_scatter = reduce_scatter_mean
    out = []
    for stage in (2, 3):
        ref, model = make_models()
        ref_opt = make_optimizer("adamw", ref.parameters())
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zero(stage)(model, opt)
        comm = runtime_of(model).ctx.comm
        comm.averages, comm._in_place = True, False     # as on NCCL
        data = batches(3, 2, world)
        train_reference(ref, ref_opt, data)
        train_sharded(model, opt, data, rank, world)
        out.append(max_errors(ref, ref_opt, model, opt))
    return out, {str(op) for op in ops}


class _Done:
    def wait(self):
        return True


def test_a_backend_that_averages_is_trusted_to(at_world_2):
    for errs, ops in at_world_2["averaging"]:
        assert ops == {str(dist.ReduceOp.AVG)}, ops
        for p_err, s_err in errs:
            assert p_err < TOL and s_err < TOL, errs


def lent_shard_runs(rank, world):
    """Offload: gradient shards exist on the device only from a unit's first reduction to
    zero_grad, and are the pool's buffers; the pool stops growing."""
    out = {}
    for stage in (2, 3):
        model, opt = build_parity(stage, "adamw", zf.offload("cpu"))
        rt = runtime_of(model)
        pool_bytes, lent = [], []
        for micro in batches(4, 2, world):
            for x, y in micro:
                model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            shards = [t for t in rt.reducer.grad_shard.values() if t is not None]
            lent.append(bool(shards) and all(t.data_ptr() in rt.ctx.pool._owned for t in shards))
            opt.step()
            opt.zero_grad()      # (followed at the next forward, or a look at the state:)
            grad_bytes = zf.model_state_bytes(model)["cpu"]["grads"]
            pool_bytes.append(rt.ctx.pool.nbytes())
        held = [t for t in rt.reducer.grad_shard.values() if t is not None]
        out[stage] = (lent, held, grad_bytes, pool_bytes)
    return out


def test_offload_lends_gradient_shards_from_the_pool(at_world_2):
    for by_stage in at_world_2["lent"]:
        for stage, (lent, held, device_grad_bytes, pool_bytes) in by_stage.items():
            assert all(lent) and held == [] and device_grad_bytes == 0, (stage, lent, held)
            assert pool_bytes[1:] == pool_bytes[:1] * 3, (stage, pool_bytes)


def zero1_runs(rank, world):
    """ZeRO-1 with one backward per step, accumulation, and accumulation under no_sync:
    where its reductions ran (in backward or at the step) and the parity errors."""
    out = []
    for accum, no_sync in ((1, False), (3, False), (3, True)):
        ref, model = make_models()
        ref_opt = make_optimizer("adamw", ref.parameters())
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zf.shard_optimizer()(model, opt)
        reducer = runtime_of(model).reducer
        where = []
        reduce = reducer.reduce
        reducer.reduce = lambda u: where.append(reducer.tracker.in_backward) or reduce(u)
        data = batches(3, accum, world)
        train_reference(ref, ref_opt, data)
        train_sharded(model, opt, data, rank, world, no_sync=no_sync)
        units = sum(1 for u in runtime_of(model).units if u.trainable)
        out.append((units, where.count(True), where.count(False),
                    max_errors(ref, ref_opt, model, opt)))
    return out


def test_zero1_reduces_in_every_backward_outside_no_sync(at_world_2):
    """[Note: ZeRO-1 reduces in backward]: every backward outside no_sync reduces, each
    reduction overlapping backward, the shards adding up over accumulation (as DDP
    all-reduces each backward); under no_sync only the last micro-batch's backward
    reduces, once; none waits for the step."""
    for rank_out in at_world_2["zero1"]:
        (u, early1, late1, e1), (_, early3, late3, e3), (_, early_ns, late_ns, e_ns) = rank_out
        assert (early1, late1) == (3 * u, 0)
        assert (early3, late3) == (9 * u, 0)
        assert (early_ns, late_ns) == (3 * u, 0)
        for p_err, s_err in (e1, e3, e_ns):
            assert p_err < TOL and s_err < TOL, rank_out


class GatedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.gate = torch.nn.Parameter(torch.randn(8) * 0.3)

    def forward(self, x, gated: bool):
        h = torch.tanh(self.lin(x))
        return x + (h * self.gate if gated else h)


class GatedNet(torch.nn.Module):
    """Equal-sized blocks, each with a gate its caller may leave out: a unit whose gate a
    rank leaves out is complete on that rank only at the end of backward."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(GatedBlock() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, ungated=()):
        for i, block in enumerate(self.blocks):
            x = block(x, i not in ungated)
        return self.head(x).pow(2).mean()


# step -> rank -> the blocks whose gate that rank leaves out. Step 0 runs on the first
# backward's order, the others on the learned one.
UNGATED = [{0: (1,), 1: ()}, {0: (), 1: (2,)}, {0: (0, 2), 1: (1,)}]


def gated_runs(rank, world):
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        ref, model = GatedNet(), GatedNet()
        model.load_state_dict(ref.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = zero(stage)(model, opt)
        g = torch.Generator().manual_seed(1)
        for ungated in UNGATED:
            xs = torch.randn(2 * world, 8, generator=g).chunk(world)
            sum(ref(xs[r], ungated[r]) for r in range(world)).div(world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(xs[rank], ungated[rank]).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = max_errors(ref, ref_opt, model, opt)
    return out


def test_ranks_reduce_units_in_one_order_when_their_gradients_complete_in_another(at_world_2):
    """[Note: one reduction order]: reducing each unit as it completes paired one rank's
    block with another's (0.04 off plain PyTorch after one step). ZeRO-3 hung here until
    each unit completed when its backward was done ([Note: a unit's backward is done])."""
    for by_stage in at_world_2["gated"]:
        for stage, (p_err, s_err) in by_stage.items():
            assert p_err < TOL and s_err < TOL, (stage, p_err, s_err)


@pytest.mark.parametrize("world,names", [(2, [n for n in EXPERT_CONFIGS if n not in HSDP]),
                                         (4, ["zero3", *HSDP])])
def test_experts_no_token_chose_on_some_ranks_train_as_plain_pytorch(world, names, tmp_path):
    """[Note: a unit's backward is done]: under ZeRO-3 an expert without a gradient on one
    rank held back its unit's reduction there, which met another rank's gather: a hang.
    Each configuration matches plain PyTorch on the global batch."""
    ranks = run_ranks(world, expert_runs, names, "cpu", str(tmp_path))
    for by_name in ranks:
        for name, (p_err, s_err, _) in by_name.items():
            assert p_err < TOL and s_err < TOL, (world, name, p_err, s_err)
    for name in set(names) - {"zero3+no_sync"}:   # the case under test happened: experts
        assert all(by_name[name][2] for by_name in ranks), name   # sat out on some ranks



class Doubles(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)           # in place on its input
        return self.lin(x)


class DoublesNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([Doubles()])

    def forward(self, x):
        return self.blocks[0](self.inp(x)).sum()


def in_place_runs(rank, world):
    out = {}
    for stage in (2, 3):
        model = DoublesNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = zero(stage)(model, opt)
        try:
            model(torch.randn(2, 4)).backward()
            out[stage] = None
        except RuntimeError as e:
            out[stage] = (str(e), getattr(e, "__notes__", []))
    return out


def test_a_unit_that_modifies_its_inputs_in_place_gets_the_documented_error_under_zero3():
    """README's wording: the identity on ZeRO-3 units' inputs returns views, as FSDP2's
    does; ZeRO-2 has no such hook."""
    out = run_ranks(1, in_place_runs)[0]
    assert out[2] is None
    message, notes = out[3]
    assert "Output 0 of ZerofnUnitInputs is a view and is being modified inplace" in message
    if sys.version_info >= (3, 11):     # (exception notes)
        assert notes[0] == ("zerofn: under ZeRO-3, as under FSDP2, a unit may not modify its "
                            "inputs in place, and unit 'blocks.0' (or a module inside it) did: "
                            "write `x = x * s`, not `x *= s` (docs/design.md §3).")
