"""The planner beside whole-tensor optimizers (Muon + AdamW, Adafactor): each rank's
model-state bytes as the plan counts them (an owner's state and whole masters, Adam's
moments for the rest) are ``zf.model_state_bytes`` byte for byte at every stage and world,
the step's allocations what the step allocates, the owners it names are the runtime's, and
the plan prints their balance. Under offload the owners keep their state where the
masters' rows are: the host (NVMe's too), or the device for the units a ratio keeps there;
low-precision offloaded state, which set-up refuses beside them, is not planned."""
from __future__ import annotations

import json

import pytest
import torch

import zerofn as zf
from support import slow_variant
from support.allocations import Allocations
from support.owned import adafactor, muon_and_adamw
from support.ranks import run_ranks
from zerofn import cli
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.planner import Candidate, plan
from zerofn.planner import memory
from zerofn.planner.owned import owned_of
from zerofn.planner.probe import Machine
from zerofn.runtime.homes.nvme_file import BLOCK
from zerofn.runtime.owned import owners
from zerofn.runtime.runtime import runtime_of

# rows that do not divide by 4 ranks: the owners' whole tensors and the rows both show
CFG = GPTConfig(vocab=101, width=48, heads=2, ffn=100, layers=3, context=16)
OPTIMIZERS = {"muon": muon_and_adamw, "adafactor": adafactor}
VERDICT = 4    # bytes: the non-finite verdict's scalar, alive through the step
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11, "bf16": 2e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={"2": {"latency_s": 1e-4, "bus_bw": 1e9}},
                  process={"base": 3e8, "overhead": 0.05}, free={})
STAGES = [Candidate(stage=s, precision=p) for s in (1, 2, 3) for p in ("fp32", "bf16")]
OFFLOADED = [Candidate(stage=2, offload="cpu"), Candidate(stage=3, offload="cpu"),
             Candidate(stage=3, precision="bf16", offload="cpu"),
             Candidate(stage=3, offload="cpu", params=True),
             Candidate(stage=3, offload="cpu", to_owner=True),
             Candidate(stage=3, precision="bf16", offload="cpu", to_owner=True)]
SWAPPED = [Candidate(stage=2, offload="nvme"), Candidate(stage=3, offload="nvme"),
           Candidate(stage=3, offload="nvme", params=True)]
SPLIT = [Candidate(stage=2, offload="cpu", ratio=0.5), Candidate(stage=3, offload="cpu", ratio=0.5),
         Candidate(stage=3, offload="nvme", ratio=0.5)]


def held_and_planned(rank, world, kind):
    """Per candidate: this rank's model-state bytes after two steps, the plan's for this
    rank, the bytes the third step allocates at its peak and the plan's, and the owners'
    loads the runtime chose and the plan names."""
    out = []
    for c in STAGES:
        model, opts, shape, x = _trained(c, kind, rank, world)
        held = zf.model_state_bytes(model)["cpu"]
        _backward(model, opts, x)
        with Allocations() as step:
            _step(opts)
        out.append((c.describe(), held, memory.model_state(c, shape)["device"], step.peak,
                    (memory.step_temporaries(c, shape), _late(shape, world)),
                    runtime_of(model).owned_load(), list(shape.owned.load)))
    return out


def offloaded_held_and_planned(rank, world, kind):
    """Per offloaded candidate: this rank's model-state bytes after two steps, and the
    plan's for this rank."""
    out = []
    for c in OFFLOADED:
        model, _, shape, _ = _trained(c, kind, rank, world)
        out.append((c.describe(), zf.model_state_bytes(model), memory.model_state(c, shape)))
    return out


def swapped_held_and_planned(rank, world, kind, tmp):
    """Per NVMe candidate: this rank's model-state bytes after two steps, the plan's, its
    owned bytes and the swap file's units."""
    out = []
    for c in SWAPPED:
        model, _, shape, _ = _trained(c, kind, rank, world, tmp)
        # the file's alignment: each block rounded up, the padding rows; the plan's
        # counters, which the file does not keep
        slack = (-4 * shape.adam_tensors,
                 len(shape.units) * BLOCK + 12 * (shape.shard - shape.local))
        out.append((c.describe(), zf.model_state_bytes(model), memory.model_state(c, shape),
                    shape.owned_held(c.stage), slack))
    return out


