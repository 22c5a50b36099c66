"""The planner: its memory model's model-state terms and buffer pool are the bytes zerofn
holds (``zf.model_state_bytes``), exactly, for a GPT with tied weights and a LoRA
fine-tune with frozen weights; a plan within budgets, or a refusal naming the smallest
budget that fits; ``zf.auto`` applies its choice and the loop follows its micro-batches;
the probe's CUDA reading; the command lines; docs/plan.md's prose against its tables.
(tools/plan_accuracy.py measures the predictions against real runs.)"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import zerofn as zf
from support.held_saves import HeldUntilAStep
from support.ranks import run_ranks
from zerofn import cli
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.planner import Candidate, NoPlanFits, plan
from zerofn.planner import activations, memory
from zerofn.planner.probe import Machine, rates_from_cuda
from zerofn.io.checkpoint.staging import _leaves
from zerofn.planner.pool_replay import PoolReplay
from zerofn.planner.search import MARGIN
from zerofn.runtime.runtime import runtime_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))     # the planner's model families are a tool's
from plan_models import add_lora, trainable  # noqa: E402

# uneven on purpose: rows that do not divide by 2 ranks pad the flat shards
CFG = GPTConfig(vocab=101, width=48, heads=2, ffn=100, layers=2, context=16)
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11, "bf16": 2e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={"2": {"latency_s": 1e-4, "bus_bw": 1e9}},
                  process={"base": 3e8, "overhead": 0.05}, free={})
STATE = [Candidate(stage=s, precision=p, offload=o) for s in (1, 2, 3) for p in ("fp32", "bf16")
         for o in (None, "cpu")]
# a GPT with its head tied to its embedding; a LoRA fine-tune of one, every base weight
# frozen (the root unit wholly: embeddings, norms, head), adapters on two of each block's
# projections
MODELS = {"tied": lambda: GPT(CFG),
          "lora": lambda: add_lora(GPT(dataclasses.replace(CFG, layers=3)), ("qkv", "fc"))}


def held_and_modelled(rank, world, name):
    """Per candidate (DDP's bytes counted from its tensors): what zerofn holds after two
    steps, its pool's bytes, the state dicts' copies a save makes, and the plan's
    figures for each."""
    out = []
    for c in [Candidate(stage=0)] + STATE:
        torch.manual_seed(0)
        model = MODELS[name]()
        with torch.device("meta"):
            shape = memory.shape_of(MODELS[name](), world)
        opt = torch.optim.AdamW(trainable(model), lr=1e-3)
        model, opt = c.apply(model, opt)
        x = torch.randint(0, CFG.vocab, (2, CFG.context))
        for _ in range(2):
            opt.zero_grad()
            model(x, x).backward()
            opt.step()
        if c.stage == 0:
            out.append((c, {"cpu": _plain_bytes(model, opt)}, memory.model_state(c, shape),
                        0, 0, {}, {}))
            continue
        msd, osd = zf.get_state_dict(model, opt)
        leaves = list(_leaves({"model": msd, "optim": osd}, set()))
        # a background save stages every tensor; DCP copies each view of a larger buffer
        copied = {"async": sum(t.nbytes for t in leaves),
                  "sync": sum(t.nbytes for t in leaves if t.untyped_storage().nbytes() != t.nbytes)}
        cb = memory.DTYPES[c.precision].itemsize
        pool = PoolReplay(c.stage, world, shape.unit_shards,
                          tuple(n > 0 for n in shape.unit_trainable), shape.root, cb, 4,
                          memory.lends_shards(c), c.offload is None and cb != 4).run(2)
        out.append((c, zf.model_state_bytes(model), memory.model_state(c, shape),
                    pool.pool.nbytes(), memory.pool_bytes(c, shape)[0], copied,
                    {saves: memory.save_copies(c, shape, saves) for saves in copied}))
    return out


def _plain_bytes(model, opt) -> dict[str, int]:
    """DDP's model state as torch holds it."""
    return dict(params=sum(p.nbytes for p in model.parameters()),
                grads=sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
                optimizer=sum(t.nbytes for st in opt.state.values() for t in st.values()))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("world", [1, 2])
def test_model_state_and_pool_are_what_zerofn_holds(world, name):
    """Every device role without offload, and the host's optimizer state with it, byte for
    byte on rank 0 (the rank the model describes, holding the most rows), DDP's too; the
    buffer pool replayed (pool_replay.py) holds what the runtime's pool holds, and the
    planner's pool term is that but the gradient shards the pool lends (model state).
    The state dicts' bytes a save copies on a CPU, byte for byte: a background save's
    host copy (io/checkpoint/staging.py copies every tensor), a synchronous one's (DCP
    copies each tensor that is a view into a larger buffer before writing it)."""
    for c, held, modelled, pool, planned, copied, copies in run_ranks(
            world, held_and_modelled, name)[0]:
        roles = ("params", "grads", "optimizer") if c.offload is None else ("optimizer",)
        places = {"cpu": "device"} if c.offload is None else {"host": "host"}
        for where, place in places.items():
            for role in roles:
                assert held[where][role] == modelled[place][role], \
                    (c.describe(), world, place, role, held[where][role], modelled[place][role])
        if c.stage:    # (the pool's bytes a lent gradient shard holds count as grads)
            lent = held["cpu"]["grads"] if memory.lends_shards(c) else 0
            assert held["cpu"]["buffers"] == pool - lent, (c.describe(), world, pool, held)
            assert planned == pool - lent, (c.describe(), world, planned, pool, lent)
        assert copied == copies, (c.describe(), world, copied, copies)


POOLED = [Candidate(stage=s, precision=p, offload=o) for s in (1, 2, 3)
          for p in ("fp32", "bf16") for o in (None, "cpu")]


def pool_held_and_planned(rank, world):
    """Per candidate: the runtime's pool (``ctx.pool.nbytes()``, taken or free) after three
    steps of the tied GPT, and the planner's: ``pool_bytes`` and the gradient shards the
    pool lends (which ``pool_bytes`` leaves to the model state)."""
    out = []
    for c in POOLED:
        torch.manual_seed(0)
        model = MODELS["tied"]()
        with torch.device("meta"):
            shape = memory.shape_of(MODELS["tied"](), world)
        model, opt = c.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        x = torch.randint(0, CFG.vocab, (2, CFG.context))
        for _ in range(3):
            opt.zero_grad()
            model(x, x).backward()
            opt.step()
        lent = memory.model_state(c, shape)["device"]["grads"] if memory.lends_shards(c) else 0
        out.append((c.describe(), runtime_of(model).ctx.pool.nbytes(),
                    memory.pool_bytes(c, shape)[0] + lent))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 4])
