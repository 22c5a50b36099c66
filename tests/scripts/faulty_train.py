"""``zerofn train`` with one injected failure, for the failure and elastic-restart tests.

    ZEROFN_TEST_FAULT=KIND:PHASE:STEP:RANK python -m torch.distributed.run ... \\
        tests/scripts/faulty_train.py [zerofn train's flags]

KIND is raise (RuntimeError), valueerror, kill (SIGKILL) or stall; PHASE is forward, backward, step or save (kill
only: right after the rank handed its checkpoint to the background writer, so the save is
cut off mid-write); STEP counts optimizer steps from 1. The fault fires on the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted job runs clean.
"""
from __future__ import annotations

import os
import signal
import time

import zerofn.train as train
from zerofn.train import loop


def inject(kind: str, phase: str, step: int) -> None:
    def fail():
        if kind == "raise":
            raise RuntimeError(f"injected failure in {phase}")
        if kind == "valueerror":   # what zerofn train reports as a bad-input error
            raise ValueError(f"injected failure in {phase}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    done = {"steps": 0}     # optimizer steps finished in this process
    build, save = loop.build, loop.save       # as the job's loop calls them

    def at(name):
        return lambda *_: fail() if phase == name and done["steps"] + 1 == step else None

    def faulty_build(job, seed):
        model, opt, sched = build(job, seed)
        model.blocks[0].register_forward_pre_hook(at("forward"))
        model.blocks[0].register_full_backward_hook(at("backward"))
        opt.register_step_pre_hook(at("step"))
        opt.register_step_post_hook(lambda *_: done.__setitem__("steps", done["steps"] + 1))
        return model, opt, sched

    def faulty_save(args, model, opt, sched, data, at_step, tp):
        save(args, model, opt, sched, data, at_step, tp)
        if phase == "save" and at_step == step:
            fail()

    loop.build, loop.save = faulty_build, faulty_save


if __name__ == "__main__":
    fault = os.environ.get("ZEROFN_TEST_FAULT")
    if fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kind, phase, step, rank = fault.split(":")
        if os.environ["RANK"] == rank:
            inject(kind, phase, int(step))
    train.main()