def split_held_and_planned(rank, world, kind, tmp):
    """Per candidate with a ratio: the owned bytes of this rank's parameters in the units
    the runtime keeps on the device (``units_on_device``), and the plan's by place."""
    out = []
    for c in SPLIT:
        model, _, shape, _ = _trained(c, kind, rank, world, tmp)
        kept = frozenset(s.fqn for u in runtime_of(model).units_on_device() for s in u.slots)
        out.append((c.describe(), shape.owned.held(rank, c.stage, kept),
                    shape.owned_held(c.stage),
                    shape.owned_places(c.stage, c.offload, c.ratio)))
    return out


def per_kind(rank, world, fn, kinds, *args):
    """``fn(rank, world, kind, *args)`` for each of ``kinds``, one after another on the
    same ranks."""
    return {kind: fn(rank, world, kind, *args) for kind in kinds}


def kinds_at(world: int, kind: str) -> tuple:
    """The kinds one run of ``world`` ranks computes for a test asking for ``kind``: both,
    but at four ranks, where Adafactor's cases are slow variants."""
    return tuple(OPTIMIZERS) if world < 4 else (kind,)


def _trained(c, kind, rank, world, nvme_path=None):
    """The model and optimizers as ``c`` sets them up, two steps trained, and the plan's
    layout of this rank."""
    torch.manual_seed(0)
    model = GPT(CFG)
    with torch.device("meta"):
        meta = GPT(CFG)
    shape = memory.shape_of(meta, world, rank, owned_of(meta, OPTIMIZERS[kind](meta), world))
    model, opts = c.apply(model, OPTIMIZERS[kind](model), nvme_path)
    x = torch.randint(0, CFG.vocab, (2, CFG.context))
    for _ in range(2):
        _backward(model, opts, x)
        _step(opts)
    return model, opts, shape, x


def _late(shape, world) -> int:
    """The most a collective's buffers can outlive its return: gloo runs collectives on
    worker threads (2 by default), each of which may still hold its last collective's
    tensors when ``wait()`` returns, so the two largest owned tensors, padded."""
    largest = sorted((4 * t.padded(world) for t in shape.owned.tensors), reverse=True)
    return sum(largest[:2])


def _backward(model, opts, x) -> None:
    for o in opts:
        o.zero_grad()
    model(x, x).backward()


def _step(opts) -> None:
    for o in opts:
        o.step()


# Four ranks on the CI machine's two cores cost the most: the owners spread over four (and
# rows that do not divide by four) every time with Muon + AdamW; Adafactor's state, counted
# per owned tensor as Muon's is, at one and two ranks (ZEROFN_SLOW=1 runs it at four).
def worlds_and_kinds(test: str) -> list:
    return [(world, kind) if world < 4 or kind == "muon" else
            slow_variant(world, kind, covered_by=f"{test}[2-{kind}] and [4-muon]")
            for world in (1, 2, 4) for kind in OPTIMIZERS]


@pytest.mark.multirank
@pytest.mark.parametrize("world, kind",
                         worlds_and_kinds("test_owned_model_state_is_what_each_rank_holds"))
def test_owned_model_state_is_what_each_rank_holds(world, kind, shared_runs):
    """Every role on every rank, byte for byte, at ZeRO-1/2/3 in fp32 and bf16: each
    owner's optimizer state (measured from the user's optimizer on fake tensors) and whole
    masters on top of its rows, Adam's moments and counters for the parameters Adam holds;
    the step's allocations at their peak the plan's figure, or up to one whole tensor
    more per gloo worker thread that a collective lets go of late; and
    the planner's owners are the runtime's (the same loads). (Both kinds of a world from
    one run of its ranks.)"""
    ran = shared_runs(world, per_kind, held_and_planned, kinds_at(world, kind))
    for rank, rows in enumerate(by_kind[kind] for by_kind in ran):
        for described, held, planned, peak, (planned_peak, late), load, planned_load in rows:
            for role in ("params", "grads", "optimizer"):
                assert held[role] == planned[role], \
                    (described, world, rank, role, held[role], planned[role])
            assert load == pytest.approx(planned_load), (described, world, rank)
            # The gather's whole gradients, the optimizer's work buffers, the update on its
            # way back, and the verdict's scalar; gloo's worker thread sometimes holds a
            # collective's buffer (a send, a receive, a padded copy) a little past its
            # return, so up to one whole tensor per gloo worker thread (``late``) more.
            assert planned_peak <= peak - VERDICT <= planned_peak + late, \
                (described, world, rank, peak, planned_peak, late)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2])
