"""A rank that raises, dies or stalls: every other rank stops with a RankFailure naming it
and its phase, within the collective timeout, and nothing stays alive.

The ranks start as run_ranks's do, forked from its server, but are run here (a rank
killed with SIGKILL reports nothing, and a stalled one never returns): the parent waits
for the survivor's report, then ends what is left and checks every process is gone.
"""
from __future__ import annotations

import datetime
import os
import queue
import re
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from support.models import batches, make_models
from support.ranks import started

pytestmark = pytest.mark.timed   # (conftest.py: run alone, after the rest)

FAULT_STEP = 2   # the optimizer step (from 1) in which rank 1 fails


def _inject(kind: str, phase: str, model, opt):
    """Make this rank fail at ``FAULT_STEP`` in ``phase``: raise, SIGKILL itself or stall."""
    def fail():
        if kind == "raise":
            raise ValueError(f"injected failure in {phase}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)   # stall (the parent ends it)

    steps = {"n": 0}      # by the model's forwards, one a step (ZeRO-1/2 step the
                          # optimizer once per unit)

    def at_step(*_):
        if steps["n"] == FAULT_STEP:
            fail()

    model.register_forward_pre_hook(lambda m, a: steps.__setitem__("n", steps["n"] + 1))
    if phase == "save":      # inside the save's collectives: a hung or lost filesystem
        from zerofn.io.checkpoint import api as checkpoint
        save = checkpoint.dcp.save
        checkpoint.dcp.save = lambda *a, **k: (at_step(), save(*a, **k))[1]
    elif phase == "forward":
        model.blocks[0].register_forward_pre_hook(at_step)
    elif phase == "backward":
        model.blocks[0].register_full_backward_hook(at_step)
    else:   # inside zerofn's step: the user's optimizer stepping a unit's rows (its own
        # step hooks run outside zerofn's, once, as a user's code after the step does)
        from zerofn.runtime.homes import device
        inner = device.step_without_hooks
        device.step_without_hooks = lambda optimizer: (at_step(), inner(optimizer))[1]


def _rank(rank, world, init, stage, kind, phase, timeout, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        _, model = make_models()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stages = [zf.shard_optimizer(timeout=timeout), zf.shard_grads(), zf.shard_params()]
        model, opt = zf.compose(*stages[:stage])(model, opt)
        if rank == 1:
            _inject(kind, phase, model, opt)
        done, ckpt = [], os.path.join(os.path.dirname(init[len("file://"):]), "ckpt")
        for step in batches(4, 1, world):
            x, y = step[0]
            model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
            if phase == "save":
                zf.save_checkpoint(ckpt, model, opt, step=len(done) + 1)
            done.append(1)
            if rank == 0:
                results.put((rank, "step", time.monotonic()))
        results.put((rank, "done", None))
    except BaseException as e:  # the report the test reads
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc(),
                                     getattr(e, "ranks", None), time.monotonic())))


def run_fault(stage: int, kind: str, phase: str, timeout: float = 60, bound: float = 90):
    """Two ranks, rank 1 failing; returns (rank 0's error, seconds from rank 0's last
    finished step to its error, rank 1's error or None)."""
    with started(2, _rank, stage, kind, phase, timeout) as (procs, results):
        got, last_step = {}, None
        try:
            deadline = time.monotonic() + bound
            while 0 not in got:
                rank, what, value = results.get(timeout=max(1, deadline - time.monotonic()))
                if what == "step":
                    last_step = value
                else:
                    got[rank] = (what, value)
            if kind == "raise" and 1 not in got:
                got.setdefault(1, results.get(timeout=30)[1:])
        except queue.Empty:
            pytest.fail(f"rank 0 did not stop within {bound} s: {got}")
        finally:
            for p in procs:
                p.join(timeout=5 if p is procs[0] else 0.5)
                if p.is_alive():
                    p.kill()        # the stalled rank: what a launcher does
                    p.join()
        assert not any(p.is_alive() for p in procs)
    what, value = got[0]
    assert what == "error", f"rank 0 finished although rank 1 failed: {got}"
    name, message, tb, ranks, when = value
    assert name == "RankFailure", tb
    assert ranks == [1], message
    other = got.get(1, (None, None))[1]
    return message, when - last_step, other


def reported(stage: int, kind: str, phase: str, **options):
    """``run_fault``'s (rank 0's error, rank 1's), rank 0's printed with how long it took to
    stop (``pytest -s`` shows it)."""
    message, seconds, other = run_fault(stage, kind, phase, **options)
    print(f"\n[{kind} in {phase}, ZeRO-{stage}] rank 0 stopped {seconds:.2f} s after its "
          f"last step:\n{message}")
    return message, other


def and_slow(first, *more) -> list:
    """(stage, phase) cases: ``first``, then ``more`` as slow variants."""
    mark = pytest.mark.slow(reason="the same failure at more stages and phases")
    return [first, *(pytest.param(*case, marks=mark) for case in more)]