def test_pool_bytes_are_the_runtime_pools_on_every_rank(world):
    """The planner's pool (``memory.pool_bytes``, the lent gradient shards added back) is
    the runtime's buffer pool byte for byte on every rank, at every stage, in fp32 and
    bf16, with the step on the device and offloaded to the host: the runtime's own
    requests through its best fit, its in-flight bound and gloo's scratch past two ranks."""
    for rank, rows in enumerate(run_ranks(world, pool_held_and_planned)):
        for described, held, planned in rows:
            assert held == planned, (described, world, rank, held, planned)


def test_frozen_parameters_plan_without_gradients_or_state():
    """A LoRA fine-tune plans (torch's MemTracker cannot hook a frozen parameter; the
    planner's activation run marks them), and each candidate's model state counts the
    frozen parameters' weights (and masters) but no gradient, moment or step counter:
    DDP's gradients and moments are the adapters' alone."""
    with torch.device("meta"):
        model = MODELS["lora"]()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapters = trainable(model)
    assert frozen and adapters
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    result = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False)
    assert result.choice is not None and len(result.rows) > 20
    ddp = memory.model_state(Candidate(stage=0), memory.shape_of(model, 2))["device"]
    n = sum(p.numel() for p in adapters)
    assert ddp["params"] == 4 * sum(p.numel() for p in model.parameters())
    assert ddp["grads"] == 4 * n and ddp["optimizer"] == 2 * 4 * n + 4 * len(adapters)
    acts = activations.measure(model, (x, x), torch.float32)
    assert acts.grads == 4 * n