def test_owned_state_under_offload_is_what_each_rank_holds(world, kind, shared_runs):
    """offload("cpu") at ZeRO-2 and ZeRO-3 (fp32 and bf16 compute, parameter shards on the
    host too, ZeRO-3 with ``reduce_to_owner`` too): the device's parameters and gradients byte for byte, and the host's
    optimizer state: the masters' rows, the owner's state and whole masters, which it
    keeps beside them, and torch's Adam state for the rest (beside a whole-tensor
    optimizer the host's Adam is torch's). On this CPU the state torch makes is not in
    zerofn's host arenas, so ``zf.model_state_bytes`` names its place "cpu": it is host
    memory, where the plan puts it. (Both kinds of a world from one run of its ranks.)"""
    ran = shared_runs(world, per_kind, offloaded_held_and_planned, kinds_at(world, kind))
    for rank, rows in enumerate(by_kind[kind] for by_kind in ran):
        for described, held, planned in rows:
            where = (described, world, rank)
            assert held["cpu"]["params"] == planned["device"]["params"], where
            assert held["host"]["params"] == planned["host"]["params"], where
            assert held["cpu"]["grads"] == planned["device"]["grads"], where
            assert held["host"]["optimizer"] + held["cpu"]["optimizer"] == \
                planned["host"]["optimizer"], (where, held, planned)
            assert planned["device"]["optimizer"] == 0, where


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2])
def test_owned_state_beside_a_swap_file_is_what_each_rank_holds(world, kind, shared_runs, nvme_dir):
    """offload("nvme") at ZeRO-2 and ZeRO-3 (parameter shards in the file too): the
    device's parameters and gradients byte for byte; the owner's state and whole masters
    in memory, byte for byte (the state torch makes is "cpu" on this CPU, and nothing else
    is: Adam's is in the file); the swap file, whose blocks keep room for Adam's moments
    on every row, owned ones too, within its alignment (each unit's block rounded up to
    ``BLOCK`` bytes, the shard's padding rows; the plan's step counters are not in it).
    (Both kinds of a world from one run of its ranks.)"""
    ran = shared_runs(world, per_kind, swapped_held_and_planned, kinds_at(world, kind), nvme_dir)
    for rank, rows in enumerate(by_kind[kind] for by_kind in ran):
        for described, held, planned, owned, (below, above) in rows:
            where = (described, world, rank)
            for role in ("params", "grads"):
                assert held["cpu"][role] == planned["device"][role], (where, role)
            assert held["cpu"]["optimizer"] == owned, (where, held, owned)
            assert planned["device"]["optimizer"] == 0, where
            assert planned["host"]["optimizer"] >= owned, where
            file, plan_file = held["nvme"]["optimizer"], planned["nvme"]["optimizer"]
            assert below <= file - plan_file <= above, (where, file, plan_file)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_owned_state_follows_the_units_a_ratio_keeps(world, tmp_path):
    """offload(ratio=0.5): an owner keeps a parameter's state and whole masters with its
    unit's masters, on the device for the units the runtime keeps there, else on the host:
    the plan's split is the runtime's units' (``units_on_device``), and both places hold
    some at one rank or more."""
    places = []
    for rank, rows in enumerate(run_ranks(world, split_held_and_planned, "muon",
                                          str(tmp_path))):
        for described, on_device, held, planned in rows:
            where = (described, world, rank)
            assert planned == {"device": on_device, "host": held - on_device}, where
            places.append(planned)
    assert any(p["device"] for p in places) and any(p["host"] for p in places)


def _meta_model_and_optimizers(kind):
    with torch.device("meta"):
        model = GPT(CFG)
    return model, OPTIMIZERS[kind](model)


