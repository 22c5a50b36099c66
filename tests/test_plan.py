"""The planner (issue 34): its memory model's model-state terms are the bytes zerofn holds
(``zf.model_state_bytes``), exactly; a plan within budgets, or a refusal naming the
smallest budget that fits; ``zf.auto`` applies its choice; the probe's CUDA reading; the
command lines. (tools/plan_accuracy.py measures the predictions against real runs.)"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import types

import pytest
import torch

import zerofn as zf
from support.ranks import run_ranks
from zerofn import cli
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.planner import Candidate, NoPlanFits, plan
from zerofn.planner import activations, memory
from zerofn.planner.probe import Machine, rates_from_cuda
from zerofn.io.checkpoint.staging import _leaves
from zerofn.planner.search import MARGIN

# uneven on purpose: rows that do not divide by 2 ranks pad the flat shards
CFG = GPTConfig(vocab=101, width=48, heads=2, ffn=100, layers=2, context=16)
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11, "bf16": 2e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={"2": {"latency_s": 1e-4, "bus_bw": 1e9}},
                  process={"base": 3e8, "overhead": 0.05}, free={})
STATE = [Candidate(stage=s, precision=p, offload=o) for s in (1, 2, 3) for p in ("fp32", "bf16")
         for o in (None, "cpu")]


def held_and_modelled(rank, world):
    out = []
    for c in STATE:
        torch.manual_seed(0)
        model = GPT(CFG)
        with torch.device("meta"):
            shape = memory.shape_of(GPT(CFG), world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = c.apply(model, opt)
        x = torch.randint(0, CFG.vocab, (2, CFG.context))
        model(x, x).backward()
        opt.step()
        msd, osd = zf.get_state_dict(model, opt)
        leaves = list(_leaves({"model": msd, "optim": osd}))
        # a background save stages every tensor; DCP copies each view of a larger buffer
        copied = {"async": sum(t.nbytes for t in leaves),
                  "sync": sum(t.nbytes for t in leaves if t.untyped_storage().nbytes() != t.nbytes)}
        out.append((c, zf.model_state_bytes(model), memory.model_state(c, shape), copied,
                    {saves: memory.save_copies(c, shape, saves) for saves in copied}))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_model_state_terms_are_what_zerofn_holds(world):
    """Every device role without offload, and the host's optimizer state with it, byte for
    byte on rank 0 (the rank the model describes, holding the most rows)."""
    for c, held, modelled, _, _ in run_ranks(world, held_and_modelled)[0]:
        roles = ("params", "grads", "optimizer") if c.offload is None else ("optimizer",)
        places = {"cpu": "device"} if c.offload is None else {"host": "host"}
        for where, place in places.items():
            for role in roles:
                assert held[where][role] == modelled[place][role], \
                    (c.describe(), world, place, role, held[where][role], modelled[place][role])


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_the_save_phase_counts_the_copies_a_save_makes(world):
    """The state dicts' bytes a save copies on a CPU, byte for byte: a background save's
    host copy (io/checkpoint/staging.py copies every tensor), a synchronous one's (DCP
    copies each tensor that is a view into a larger buffer before writing it)."""
    for c, _, _, copied, modelled in run_ranks(world, held_and_modelled)[0]:
        assert copied == modelled, (c.describe(), world, copied, modelled)


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
    reason, trains; flags the plan chooses itself are refused."""
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
    refused = subprocess.run(cmd + flags + ["--stage", "2"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert refused.returncode != 0
    assert "--plan auto chooses --stage itself" in refused.stdout + refused.stderr
