"""Model-state bytes equal docs/design.md's fp32 formulas; traffic is 2Ψ (ZeRO-1/2) or 3Ψ (ZeRO-3)."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from support.accounting import padding_bound
from zerofn.runtime import runtime_of
from support.loops import step_once, zero
from support.models import make_models, make_optimizer
from support.ranks import run_ranks
from support.shared_runs import shared

pytestmark = pytest.mark.multirank

# What each world's one launch runs for the tests below, in this order: traffic_at last,
# as it wraps torch.distributed's collectives for the rest of the process.
RUNS_AT = {1: ["memory", "ledgers"], 2: ["memory", "ledgers", "frozen", "pool", "traffic"],
           4: ["memory", "ledgers", "traffic"]}


def runs_at(rank, world, names):
    runs = {"memory": memory_at, "ledgers": ledgers_at, "frozen": zero3_frozen_traffic,
            "pool": zero3_pool_and_send_order, "traffic": traffic_at}
    return {name: runs[name](rank, world) for name in names}


@pytest.fixture(scope="module")
def accounted():
    """``accounted(world, name)``: that run's results, a list over the ranks, from one
    launch a world (RUNS_AT), made when a test first asks for it."""
    @shared
    def at(world):
        per_rank = run_ranks(world, runs_at, RUNS_AT[world], timeout=400)
        return {name: [r[name] for r in per_rank] for name in RUNS_AT[world]}
    return lambda world, name: at(world)[name]


def memory_at(rank, world):
    return {stage: memory_of_stage(rank, world, stage) for stage in (1, 2, 3)}


def memory_of_stage(rank, world, stage):
    _, model = make_models(frozen=False)
    psi = sum(p.numel() for p in model.parameters())
    pad = padding_bound(model, world)
    n_params = len(list(model.parameters()))
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zero(stage)(model, opt)
    step_once(model, opt, rank, world)   # grads and optimizer state now exist
    return psi, pad, n_params, zf.model_state_bytes(model)["cpu"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_formulas(accounted, world):
    """fp32 AdamW after a step: params 4Ψ | 4Ψ/N, grads 4Ψ/N (ZeRO-1's whole gradients
    live only until its backward ends: the reduced rows are what is left), Adam state
    8Ψ/N, per rank."""
    for rank, by_stage in enumerate(accounted(world, "memory")):
        for stage, (psi, pad, n, got) in by_stage.items():
            shard = 4 * psi / world
            want = {1: (4 * psi, shard, 2 * shard), 2: (4 * psi, shard, 2 * shard),
                    3: (shard, shard, 2 * shard)}[stage]
            # Shards may be padded; each of the n params' ``step`` counters is a 4-byte scalar.
            slack = (0, 4 * pad / world + 4)
            for role, w, extra in zip(("params", "grads", "optimizer"), want,
                                      (slack[stage == 3], slack[1], 8 * pad / world + 4 * n)):
                assert abs(got[role] - w) <= extra + 64, (stage, world, rank, role, got[role], w)


def ledgers_at(rank, world):
    """For each stage, without and with offload("cpu"), after a step (its gradients kept)
    and after zero_grad: zf.model_state_bytes' device grads and buffers, and what the pool
    and the reducer hold, counted from their own tensors."""
    out = {}
    for stage in (1, 2, 3):
        for offload in (False, True):
            _, model = make_models(frozen=False)
            opt = make_optimizer("adamw", model.parameters())
            extra = [zf.offload("cpu")] if offload else []
            model, opt = zf.compose(zero(stage), *extra)(model, opt)
            step_once(model, opt, rank, world)
            seen = [_ledger(model)]
            opt.zero_grad()
            seen.append(_ledger(model))
            out[(stage, offload)] = seen
    return out


def _ledger(model):
    got = zf.model_state_bytes(model)["cpu"]     # (first: it follows the loop's zero_grad)
    rt = runtime_of(model)
    pool, shards = rt.ctx.pool, [t for t in rt.reducer.grad_shard.values() if t is not None]
    lent = sum(t.nbytes for t in shards if pool.owns(t))
    kept = sum(t.untyped_storage().nbytes() for t in
               {t.untyped_storage().data_ptr(): t for t in shards if not pool.owns(t)}.values())
    return got["grads"], got["buffers"], lent + kept, pool.nbytes() - lent


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_agree_with_the_pools_ledger(accounted, world):
    """Gradient shards lent by the pool count once, as grads (their own bytes, not their
    buffer's), and the pool's other bytes as buffers: byte for byte, at every stage, with
    and without offload, while a step's gradients are held and after zero_grad."""
    for rank, ledgers in enumerate(accounted(world, "ledgers")):
        for config, seen in ledgers.items():
            for when, (grads, buffers, shard_bytes, pool_rest) in zip(("held", "cleared"), seen):
                assert (grads, buffers) == (shard_bytes, pool_rest), (world, rank, config, when)


def traffic_at(rank, world):
    """zerofn's own count, and what actually went through torch.distributed, per step."""
    seen = {"all_gather": 0, "reduce_scatter": 0}
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor",
                                "reduce_scatter")}

    def numel(t):
        return sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()

    def wrap(kind, fn):
        def counted(out, inp, *a, **k):
            seen[kind] += max(numel(out), numel(inp))
            return fn(out, inp, *a, **k)
        return counted

    def wrap_in_place(kind, fn):    # gloo: one broadcast per rank's chunk
        def counted(tensor, *a, **k):
            seen[kind] += tensor.numel()
            return fn(tensor, *a, **k)
        return counted

    def wrap_all_to_all(fn):    # gloo's reduce-scatter: world chunks, each to its rank
        def counted(out, inp, out_splits=None, in_splits=None, *a, **k):
            seen["reduce_scatter"] += world * max(in_splits) if in_splits else inp.numel()
            return fn(out, inp, out_splits, in_splits, *a, **k)
        return counted

    for kind, fns in names.items():
        for name in fns:
            if hasattr(dist, name):
                setattr(dist, name, wrap(kind, getattr(dist, name)))
    dist.broadcast = wrap_in_place("all_gather", dist.broadcast)
    dist.all_to_all_single = wrap_all_to_all(dist.all_to_all_single)
    import zerofn.runtime.comm as comm  # bind the wrapped functions zerofn calls
    comm._all_gather = dist.all_gather_single if hasattr(dist, "all_gather_single") \
        else dist.all_gather_into_tensor
    comm._reduce_scatter = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") \
        else dist.reduce_scatter_tensor
    out = {}
    for stage in (1, 2, 3):
        _, model = make_models()
        psi = sum(p.numel() for p in model.parameters())
        pad = padding_bound(model, world)
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zero(stage)(model, opt)
        step_once(model, opt, rank, world)
        opt.zero_grad()
        zf.get_state_dict(model, opt)  # finishes the deferred ZeRO-1/2 all-gathers
        for k in seen:
            seen[k] = 0
        step_once(model, opt, rank, world)
        out[stage] = (psi, pad, zf.comm_stats(model), dict(seen))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_per_step(accounted, world):
    for by_stage in accounted(world, "traffic"):
        for stage, (psi, pad, stats, seen) in by_stage.items():
            gathers = 2 if stage == 3 else 1
            assert psi <= stats["reduce_scatter"] <= psi + pad
            assert gathers * psi <= stats["all_gather"] <= gathers * (psi + pad)
            assert stats["all_gather"] == seen["all_gather"], (stage, stats, seen)
            assert stats["reduce_scatter"] == seen["reduce_scatter"], (stage, stats, seen)
            assert stats["all_gather_bytes"] == 4 * stats["all_gather"]