def test_plan_prints_each_owners_share():
    """The plan's table names every rank's share of the update's work, from the runtime's
    own assignment (runtime/owned.py's owners over the same parameters), and its JSON each
    parameter's owner; it weighs NVMe and a ratio beside the owners, not low-precision
    offloaded state (set-up refuses it there), and says so."""
    model, opts = _meta_model_and_optimizers("muon")
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    result = plan(model, (x, x), world=4, machine=MACHINE, on_gpu=False, optimizers=opts,
                  precision="bf16")
    matrices = [p for g in opts[0].param_groups for p in g["params"]]
    owner, load = owners([tuple(p.shape) for p in matrices], 4)
    table = result.table()
    for r in range(4):
        mine = [p for p, o in zip(matrices, owner) if o == r]
        assert f"rank {r}: {load[r] / sum(load):.1%} of the work, {len(mine)} parameters, " \
               f"{sum(p.numel() for p in mine):,} elements" in table
    assert f"the busiest {max(load) / (sum(load) / 4):.2f}x the mean" in table
    names = {p: n for n, p in model.named_parameters()}
    assert result.to_json()["owned"]["owners"] == {names[p]: o for p, o in zip(matrices, owner)}
    assert {r.candidate.offload for r in result.rows} == {None, "cpu", "nvme"}
    assert {r.candidate.ratio for r in result.rows} == {1.0, 0.5}
    assert all(r.candidate.state_dtype == "fp32" for r in result.rows)
    assert "does not weigh low-precision offloaded state" in result.reason
    adam = plan(model, (x, x), world=4, machine=MACHINE, on_gpu=False, precision="bf16")
    assert any(r.candidate.state_dtype != "fp32" for r in adam.rows)


def test_owners_count_in_the_busiest_rank_and_the_step():
    """The plan's peak is the busiest rank's (an owner holds more than rank 0 where rank 0
    owns less), and the owners' Newton-Schulz adds to the step: each owner's share under
    ZeRO, all of it under DDP."""
    model, opts = _meta_model_and_optimizers("muon")
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    owned = owned_of(model, opts, 2)
    shapes = [memory.shape_of(model, 2, r, owned) for r in range(2)]
    c = Candidate(stage=3)
    held = [memory.model_state(c, s)["device"]["optimizer"] for s in shapes]
    assert held[1] > held[0]     # (rank 1 owns more here: the balance reads costs, not rows)
    only = [c, Candidate(stage=0)]
    with_owned = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, only=only,
                      optimizers=opts)
    adam = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, only=only)
    rows = {r.candidate: r for r in with_owned.rows}
    rows_adam = {r.candidate: r for r in adam.rows}
    assert owned.flops_all["bf16"] > max(owned.flops[r]["bf16"] for r in range(2)) > 0
    for cand in only:
        assert rows[cand].seconds["step"] > rows_adam[cand].seconds["step"]
    assert rows[Candidate(stage=0)].seconds["step"] - rows_adam[Candidate(stage=0)].seconds["step"] \
        > rows[c].seconds["step"] - rows_adam[c].seconds["step"]


def test_plan_refuses_an_elementwise_optimizer_it_does_not_count():
    """Beside owned parameters, the plan counts Adam's state for the rest: another
    elementwise optimizer is refused with what to do."""
    with torch.device("meta"):
        model = GPT(CFG)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    with pytest.raises(ValueError, match="counts Adam's state .* SGD holds some: give them to "
                                         "Adam or AdamW"):
        plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, optimizers=sgd)