@pytest.mark.multirank
@pytest.mark.parametrize("stage,phase", and_slow((3, "forward"), (1, "step"), (2, "forward")))
def test_a_raise_is_named_by_every_other_rank(stage, phase):
    message, other = reported(stage, "raise", phase)
    assert f"rank 1 raised ValueError: injected failure in {phase} in {phase} of step " \
           f"{FAULT_STEP}" in message
    assert "rank 0 stopped in " in message
    name, text, tb, _, _ = other
    # The raising rank's own error is untouched, with a note of where it was.
    assert name == "ValueError" and f"zerofn: rank 1 raised this in {phase} of step " \
        f"{FAULT_STEP}" in tb


@pytest.mark.multirank
def user_loop_failure(*flags: str) -> tuple[int, str]:
    """tests/scripts/user_loop_failure.py under torchrun on two ranks: its exit code and
    output."""
    from support.jobs import SCRIPTS, finish, torchrun
    script = os.path.join(SCRIPTS, "user_loop_failure.py")
    code, out, seconds = finish(torchrun(["--standalone", "--nproc-per-node", "2"], list(flags),
                                         script=script))
    print(f"\n[raise in user backward code, ZeRO-2, torchrun {flags}] ended after "
          f"{seconds:.1f} s:\n" + "\n".join(line for line in out.splitlines() if "rank" in line))
    return code, out


def test_a_raise_in_user_backward_code_is_named_by_every_other_rank():
    """A job's own loop under torchrun: an exception from the model's own backward code
    passes no zerofn hook; with ``zf.name_uncaught_errors()`` zerofn records it as it
    ends the process (sys.excepthook), and rank 0 names it and where, not just a rank gone."""
    code, out = user_loop_failure("named")
    assert code != 0
    assert "rank 1 raised ValueError: injected failure in backward in backward of step 2" \
        in out, out
    assert "zerofn: rank 1 raised this in backward of step 2" in out, out


def test_without_the_hook_a_raise_in_user_code_still_ends_every_rank():
    """By default nothing wraps sys.excepthook: rank 1's error ends its process, and rank 0
    stops too, naming rank 1 gone where it was (the job ends, no rank waits out the
    timeout)."""
    code, out = user_loop_failure()
    assert code != 0
    assert "ValueError: injected failure in backward" in out, out
    assert "rank 1 is gone: its process" in out and "backward of step 2" in out, out
    assert "rank 1 raised ValueError" not in out, out


@pytest.mark.multirank
@pytest.mark.parametrize("stage,phase", and_slow((3, "backward"), (2, "forward"), (1, "step")))
def test_a_killed_rank_is_named_gone(stage, phase):
    message, _ = reported(stage, "kill", phase)
    assert "a peer's connection closed" in message
    assert "rank 1 is gone: its process" in message and f"ended in {phase} of step " \
           f"{FAULT_STEP}" in message


@pytest.mark.multirank
def test_a_stalled_rank_is_named_after_the_timeout():
    message, _ = reported(3, "stall", "forward", timeout=4)
    assert "waited past the timeout (4 s)" in message
    assert f"rank 1 is stalled in forward of step {FAULT_STEP}" in message
    assert "zerofn train --timeout" in message


def test_timeout_option_is_checked():
    from zerofn.runtime.mesh import Groups, with_timeout
    for bad in (-1, 0, True, "5"):
        with pytest.raises(ValueError, match=f"timeout={bad!r}"):
            with_timeout(Groups(None, None, None, None, ()), bad, {})