def test_tied_weights_count_once():
    """The GPT's head is its embedding: the plan holds, steps and reduces it once, and the
    state dict (which names it twice) copies it under both names."""
    model = _meta_gpt()
    shape = memory.shape_of(model, 1)
    unique = list(model.parameters())
    named = [p for _, p in model.named_parameters(remove_duplicate=False)]
    assert len(named) == len(unique) + 1 and model.head.weight is model.tok.weight
    assert shape.params == sum(p.numel() for p in unique) and shape.tensors == len(unique)
    ddp = memory.model_state(Candidate(stage=0), shape)["device"]
    assert ddp["params"] == 4 * shape.params
    assert memory.state_dict_bytes(Candidate(stage=1), shape)["model"] == \
        4 * sum(p.numel() for p in named)


def test_activations_follow_checkpointing_and_dtype():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=256, width=64, heads=2, ffn=256, layers=4, context=32))
    x = torch.zeros(2, 32, dtype=torch.long)
    plain = activations.measure(model, (x, x), torch.float32)
    ck = activations.measure(model, (x, x), torch.float32, checkpoint=True)
    half = activations.measure(model, (x, x), torch.bfloat16)
    assert ck.saved < plain.saved / 2
    assert half.grads * 2 == plain.grads == 4 * sum(p.numel() for p in model.parameters())
    assert plain.backward_dropped <= plain.backward_kept and plain.backward_kept >= plain.grads


def _meta_gpt(cfg=CFG):
    with torch.device("meta"):
        return GPT(cfg)


def test_plan_fits_its_budget_or_names_the_smallest_that_would():
    """A candidate fits where its predicted peak and the margin (the model's error) are
    within the budget; below every one the refusal names the smallest budget that fits,
    and that budget plans."""
    model = _meta_gpt()
    x = torch.zeros(4, CFG.context, dtype=torch.long)
    free = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False)
    assert all(r.fits for r in free.rows) and free.choice == free.rows[0].candidate
    times = [r.seconds["total"] for r in free.rows]
    assert times == sorted(times)
    smallest = min(r.peak["host"] for r in free.rows) * (1 + MARGIN)
    with pytest.raises(NoPlanFits) as refused:
        plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False,
             host_budget=smallest - 1)
    named = re.search(r"smallest host budget that fits .* is ([0-9.]+) GB", str(refused.value))
    assert named, str(refused.value)
    budget = float(named.group(1)) * 1e9 + 0.005e9     # (the message rounds to 10 MB)
    assert abs(budget - smallest) <= 0.01e9
    within = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, host_budget=budget)
    chosen = next(r for r in within.rows if r.candidate == within.choice)
    assert chosen.peak["host"] * (1 + MARGIN) <= budget
    assert all(r.fits == (r.peak["host"] * (1 + MARGIN) <= budget) for r in within.rows)
    bare = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=False, host_budget=budget,
                margin=0.0)
    assert len(bare.fitting()) >= len(within.fitting())


SAVED = [Candidate(stage=3, offload="cpu"), Candidate(stage=3, offload="nvme")]


def _tied_under(c, world, root):
    """The tied GPT set up as ``c`` sets it up (NVMe files under ``root``), the plan's
    layout of rank 0, and a step."""
    torch.manual_seed(0)
    model = MODELS["tied"]()
    with torch.device("meta"):
        shape = memory.shape_of(MODELS["tied"](), world)
    model, opt = c.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3), root)
    x = torch.randint(0, CFG.vocab, (2, CFG.context))

    def step():
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
    return model, opt, shape, step
STAGING = 800_000     # bytes: a data file of 400 kB, about half the tied GPT's state


