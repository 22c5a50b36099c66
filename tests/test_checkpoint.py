"""Checkpoints: resharded to any world size and stage, exact resume in new processes,
crash safety, clear errors on a wrong checkpoint, and consolidation to one file."""
from __future__ import annotations

import copy
import datetime
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

try:    # a resumable data loader; GPU machines may not have torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:
    StatefulDataLoader = None

import zerofn as zf
from support.compare import TOL, assert_same_state, max_error
from support.errors import expect_error
from support.loops import build_parity, train_sharded, zero
from support.models import CONFIG, ParityGPT, batches, make_optimizer
from support.ranks import run_ranks
from zerofn.checkpoint import RNGState, load_checkpoint, save_checkpoint, wait_for_checkpoint
from zerofn.consolidate import main
from zerofn.io.checkpoint.checksums import ChecksumWriter
from zerofn.nanogpt import GPT, GPTConfig

pytestmark = pytest.mark.multirank

ROWS = 4            # global batch rows, the same at every world size
LATER = 2           # steps trained after a load
FRESH = 7           # the seed of a model a checkpoint loads into: other weights than saved


def later_batches(world: int):
    return batches(LATER, 1, world, per_rank=ROWS // world, seed=2)


# -- a world-2 checkpoint of every stage, shared by the tests below ----------------------
def save_each_stage(rank, world, root):
    out = {}
    for stage in (1, 2, 3):
        model, opt = build_parity(stage)
        train_sharded(model, opt, batches(3, 1, world, per_rank=ROWS // world), rank, world)
        save_checkpoint(os.path.join(root, f"zero{stage}"), model, opt, step=3, rng=RNGState())
        saved = zf.get_state_dict(model, opt, full=True)
        train_sharded(model, opt, later_batches(world), rank, world)
        out[stage] = saved, zf.get_state_dict(model, opt, full=True)
    if rank == 0:   # tensors go through a file: a queue would share memory with a dead process
        torch.save(out, f"{root}/refs.pt")
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, {stage: (full state at the save, full state 2 steps later)}), at world 2."""
    root = str(tmp_path_factory.mktemp("saved"))
    run_ranks(2, save_each_stage, root)
    return root, torch.load(f"{root}/refs.pt")


@pytest.fixture(scope="module")
def consolidated(saved, tmp_path_factory):
    """The ZeRO-3 checkpoint through both command lines, and back to a checkpoint."""
    root, _ = saved
    out = tmp_path_factory.mktemp("full")
    cli = [[sys.executable, "-m", "zerofn.consolidate", "to-full", f"{root}/zero3",
            f"{out}/model.safetensors"],
           [sys.executable, "-m", "zerofn", "consolidate",     # zerofn consolidate
            "to-full", f"{root}/zero3", f"{out}/model.pt", "--dtype", "bf16"]]
    for cmd in cli:
        subprocess.run(cmd, check=True, capture_output=True)
    assert main(["to-dcp", f"{out}/model.safetensors", f"{out}/back"]) == 0
    return str(out)


# -- 2 (and 5's reverse): any world, any stage ------------------------------------------
def reshard(rank, world, root, back):
    refs = torch.load(f"{root}/refs.pt")
    errors = {}
    for src in (1, 2, 3):
        saved, continued = refs[src]
        # Every pair at world 1; at other worlds, each stage once as source and as target.
        for dst in (1, 2, 3) if world == 1 else (src % 3 + 1,):
            model, opt = build_parity(dst, seed=FRESH)
            assert load_checkpoint(f"{root}/zero{src}", model, opt) == {"step": 3}
            assert_same_state(saved, zf.get_state_dict(model, opt, full=True))
            train_sharded(model, opt, later_batches(world), rank, world)
            errors[src, dst] = max_error(continued, zf.get_state_dict(model, opt, full=True))
    # The consolidated file, written back as a checkpoint, loads as the model alone.
    model, opt = build_parity(3, seed=FRESH)
    load_checkpoint(back, model)
    msd = zf.get_state_dict(model, opt, full=True)[0]
    assert all(torch.equal(msd[k], v) for k, v in refs[3][0][0].items())
    expect_error(["holds no optimizer state", "optimizer=None"], load_checkpoint, back, model, opt)
    if world != 2:   # a rank's RNG cannot move to another world; every rank says so
        expect_error(["'rng' was saved by 2 ranks, not", "load without it"], load_checkpoint, f"{root}/zero1", model, opt,
                     rng=RNGState())
    return errors


@pytest.mark.parametrize("world", [1, 4])
def test_resharded_load_continues_identically(saved, consolidated, world):
    errors = run_ranks(world, reshard, saved[0], f"{consolidated}/back")[0]
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOL, f"ZeRO-{worst[0]} at world 2 -> ZeRO-{worst[1]} at world " \
                                f"{world} continued {errors[worst]} away"


# -- 3: exact resume in new processes ---------------------------------------------------
GATE = threading.Event()


def gated_writes():
    """Hold every checkpoint write until GATE opens: training must go on meanwhile."""
    write = ChecksumWriter.write_data
    ChecksumWriter.write_data = lambda self, plan, planner: (GATE.wait(), write(self, plan, planner))[1]


def resume_parts(seed: int):
    model, opt = build_parity(3, seed=seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    v, t = CONFIG["vocab"], CONFIG["context"]
    data = TensorDataset(torch.randint(0, v, (48, t), generator=g),
                         torch.randint(0, v, (48, t), generator=g))
    loader = StatefulDataLoader(data, batch_size=ROWS, shuffle=True,
                                generator=torch.Generator().manual_seed(seed))
    return model, opt, sched, loader




def train_steps(model, opt, sched, it, rank, world, n):
    log = []
    for _ in range(n):
        x, y = next(it)
        loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        log.append((loss.item(), torch.rand(()).item()))   # the rank's generator, as dropout
    return log


def straight(rank, world, root):
    model, opt, sched, loader = resume_parts(seed=0)
    torch.manual_seed(100 + rank)
    it = iter(loader)   # 12 batches: the 10 steps stay in one epoch (see docs/checkpoints.md)
    log = train_steps(model, opt, sched, it, rank, world, 3)
    save_checkpoint(root, model, opt, step=3, keep=2, sched=sched, loader=loader, rng=RNGState())
    gated_writes()
    log += train_steps(model, opt, sched, it, rank, world, 2)
    save_checkpoint(root, model, opt, step=5, keep=2, async_save=True, sched=sched,
                    loader=loader, rng=RNGState(), tokens=5 * ROWS)
    log += train_steps(model, opt, sched, it, rank, world, 5)   # while step 5 is held back
    assert not os.path.exists(f"{root}/step-00000005")
    GATE.set()
    save_checkpoint(root, model, opt, step=10, keep=2, async_save=True, sched=sched,
                    loader=loader, rng=RNGState())                  # waits for step 5 first
    assert wait_for_checkpoint() == f"{root}/step-00000010"
    dist.barrier()
    assert sorted(os.listdir(root)) == ["latest", "step-00000005", "step-00000010"]
    dist.barrier()  # before anyone writes a result file there
    torch.save((log, zf.get_state_dict(model, opt, full=True)), f"{root}/straight{rank}.pt")
    return True


def resumed(rank, world, root):
    model, opt, sched, loader = resume_parts(seed=7)
    torch.manual_seed(999)
    out = load_checkpoint(f"{root}/step-00000005", model, opt, sched=sched, loader=loader,
                          rng=RNGState(), tokens=None)
    assert out == {"step": 5, "tokens": 5 * ROWS}, out
    log = train_steps(model, opt, sched, iter(loader), rank, world, 5)
    torch.save((log, zf.get_state_dict(model, opt, full=True)), f"{root}/resumed{rank}.pt")
    return True


@pytest.mark.skipif(StatefulDataLoader is None,
                    reason="needs torchdata (StatefulDataLoader) to resume the data order")
def test_resume_in_new_processes_is_bitwise_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(2, straight, root)
    run_ranks(2, resumed, root)
    for rank in range(2):
        log, state = torch.load(f"{root}/straight{rank}.pt")
        log_after, state_after = torch.load(f"{root}/resumed{rank}.pt")
        assert log_after == log[5:]                  # losses, data order and RNG draws
        assert_same_state(state, state_after)        # params, Adam state, lr: bitwise


# -- 4: crash safety and clear errors ----------------------------------------------------
def child(root: str, stage: str) -> None:
    """Run in a fresh interpreter: ``exit`` ends with an async save still writing; ``kill``
    dies by SIGKILL in the middle of writing its save."""
    dist.init_process_group("gloo", init_method=f"file://{root}.store-{stage}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    model, opt = build_parity(2)
    train_sharded(model, opt, batches(2, 1, 1, per_rank=ROWS), 0, 1)
    if stage == "exit":
        torch.save(zf.get_state_dict(model, opt, full=True), f"{root}.expected")
        write = ChecksumWriter.write_data
        ChecksumWriter.write_data = lambda *a: (threading.Event().wait(2), write(*a))[1]
        save_checkpoint(root, model, opt, step=2, async_save=True)
        return   # no wait: the exit path must finish and publish the save
    write = ChecksumWriter.write_data

    def write_then_die(self, plan, planner):
        write(self, plan, planner).wait()           # data files on disk, no metadata yet
        os.kill(os.getpid(), signal.SIGKILL)

    ChecksumWriter.write_data = write_then_die
    save_checkpoint(root, model, opt, step=3)


def run_child(root: str, stage: str) -> int:
    code = f"import test_checkpoint as t; t.child({root!r}, {stage!r})"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode


def load_after_crash(rank, world, root):
    model, opt = build_parity(1, seed=FRESH)
    assert load_checkpoint(root, model, opt) == {"step": 2}
    assert_same_state(torch.load(f"{root}.expected"), zf.get_state_dict(model, opt, full=True))
    return True


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path / "ckpt")
    assert run_child(root, "exit") == 0
    assert open(f"{root}/latest").read().strip() == "step-00000002"
    assert run_child(root, "kill") == -signal.SIGKILL
    assert open(f"{root}/latest").read().strip() == "step-00000002"
    assert os.listdir(f"{root}/.tmp-step-00000003")                 # it died mid-save
    run_ranks(2, load_after_crash, root)


def load_without_pointer(rank, world, root):
    """A first save killed after its rename into place, before it wrote ``latest``."""
    model, opt = build_parity(1)
    save_checkpoint(root, model, opt, step=1)
    os.remove(f"{root}/latest")
    fresh, fresh_opt = build_parity(1, seed=FRESH)
    return load_checkpoint(root, fresh, fresh_opt)


def test_a_first_save_cut_off_before_its_pointer_loads(tmp_path):
    """(Found by the kill-async fault campaign: 1 trial of 100.) The checkpoint is complete
    (renamed into place whole): the newest complete step loads, as ``latest`` would name."""
    assert run_ranks(1, load_without_pointer, str(tmp_path / "ckpt")) == [{"step": 1}]


def wrong_checkpoints(rank, world, root, scratch):
    good = f"{root}/zero2/step-00000003"
    broken = {"missing": f"{scratch}/missing", "truncated": f"{scratch}/truncated",
              "metadata": f"{scratch}/metadata"}
    if rank == 0:
        for path in broken.values():
            shutil.copytree(good, path)
        os.remove(f"{broken['missing']}/__1_0.distcp")
        with open(f"{broken['truncated']}/__0_0.distcp", "r+b") as f:
            f.truncate(100)
        with open(f"{broken['metadata']}/.metadata", "wb") as f:
            f.write(b"not a checkpoint")
    dist.barrier()
    model, opt = build_parity(3, seed=FRESH)
    deeper = GPT(GPTConfig(**{**CONFIG, "layers": 3}))
    deeper, deeper_opt = zero(3)(deeper, make_optimizer("adamw", deeper.parameters()))
    expect_error(["model.blocks.2.", "another model"], load_checkpoint, good, deeper, deeper_opt)
    narrower = GPT(GPTConfig(**{**CONFIG, "ffn": 128}))
    narrower, narrower_opt = zero(1)(narrower, make_optimizer("adamw", narrower.parameters()))
    expect_error(["model.blocks.0.fc.weight: saved (130, 48), here (128, 48)"],
                 load_checkpoint, good, narrower, narrower_opt)
    expect_error(["data file __1_0.distcp is missing"], load_checkpoint, broken["missing"], model, opt)
    expect_error(["__0_0.distcp is truncated (100 of"], load_checkpoint, broken["truncated"], model, opt)
    expect_error(["cannot read its metadata"], load_checkpoint, broken["metadata"], model, opt)
    expect_error(["No checkpoint at", "latest"], load_checkpoint, scratch, model, opt)
    # After every refusal the ranks are still in step: a good load works.
    assert load_checkpoint(good, model, opt) == {"step": 3}
    return True


def test_wrong_checkpoints_fail_on_every_rank_naming_the_problem(saved, tmp_path):
    run_ranks(2, wrong_checkpoints, saved[0], str(tmp_path))


# -- 5: the consolidated file is the full state dict ------------------------------------
def test_consolidated_file_loads_into_the_plain_model(saved, consolidated):
    from safetensors.torch import load_file
    full = saved[1][3][0][0]          # ZeRO-3's get_state_dict(full=True) at the save
    plain = ParityGPT()
    plain.load_state_dict(load_file(f"{consolidated}/model.safetensors"))
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in full.items())
    bf16 = torch.load(f"{consolidated}/model.pt", weights_only=True)
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.bfloat16())
               for k, v in full.items())
    plain.load_state_dict(copy.deepcopy(bf16))