def test_zerofn_plan_optimizer_muon_prints_the_balance(capsys, tmp_path):
    """``zerofn plan --optimizer muon`` prints the owners' balance with the table, and
    weighs ZeRO-3 with ``reduce_to_owner`` among its rows."""
    machine = tmp_path / "probe.json"
    machine.write_text(json.dumps(MACHINE.to_json()))
    assert cli.main(["plan", "width=48,layers=2,heads=2,ffn=100,vocab=101,context=16",
                     "--batch", "2", "--world", "2", "--probe", str(machine),
                     "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "owned (Muon): 8 parameters" in out
    assert cli.main(["plan", "width=48,layers=2,heads=2,ffn=100,vocab=101,context=16",
                     "--batch", "2", "--world", "2", "--probe", str(machine),
                     "--optimizer", "muon", "--all"]) == 0
    assert "ZeRO-3, fp32, reduce to owner, 1x2" in capsys.readouterr().out
    assert "rank 0: 50.0% of the work" in out and "rank 1: 50.0% of the work" in out


def test_auto_plans_the_owners_of_its_optimizers(capsys):
    """``zf.auto`` given Muon + AdamW plans their owners (the balance it prints with its
    choice) and hands the optimizers back."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opts = OPTIMIZERS["muon"](model)
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    model, got, result = zf.auto(model, opts, (x, x), world=1, machine=MACHINE,
                                 only=[Candidate(stage=0)], host_budget=1e12)
    assert got is opts and result.owned is not None
    assert len(result.owned.tensors) == len(opts[0].param_groups[0]["params"])
    err = capsys.readouterr().err
    assert "zerofn plan: chosen: DDP" in err and "  rank 0: 100.0% of the work" in err


# -- ZeRO-3 with shard_params(reduce_to_owner=True): runtime/to_owner.py ----------------
TO_OWNER = [Candidate(stage=3, precision=p, to_owner=True) for p in ("fp32", "bf16")]


def to_owner_held_and_planned(rank, world, kind):
    """Per ``reduce_to_owner`` candidate (applied by the plan's own ``Candidate.apply``):
    this rank's model-state bytes after two steps and the plan's; the bytes of the whole
    gradients the runtime holds for this rank as their owner after a backward and the
    plan's; the bytes the step allocates at their peak and the plan's."""
    out = []
    for c in TO_OWNER:
        model, opts, shape, x = _trained(c, kind, rank, world)
        rt = runtime_of(model)
        assert rt.plan.sharding.reduce_to_owner and rt.reducer.to_owner is not None
        held = zf.model_state_bytes(model)["cpu"]
        _backward(model, opts, x)
        whole = sum(t.nbytes for t in rt.reducer.to_owner.whole.values())
        cb = torch.bfloat16.itemsize if c.precision == "bf16" else 4
        with Allocations() as step:
            _step(opts)
        out.append((c.describe(), held, memory.model_state(c, shape)["device"],
                    whole, shape.to_owner_bytes(cb)["step"], step.peak,
                    (memory.step_temporaries(c, shape), _late(shape, world))))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world, kind", worlds_and_kinds(
    "test_reduce_to_owner_state_and_step_are_what_each_rank_holds"))
def test_reduce_to_owner_state_and_step_are_what_each_rank_holds(world, kind, shared_runs):
    """ZeRO-3 with ``reduce_to_owner``, fp32 and bf16 compute, on every rank: the model
    state byte for byte (the gradient shards keep the owned columns, zeroed, as the
    default's do); the whole gradients each owner holds from backward to the step, in
    the gradients' dtype, the runtime's own byte for byte; and the step's allocations
    the plan's figure (no gather: only the cast to fp32 where the gradients are bf16),
    or up to one whole tensor more per gloo worker thread that a collective lets go of
    late. (Both kinds of a world from one run of its ranks.)"""
    ran = shared_runs(world, per_kind, to_owner_held_and_planned, kinds_at(world, kind))
    for rank, rows in enumerate(by_kind[kind] for by_kind in ran):
        for described, held, planned, whole, planned_whole, peak, (planned_peak, late) in rows:
            where = (described, world, rank)
            assert "reduce to owner" in described
            for role in ("params", "grads", "optimizer"):
                assert held[role] == planned[role], (where, role, held[role], planned[role])
            assert whole == planned_whole, (where, whole, planned_whole)
            assert planned_peak <= peak - VERDICT <= planned_peak + late, \
                (where, peak, planned_peak, late)


def owned_traffic_counted(rank, world, kind):
    """Bytes ``zf.comm_stats`` counts for the second step of ZeRO-3 with AdamW over every
    parameter, and with the whole-tensor optimizers by default and with
    ``reduce_to_owner``, each set up by ``Candidate.apply``."""
    out = {}
    for name, c, opts_of in (("adamw", Candidate(stage=3), _adamw),
                             ("rows", Candidate(stage=3), OPTIMIZERS[kind]),
                             ("to owner", Candidate(stage=3, to_owner=True), OPTIMIZERS[kind])):
        torch.manual_seed(0)
        model = GPT(CFG)
        model, opts = c.apply(model, opts_of(model))
        x = torch.randint(0, CFG.vocab, (2, CFG.context))
        for _ in range(2):
            _backward(model, opts, x)
            _step(opts)
        out[name] = sum(v for k, v in zf.comm_stats(model).items() if k.endswith("_bytes"))
    return out


def _adamw(model):
    return (torch.optim.AdamW(model.parameters()),)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_owned_traffic_is_what_the_runtime_counts(kind, shared_runs):
    """The plan's owned traffic (``step_time.owned_traffic``) over AdamW's is what
    ``zf.comm_stats`` counts at worlds 2 and 4: +2x the owned bytes (their padded rows)
    by default, +1x with ``reduce_to_owner`` (less the alignment, and the vote's one more
    flag). (Both kinds of a world from one run of its ranks.)"""
    from zerofn.planner.step_time import owned_traffic
    with torch.device("meta"):
        meta = GPT(CFG)
    for world in (2, 4):
        owned = owned_of(meta, OPTIMIZERS[kind](meta), world)
        padded = 4 * sum(t.padded(world) for t in owned.tensors)
        ran = shared_runs(world, per_kind, owned_traffic_counted, tuple(OPTIMIZERS))
        for rank, out in enumerate(by_kind[kind] for by_kind in ran):
            rows = owned_traffic(Candidate(stage=3), owned, 4)
            to_owner = owned_traffic(Candidate(stage=3, to_owner=True), owned, 4)
            assert out["rows"] - out["adamw"] == rows, (world, rank, out, rows)
            assert out["to owner"] - out["adamw"] == to_owner, (world, rank, out, to_owner)
            assert rows == 2 * padded and to_owner <= padded + 4, (world, rows, to_owner)


def auto_chooses_reduce_to_owner(rank, world):
    """``zf.auto`` with ZeRO-3 and ``reduce_to_owner`` its one candidate: the choice, whether
    the runtime it set up reduces the owned gradients to their owners, and what it
    printed."""
    import contextlib
    import io
    torch.manual_seed(0)
    model = GPT(CFG)
    opts = OPTIMIZERS["muon"](model)
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        model, got, result = zf.auto(model, opts, (x, x), world=world, machine=MACHINE,
                                     only=[Candidate(stage=3, to_owner=True)],
                                     host_budget=1e12)
    assert got is opts
    return result.choice.to_json(), runtime_of(model).reducer.to_owner is not None, \
        printed.getvalue()


def test_plan_weighs_reduce_to_owner_and_auto_applies_it():
    """Beside owned parameters the plan weighs ZeRO-3 with ``reduce_to_owner`` (not with
    NVMe, which the runtime refuses), its collectives' time less the default's by the
    owned bytes it does not carry where one micro-batch makes the step (each more adds a
    reduce per owned parameter: its latency), and names it in the table; without them it weighs none. A
    choice of it is what ``zf.auto`` applies (the runtime reduces to the owners) and
    prints."""
    model, opts = _meta_model_and_optimizers("muon")
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    result = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, optimizers=opts)
    owner_rows = [r for r in result.rows if r.candidate.to_owner]
    assert owner_rows and {(r.candidate.stage, r.candidate.offload) for r in owner_rows} == \
        {(3, None), (3, "cpu")}
    rows = {r.candidate: r for r in result.rows}
    for r in owner_rows:
        default = rows[Candidate(**dict(r.candidate.to_json(), to_owner=False))]
        if r.candidate.accum == 1:
            assert r.seconds["comm"] < default.seconds["comm"], r.candidate
        assert r.peak["host"] != default.peak["host"]
    assert "reduce to owner" in result.table(None)
    assert not any(r.candidate.to_owner for r in plan(model, (x, x), world=2, machine=MACHINE,
                                                      on_gpu=False).rows)
    chosen, reduces, printed = run_ranks(1, auto_chooses_reduce_to_owner)[0]
    assert chosen == Candidate(stage=3, to_owner=True).to_json() and reduces
    assert "zerofn plan: chosen: ZeRO-3, fp32, reduce to owner" in printed
    chosen = Candidate(stage=3, to_owner=True)
    assert chosen.config().plan().sharding.reduce_to_owner
    assert not Candidate(stage=3).config().plan().sharding.reduce_to_owner
    assert Candidate.from_json(json.loads(json.dumps(chosen.to_json()))) == chosen
    assert Candidate(stage=3, offload="nvme", to_owner=True).problems(2)
    assert Candidate(stage=2, to_owner=True).problems(2)