def background_save_held(rank, world, root):
    """Per candidate: what the runtime's own background saves hold (io/checkpoint/
    unit_copies.py's ``UnitCopies``: its budget, the peak of the copies it made, the units
    it copied before a step changed them), one save at the default ``staging_bytes``
    and one at ``STAGING`` with two steps right after the call, and the plan's figures."""
    from zerofn.io.checkpoint import streamed
    from zerofn.io.checkpoint.api import _file_bytes
    from zerofn.io.checkpoint.checksums import ChecksumWriter
    made, plain = [], streamed.UnitCopies

    class Recorded(plain):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    streamed.UnitCopies = Recorded
    out = []
    try:
        for c in SAVED:
            model, opt, shape, step = _tied_under(c, world, root)
            step()
            made.clear()
            zf.save_checkpoint(f"{root}/default-{c.offload}", model, opt, step=1,
                               async_save=True)
            zf.wait_for_checkpoint()
            # (its writer waits for the first step, so the steps find units to copy aside)
            streamed.UnitCopies = HeldUntilAStep
            zf.save_checkpoint(f"{root}/small-{c.offload}", model, opt, step=2,
                               async_save=True, staging_bytes=STAGING)
            step(), step()
            zf.wait_for_checkpoint()
            streamed.UnitCopies = Recorded
            [default], small = made, HeldUntilAStep.made[-1]
            out.append(dict(
                runtime=dict(default=(ChecksumWriter(root).file_bytes, default.budget),
                             small=(_file_bytes(STAGING), small.budget),
                             peak=small.peak, copied=len(small.copied)),
                plan=dict(default=memory.staging(), small=memory.staging(STAGING),
                          held=memory.save_held(c, shape, "async", staging_bytes=STAGING),
                          read=memory.unit_read(c, shape),
                          unit=3 * memory.FP32 * shape.largest,
                          item=memory.FP32 * shape.largest_piece(c.stage))))
    finally:
        streamed.UnitCopies = plain
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_background_save_phase_is_the_runtimes_bound(world, tmp_path):
    """The plan's background save splits ``staging_bytes`` as ``save_checkpoint`` does (its
    data files, its copies' budget: the runtime's own figures, at the default and at a
    given size), and what the runtime's copies hold at their peak, with steps right after
    the call copying units aside, is within the plan's save phase less the unit it reads
    (which the copies' count leaves out), and fills it to within one unit's items and the
    writer's one: the first step copies units aside until the next would not fit."""
    for rank, rows in enumerate(run_ranks(world, background_save_held, str(tmp_path))):
        for c, row in zip(SAVED, rows):
            runtime, planned = row["runtime"], row["plan"]
            where = (c.describe(), world, rank)
            assert runtime["default"] == planned["default"], where
            assert runtime["small"] == planned["small"], where
            assert runtime["copied"] > 0, where     # (the steps found units not written)
            bound = planned["held"] - planned["read"]
            assert 0 < runtime["peak"] <= bound, (where, row)
            assert bound - runtime["peak"] <= planned["unit"] + planned["item"], (where, row)


READ = [Candidate(stage=3, offload="nvme"),
        Candidate(stage=3, precision="bf16", offload="cpu", state_dtype="int8",
                  master_dtype="bf16")]


def unit_reads(rank, world, root):
    """Per candidate: the largest memory the runtime's ``read_unit`` gives a unit out of
    memory (a save reads one at a time: io/checkpoint/streamed.py), and the plan's
    ``unit_read`` with the decode buffer it allows (one tensor's fp32 rows)."""
    out = []
    for c in READ:
        model, _, shape, step = _tied_under(c, world, root)
        step()
        rt = runtime_of(model)
        unread = [u for u in rt.units if u.slots and rt.unread(u)]
        read = max(sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in rt.read_unit(u)}.values()) for u in unread)
        out.append((len(unread), read, memory.unit_read(c, shape),
                    4 * shape.largest_piece(c.stage, trainable=True)))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_the_unit_a_save_reads_is_the_runtimes(world, tmp_path):
    """The one unit a save holds read into memory, as the plan counts it, against the
    runtime's own ``read_unit``: a swap file's block (rounded up to its 4 KiB alignment),
    low-precision state decoded into fp32 (and the plan's one tensor of decode buffer)."""
    from zerofn.runtime.homes.nvme_file import BLOCK
    for rank, rows in enumerate(run_ranks(world, unit_reads, str(tmp_path))):
        for c, (unread, read, planned, decoding) in zip(READ, rows):
            where = (c.describe(), world, rank, read, planned)
            assert unread, where      # (every unit's state is out of memory between steps)
            if c.offload == "nvme":
                assert 0 <= read - planned < BLOCK, where
            else:
                assert planned - read == decoding, where


def test_a_save_the_plan_does_not_know_is_refused():
    with pytest.raises(ValueError, match="saves='weekly': one of"):
        plan(_meta_gpt(), (torch.zeros(2, CFG.context, dtype=torch.long),) * 2, world=1,
             machine=MACHINE, on_gpu=False, saves="weekly")