def _timeouts(rank, world):
    """(the user's group's timeout, zerofn's, what timeout= beside a mesh of the user's
    raises) after a transform with timeout=7."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerofn.observe.failures import _group_timeout
    from zerofn.runtime import runtime_of
    model = torch.nn.Linear(8, 8)
    model, _ = zf.shard_optimizer(timeout=7)(model, torch.optim.AdamW(model.parameters()))
    mesh = init_device_mesh("cpu", (world,))
    try:
        zf.shard_optimizer(timeout=7, group=mesh)(torch.nn.Linear(8, 8))
        refused = None
    except ValueError as e:
        refused = str(e)
    return _group_timeout(None), _group_timeout(runtime_of(model).group), refused


def test_timeout_goes_on_a_group_of_zerofns_own():
    """timeout= leaves the user's group as it was made (run_ranks: 90 s) and bounds
    zerofn's own; beside a mesh of the user's it is refused on every rank, saying what to
    do instead."""
    from support.ranks import run_ranks
    for user, own, refused in run_ranks(2, _timeouts, timeout=120):
        assert (user, own) == (90.0, 7.0)
        assert refused is not None and "group or mesh of yours" in refused, refused


def _full_drive(rank, world, path):
    """One good step with NVMe offload, then steps whose swap writes fail: ENOSPC, and a
    short write (what a full drive may also give, with no error from the OS)."""
    import errno

    import zerofn.runtime.homes.nvme_file as nvme
    from support.models import make_optimizer

    real = nvme.os.pwritev
    faults = {"enospc": lambda fd, bufs, off: (_ for _ in ()).throw(
                  OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
              "short": lambda fd, bufs, off: real(fd, [bufs[0][:4096]], off)}
    out = {}
    for name, fault in faults.items():
        _, model = make_models()
        model, opt = zf.compose(zf.shard_optimizer(), zf.offload("nvme", path=path))(
            model, make_optimizer("adamw", model.parameters()))
        (x, y), = batches(1, 1, world)[0]
        model(x, y).backward()
        opt.step()
        nvme.os.pwritev = fault
        try:
            model(x, y).backward()
            opt.step()
        except OSError as e:
            out[name] = (e.errno, str(e))
        finally:
            nvme.os.pwritev = real
    return out


@pytest.mark.multirank
def test_a_full_drive_during_a_swap_write_is_named(tmp_path):
    from support.ranks import run_ranks
    got = run_ranks(1, _full_drive, str(tmp_path), timeout=120)[0]
    print("\n" + "\n".join(f"[{k}] errno {code}: {text}" for k, (code, text) in got.items()))
    for name, code in (("enospc", 28), ("short", 5)):
        errno_, text = got[name]
        assert errno_ == code and str(tmp_path) in text and "bytes of unit" in text, text
    assert "No space left on device" in got["enospc"][1]
    assert "only 4,096 bytes went through" in got["short"][1]


def _one_rank_swap_refused(rank, world, path):
    """Rank 1's swap file finds the drive full when it reserves its space (ranks sharing a
    drive: the free space each saw at the check held its own file, not both)."""
    import errno

    import zerofn.runtime.homes.nvme_file as nvme
    from support.models import make_optimizer

    real = nvme.os.posix_fallocate

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    nvme.os.posix_fallocate = full if rank == 1 else real
    try:
        _, model = make_models()
        zf.compose(zf.shard_grads(), zf.offload("nvme", path=path))(
            model, make_optimizer("adamw", model.parameters()))
        return None, os.listdir(path)
    except ValueError as e:
        return str(e), os.listdir(path)
    finally:
        nvme.os.posix_fallocate = real


@pytest.mark.multirank
def test_a_swap_file_the_drive_cannot_hold_is_refused_on_every_rank(tmp_path):
    from support.ranks import run_ranks
    for error, left in run_ranks(2, _one_rank_swap_refused, str(tmp_path), timeout=120):
        assert error is not None and "(rank 1)" in error and "No space left" in error, error
        assert "swap file" in error and str(tmp_path) in error
    assert os.listdir(tmp_path) == []       # rank 1's file removed; rank 0's once collected


@pytest.mark.multirank
def test_zerofn_train_with_a_stalled_rank_ends_and_leaves_nothing_running(tmp_path):
    """The main job under torchrun: rank 1 stalls in step 3's forward; rank 0 stops at
    --timeout with the error naming it, torchrun ends rank 1 and exits non-zero."""
    from support.jobs import run, survivors
    save_dir = str(tmp_path / "stalled")
    code, out, seconds = run(["--save-dir", save_dir, "--timeout", "5"], "stall:forward:3:1")
    print(f"\n[zerofn train, stall in forward, --timeout 5] torchrun exit {code} after "
          f"{seconds:.1f} s:\n" + "\n".join(line for line in out.splitlines()
                                           if "stopped" in line or "stalled" in line))
    assert code != 0
    assert "error: rank 0 stopped in forward of step 3" in out and \
        "waited past the timeout (5 s)" in out and "rank 1 is stalled in forward of step 3" in out
    assert not survivors(save_dir)


@pytest.mark.multirank
def test_zerofn_train_prints_a_value_error_raised_on_one_rank_only(tmp_path):
    """zerofn train prints a ValueError every rank raised once, from rank 0; one that only
    rank 1 raised is printed by rank 1, not lost. Rank 0 stops as soon as rank 1 has
    waited (3 s) for its word and closed its groups: a group kept past
    destroy_process_group (by the model, or DTensor's cache) held rank 0 until rank 1
    gave up waiting, 10 s more."""
    from support.jobs import run, survivors
    save_dir = str(tmp_path / "value")
    code, out, _ = run(["--save-dir", save_dir, "--timeout", "20"], "valueerror:forward:2:1")
    assert code != 0
    assert "error on rank 1: injected failure in forward" in out, out
    assert "error: rank 0 stopped" in out, out
    ago = re.search(r"rank 1 raised ValueError: .*, ([\d.]+) s ago", out)
    assert ago and float(ago.group(1)) < 8, out
    assert not survivors(save_dir)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["stall", pytest.param("kill", marks=pytest.mark.slow(
    reason="a killed rank in a save as well as a stalled one"))])
def test_a_rank_failing_in_a_checkpoint_save_is_named(kind):
    message, _ = reported(1, kind, "save", timeout=4)
    assert f"rank 0 stopped in checkpoint save after step {FAULT_STEP}" in message
    verdict = "is stalled in" if kind == "stall" else "is gone: its process"
    assert f"rank 1 {verdict}" in message and \
        f"checkpoint save after step {FAULT_STEP}" in message