def zero3_frozen_traffic(rank, world):
    """Elements all-gathered in a ZeRO-3 step of the parity model with each block frozen
    but its attention's output projection (whose gradient comes before the frozen
    projection's input gradient needs the block's weights), and every unit's gathered
    size."""
    from zerofn.runtime.runtime import runtime_of
    _, model = make_models()
    for block in model.blocks:
        for name, p in block.named_parameters():
            p.requires_grad_(name.startswith("attn.proj"))
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zero(3)(model, opt)
    for _ in range(2):
        step_once(model, opt, rank, world)
        opt.zero_grad()
    units = runtime_of(model).ctx.units
    return zf.comm_stats(model)["all_gather"], [world * u.shard_numel for u in units if u.slots]


def test_zero3_gathers_a_unit_with_frozen_weights_once_in_backward(accounted):
    """Backward frees a unit whose last gradient has come while its frozen weights still
    have its input's gradient to make only once that is made: each unit is gathered once
    in forward and once in backward (freed at its last gradient, it was gathered again and
    held to backward's end)."""
    for gathered, units in accounted(2, "frozen"):
        assert gathered == 2 * sum(units), (gathered, units)


def zero3_pool_and_send_order(rank, world):
    """Pool bytes after each of six ZeRO-3 steps of a GPT whose root unit (with the tied
    embedding) is the largest, and the order in which backward took send buffers and
    reduced units."""
    from zerofn.nanogpt import GPT, GPTConfig
    from zerofn.runtime.grads import GradReducer
    from zerofn.runtime.runtime import runtime_of

    events = []
    take, reduce = GradReducer._send_buffer, GradReducer.reduce
    GradReducer._send_buffer = lambda self, u: events.append(("send", u.name)) or take(self, u)
    GradReducer.reduce = lambda self, u: events.append(("reduce", u.name)) or reduce(self, u)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=1024, width=64, heads=2, ffn=256, layers=3, context=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero(3)(model, opt)
    x = torch.randint(1024, (2, 17), generator=torch.Generator().manual_seed(rank))
    pool_bytes = []
    for _ in range(6):
        events.clear()
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        pool_bytes.append(runtime_of(model).ctx.pool.nbytes())
    GradReducer._send_buffer, GradReducer.reduce = take, reduce     # (the launch goes on)
    return pool_bytes, events


def test_zero3_pool_stops_growing_and_late_units_take_buffers_late(accounted):
    """After the first steps the pool allocates nothing more. The root unit's first
    gradients (its final norm) arrive at the start of backward and its last (the tied
    embedding) at the end: its send buffer is taken only once enough of them are there,
    after every block was reduced, not held through the whole backward."""
    for pool_bytes, events in accounted(2, "pool"):
        assert pool_bytes[1:] == pool_bytes[2:] + pool_bytes[-1:], pool_bytes
        first_root_send = events.index(("send", "<root>"))
        blocks_reduced = [e for e in events if e[0] == "reduce" and e[1] != "<root>"]
        assert len(blocks_reduced) == 3 and \
            all(events.index(e) < first_root_send for e in blocks_reduced), events