def test_a_gpu_plan_keeps_device_and_host_apart():
    model = _meta_gpt()
    x = torch.zeros(2, CFG.context, dtype=torch.long)
    r = plan(model, (x, x), world=2, machine=MACHINE, on_gpu=True, precision="bf16")
    by = {row.candidate: row.peak for row in r.rows}
    off = by[Candidate(stage=3, precision="bf16", offload="cpu", params=True, micro_batch=2)]
    kept = by[Candidate(stage=3, precision="bf16", micro_batch=2)]
    assert off["device"] < kept["device"] and off["host"] > kept["host"]


def auto_at(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab, (2, CFG.context))
    with torch.device("meta"):
        planned = plan(GPT(CFG), (x, x), world=world, machine=MACHINE, on_gpu=False)
    cap = sorted(r.peak["host"] for r in planned.rows)[len(planned.rows) // 2] * (1 + MARGIN)
    model, opt, result = zf.auto(model, opt, (x, x), machine=MACHINE, on_gpu=False,
                                 host_budget=cap, quiet=True)
    model(x, x).backward()
    opt.step()
    chosen = next(r for r in result.rows if r.candidate == result.choice)
    return (result.choice, chosen.peak["host"] * (1 + MARGIN) <= cap, zf.is_transformed(model),
            result.choice.stage)


@pytest.mark.multirank
def test_auto_applies_the_fastest_candidate_that_fits():
    for choice, fits, transformed, stage in run_ranks(2, auto_at):
        assert fits and transformed == (stage > 0)


def auto_loop(rank, world, stage):
    """``zf.auto`` held to one candidate of micro-batch 2 x accumulation 2, trained for
    three steps by the loop docs/plan.md shows; the weights after."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = 4
    data = _global_batches(world * rows)
    mine = [b[rank * rows:(rank + 1) * rows] for b in data]
    model, opt, result = zf.auto(model, opt, (mine[0][:2, :-1], mine[0][:2, 1:]), batch=rows,
                                 only=[Candidate(stage=stage, micro_batch=2, accum=2)],
                                 machine=MACHINE, on_gpu=False, quiet=True)
    for x in mine:
        for (xs, ys), context in result.micro_batches(model, x[:, :-1], x[:, 1:]):
            with context:
                (model(xs, ys) / result.accum).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(ValueError, match=r"a batch of \[3\] rows: the plan's is 4 \(2 x 2\)"):
        next(result.micro_batches(model, x[:3]))
    if stage:
        return zf.get_state_dict(model, opt, full=True)[0]
    return getattr(model, "module", model).state_dict()


def _global_batches(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG.vocab, (rows, CFG.context + 1), generator=g) for _ in range(3)]


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_loop_follows_the_choice_micro_batches(stage):
    """The chosen micro-batch x accumulation, as ``micro_batches`` splits each step's batch
    (DDP and ZeRO-1 skip the reduction but for the last; ZeRO-2/3 reduce each), trains what
    plain PyTorch trains on the global batch."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for b in _global_batches(2 * 4):
        ref(b[:, :-1], b[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(2, auto_loop, stage):
        assert max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-5


def test_probe_reads_cuda_rates_from_torch():
    props = types.SimpleNamespace(name="Stand-in H200", total_memory=150 * 2**30,
                                  multi_processor_count=132)
    assert rates_from_cuda(props, (140 * 2**30, 150 * 2**30)) == dict(
        name="Stand-in H200", total=150 * 2**30, free=140 * 2**30, sms=132)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="H2D/D2H and NCCL need a GPU")
def test_probe_measures_the_gpu_paths():
    from zerofn.planner.probe import transfer_rates
    h2d, d2h = transfer_rates(1 << 20)
    assert h2d > 0 and d2h > 0


def test_zerofn_plan_json_and_refusal(capsys, tmp_path):
    machine = tmp_path / "probe.json"
    machine.write_text(json.dumps(MACHINE.to_json()))
    args = ["plan", "width=48,layers=2,heads=2,ffn=100,vocab=101,context=16", "--batch", "2",
            "--world", "2", "--probe", str(machine)]
    assert cli.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["choice"] == out["rows"][0]["candidate"] and out["rows"][0]["fits"]
    assert cli.main(args + ["--host-budget", "0.01"]) == 3
    assert "the smallest host budget that fits" in capsys.readouterr().err


def test_zerofn_plan_gpu_needs_a_gpu_probe(capsys, tmp_path):
    """``--gpu`` plans with a GPU's rates: without a GPU here and without ``--probe``, or
    with a CPU's probe, it refuses in one line naming ``zerofn probe`` on the GPU machine."""
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(MACHINE.to_json()))
    args = ["plan", "width=48,layers=2,heads=2,ffn=100,vocab=101,context=16", "--batch", "2",
            "--world", "2", "--gpu"]
    refusals = [args + ["--probe", str(cpu)]] + [args] * (not torch.cuda.is_available())
    for argv in refusals:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "run `zerofn probe` on the GPU machine" in err, err
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(dict(MACHINE.to_json(), extra={"cuda": {"name": "Stand-in"}})))
    assert cli.main(args + ["--probe", str(gpu), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["machine"] == MACHINE.device


class _Routed(torch.nn.Module):
    """A layer that sends each token to the expert its gate picks (data-dependent shapes)."""

    def __init__(self, width=16, experts=2):
        super().__init__()
        self.gate = torch.nn.Linear(width, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(experts))

    def forward(self, x, y):
        pick = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (pick == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return (out - y).pow(2).mean()


def test_a_model_with_data_dependent_shapes_is_refused_by_name():
    with torch.device("meta"):
        model = _Routed()
    x = torch.zeros(4, 16)
    with pytest.raises(ValueError, match=r"_Routed on fake tensors.*aten\.nonzero.*stand-in"):
        plan(model, (x, x), world=1, machine=MACHINE, on_gpu=False)


def test_the_model_libraries_memory_is_measured():
    """A model built from an installed library (transformers) is planned with what that
    library adds to a process; one of torch's and zerofn's own, or of the user's files,
    adds nothing and starts no process."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    from zerofn.planner import libraries
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1,
                                        n_head=2))
    assert libraries.modules_of(hf) == ("transformers.activations",
                                        "transformers.models.gpt2.modeling_gpt2",
                                        "transformers.pytorch_utils")
    assert libraries.resident_bytes(hf) > 10 * 2**20
    assert libraries.modules_of(_meta_gpt()) == libraries.modules_of(_Routed()) == ()
    with pytest.raises(RuntimeError, match="(?s)measuring what importing zerofn_no_such_module "
                                           "adds to a process failed: .*ModuleNotFoundError"):
        libraries._measure(("zerofn_no_such_module",))


@pytest.mark.slow(reason="two configurations of tools/plan_accuracy.py in fresh processes")
def test_plan_accuracy_runs_grid_points():
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "plan_accuracy.py")
    done = subprocess.run([sys.executable, tool, "--shapes", "narrow", "--worlds", "1",
                           "--stages", "0,2", "--offloads", "none", "--steps", "2"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 configurations. Memory |error|" in done.stdout


@pytest.mark.multirank
def test_zerofn_train_plan_auto_trains_the_choice(tmp_path):
    """``zerofn train --plan auto`` on two ranks: the plan's choice, printed with its
    reason, trains; flags the plan chooses itself are refused before any rank starts."""
    machine = tmp_path / "probe.json"
    machine.write_text(json.dumps(MACHINE.to_json()))
    flags = ["--model", "tiny", "--context", "32", "--batch", "4", "--steps", "2",
             "--eval-batches", "1", "--log-every", "1", "--plan", "auto", "--probe",
             str(machine)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "zerofn.train"]
    done = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("zerofn plan: chosen: ZeRO-") == 1, done.stdout
    assert "final loss" in done.stdout or "step 2" in done.stdout, done.stdout[-2000:]
    # refused by the launcher, before any rank starts (exit 2, as argparse's refusals)
    refused = subprocess.run([sys.executable, "-m", "zerofn", "train", "--nproc", "2", *flags,
                              "--stage", "2"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--plan auto chooses --stage itself" in refused.stderr


# -- docs/plan.md's figures against its tables -----------------------------------------
PERCENT = re.compile(r"([+-]?\d+\.\d) %")


def _tables(lines: list[str]) -> list[tuple[int, list[str], list[list[str]]]]:
    """Each markdown table: (its first line's index, header cells, rows of cells)."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[i:j]]
            out.append((i, cells[0], cells[2:]))
            i = j
        else:
            i += 1
    return out


def _errors(header: list[str], rows: list[list[str]], which: int = 0) -> list[float]:
    """The ``which``-th "error" column's figures, in percent."""
    col = [k for k, h in enumerate(header) if h == "error"][which]
    return [float(PERCENT.match(r[col]).group(1)) for r in rows]


def _after(lines: list[str], start: int, pattern: str):
    """The first match of ``pattern`` in the text from line ``start`` on (its lines joined
    by spaces: a sentence may wrap)."""
    return re.search(pattern, " ".join(lines[start:]))


def _near(quoted: str, errors: list[float], how) -> bool:
    """A figure quoted to 0.1 against one worked out from the table's rounded cells."""
    return abs(float(quoted) - how(errors)) <= 0.1 + 1e-9


def test_plan_docs_prose_agrees_with_its_tables():
    """docs/plan.md quotes its tables: each summary line is worked out again from the table
    above it, each range of errors it states is its table's extremes, every signed figure
    in its prose is a cell of a table, and the margin covers the largest under-prediction
    the tables show (which the text names)."""
    lines = (ROOT / "docs" / "plan.md").read_text().splitlines()
    tables = _tables(lines)
    under = []
    for start, header, rows in tables:
        if "peak measured MB" in header:
            memory_err, step_err = _errors(header, rows), _errors(header, rows, 1)
            m = _after(lines, start + len(rows) + 2, r"(\d+) configurations\. Memory \|error\|: "
                       r"median ([\d.]+) %, worst ([\d.]+) %\. Step time \|error\|: median "
                       r"([\d.]+) %, worst ([\d.]+) %")
            assert int(m.group(1)) == len(rows)
            for quoted, errors, how in ((m.group(2), memory_err, _abs_median),
                                        (m.group(3), memory_err, _abs_worst),
                                        (m.group(4), step_err, _abs_median),
                                        (m.group(5), step_err, _abs_worst)):
                assert _near(quoted, errors, how), (m.group(0), how(errors))
            ranges = _after(lines, start + len(rows) + 2,
                            r"every configuration within (-?[\d.]+) % and \+?([\d.]+) %")
            assert (float(ranges.group(1)), float(ranges.group(2))) == \
                (min(memory_err), max(memory_err)), ranges.group(0)
            under += memory_err
        elif "save peak measured MB" in header:
            errors = _errors(header, rows)
            m = _after(lines, start + len(rows) + 2,
                       r"(\d+) saves: \|error\| median ([\d.]+) %, worst ([\d.]+) %")
            assert int(m.group(1)) == len(rows)
            assert _near(m.group(2), errors, _abs_median) and _near(m.group(3), errors, _abs_worst)
            under += errors
        for fam, median, worst in _by_family(lines, start, header, rows):
            errors = [e for r, e in zip(rows, _errors(header, rows)) if r[0] == fam]
            assert _near(median, errors, _abs_median) and _near(worst, errors, _abs_worst), fam
    cells = {c for _, _, rows in tables for r in rows for c in r}
    prose = [ln for ln in lines if not ln.startswith("|")]
    signed = {f for ln in prose for f in re.findall(r"[+-]\d+\.\d %", ln)}
    assert signed <= cells, sorted(signed - cells)
    m = _after(lines, 0, r"margin for the model's error \((\d+) %.*?under-prediction "
                         r"measured below \((-[\d.]+) %")
    assert float(m.group(1)) == round(100 * MARGIN) and float(m.group(2)) == min(under)
    assert 100 * MARGIN >= -min(under)


def _by_family(lines, start, header, rows) -> list[tuple[str, str, str]]:
    """(shape, median, worst) for each "median ... X % and worst Y % (shape)" the text
    after an accuracy table quotes, up to the next heading."""
    if "peak measured MB" not in header:
        return []
    text = " ".join(lines[start + len(rows) + 2:])
    text = text[:text.find(" ## ")] if " ## " in text else text
    shapes = {r[0] for r in rows}
    return [(fam, a, b) for a, b, fam in
            re.findall(r"([\d.]+) % and (?:worst )?([\d.]+) % \((\w+)\)", text) if fam in shapes]


def _abs_median(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors)


def _abs_worst(errors: list[float]) -> float:
    return max(abs(e) for e in errors)
