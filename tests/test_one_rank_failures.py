"""A problem one rank alone finds ends every rank at once, with one error naming that rank
and the check: no rank is left waiting in the next collective until the timeout.

The checks are found from the code: every place zerofn exchanges what the ranks found
(a call of runtime/agree.py's helpers, or of torch's object collectives, outside
agree.py). Each is listed in SITES with a scenario that reaches it through the public
API and what a problem on one rank looks like there; the problem is injected on rank 1 of
2 and rank 3 of 4 (rank 0 where the check is rank 0's read, told to the others), into
what that rank sends. A place not listed fails ``test_every_check_site_is_listed``. The
front doors (DeepSpeed's ``initialize``, Lightning's Fabric) reach the same sites through
their own set-up and checkpoints, and are injected the same way (FRONT_DOORS).

A raise on one rank outside these exchanges ends that rank's process, and the others' next
collective fails at once naming it gone: ``test_failures.py`` injects such raises in the
forward, backward, step and a save, in a user's loop and in ``zerofn train``.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import pathlib
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerofn as zf
import zerofn.deepspeed as deepspeed
from support.loops import zero
from support.ranks import run_ranks
from zerofn.planner.probe import Machine
from zerofn.state_dict import get_model_state_dict, set_model_state_dict
from zerofn.train.args import parse_args
from zerofn.train.job import resolve

pytestmark = pytest.mark.multirank

PACKAGE = pathlib.Path(zf.__file__).parent
HELPERS = {"agree_or_raise", "gather", "from_first"}
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list"}
PROBLEM = "injected problem"


def check_sites() -> dict[str, tuple[str, str, int]]:
    """``{"path:function:n": (path, function, line)}``: the n-th exchange of the ranks'
    findings in that function, for every function of the package."""
    sites = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "runtime/agree.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call) and (
                isinstance(n.func, ast.Name) and n.func.id in HELPERS or
                isinstance(n.func, ast.Attribute) and n.func.attr in OBJECT_COLLECTIVES)),
                key=lambda n: n.lineno)
            for i, call in enumerate(calls, 1):
                sites[f"{rel}:{fn.name}:{i}"] = (rel, fn.name, call.lineno)
    return sites


# -- what a problem on one rank looks like in what it sends ---------------------------------
def add_problem(problems):
    return [*problems, PROBLEM]


INJECT = {
    "problems": add_problem,                                       # a list of problems
    "set-up": lambda o: (o[0], add_problem(o[1]), *o[2:]),         # (digest, problems, ...)
    "optimizer": lambda o: (add_problem(o[0]), o[1]),              # (problems, signature)
    "save step": lambda o: (o[0] + 1, o[1]),                       # (step, extras' hashes)
    "directory": lambda o: (None, *o[1:]),                         # (rank 0's token seen, ...)
    "rank 0's read": lambda o: ValueError(PROBLEM),
    "rank 0's write": lambda o: PROBLEM,
    "rank 0's plan": lambda o: (None, PROBLEM),                    # (choice, why none)
    "tag": lambda o: (o[0] + "-elsewhere", o[1]),                  # (tag, client_state)
}


# -- the scenarios: each reaches its sites through the public API ---------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def built(stage=2, *extra, optimizer=True, **options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zf.compose(zero(stage, **options), *extra)(model, opt) if optimizer else \
        (zf.compose(zero(stage, **options), *extra)(model), None)


def stepped(model, opt, rank, scale=1.0):
    torch.manual_seed(rank)
    (model(torch.randn(4, 8)) * scale).backward()
    opt.step()
    return model, opt


def set_up(tmp, rank):
    built()


def homes(tmp, rank):
    built(2, zf.offload("cpu"))


def meta(tmp, rank):
    with torch.device("meta"):
        model = Net()
    init = lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None  # noqa: E731
    zero(3, init=init)(model, torch.optim.AdamW(model.parameters()))


def bind(tmp, rank):
    model, _ = built(optimizer=False)
    stepped(model, torch.optim.AdamW(model.parameters()), rank)


def save(tmp, rank):
    zf.save_checkpoint(tmp, *stepped(*built(), rank), step=1)


def load(tmp, rank):
    model, opt = stepped(*built(), rank)
    with injecting_nowhere():
        zf.save_checkpoint(tmp, model, opt, step=1)
    zf.load_checkpoint(tmp, model, opt)


def state_dict(tmp, rank):
    model, _ = built()
    set_model_state_dict(model, get_model_state_dict(model))


def save_pretrained(tmp, rank):
    zf.save_pretrained(built()[0], tmp)


def load_pretrained(tmp, rank):
    model, _ = built()
    with injecting_nowhere():
        zf.save_pretrained(model, tmp)
    zf.load_pretrained(model, tmp)


def nonfinite(tmp, rank):
    """No injection: the failing rank's loop puts nan into its own rows of a gradient."""
    model, opt = built(2, on_nonfinite="raise")
    torch.manual_seed(rank)
    model(torch.randn(4, 8)).backward()
    if rank == FAILING[0]:
        model.a.weight.grad.to_local().fill_(float("nan"))
    opt.step()


def plan_auto(tmp, rank):
    """``zerofn train --plan auto``'s set-up: rank 0 plans, every rank takes its choice."""
    os.makedirs(tmp, exist_ok=True)
    probe = os.path.join(tmp, f"probe{rank}.json")
    with open(probe, "w") as f:
        json.dump(MACHINE.to_json(), f)
    args = parse_args(["--model", "tiny", "--context", "16", "--batch", "4", "--steps", "1",
                       "--plan", "auto", "--probe", probe])
    resolve(args, torch.device("cpu"))


def engine(config_stage=2):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return deepspeed.initialize(model=Net(), config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": config_stage}}, dist_init_required=False)[0]


def deepspeed_save(tmp, rank):
    engine().save_checkpoint(tmp, tag="t")


def deepspeed_load(tmp, rank):
    model = engine()
    with injecting_nowhere():
        model.save_checkpoint(tmp, tag="t")
    model.load_checkpoint(tmp)


def fabric(rank, world):
    """Lightning's Fabric on zerofn over the ranks' own process group, as a job that
    torchrun started finds it (Lightning initializes nothing already initialized)."""
    from lightning.fabric import Fabric

    from zerofn.integrations.lightning import ZeroFabricStrategy
    os.environ.update(TORCHELASTIC_RUN_ID="harness", RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=ZeroFabricStrategy(stage=2))
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    return fabric, *fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def fabric_set_up(tmp, rank):
    fabric(rank, dist.get_world_size())


def fabric_load(tmp, rank):
    lightning, model, opt = fabric(rank, dist.get_world_size())
    path = os.path.join(tmp, "fabric")
    with injecting_nowhere():
        lightning.save(path, {"model": model, "optimizer": opt})
    lightning.load(path, {"model": model, "optimizer": opt})


def deepspeed_set_up(tmp, rank):
    engine()


# site: (scenario, injection or None where the scenario fails on its own, whose rank:
# "one" (the failing rank) or 0 (rank 0's read), what the error names)
SITES = {
    "runtime/runtime.py:_agree_across_ranks:1": (set_up, "set-up", "one", "set-up failed"),
    "runtime/runtime.py:_make_homes:1": (homes, "problems", "one", "set-up failed"),
    "runtime/shards.py:_materialize:1": (meta, "problems", "one", "meta-built model"),
    "runtime/runtime.py:bind:1": (bind, "optimizer", "one", "cannot step this model"),
    "runtime/step_grads.py:_raise_nonfinite:1": (nonfinite, None, "one", "on_nonfinite='raise'"),
    "io/checkpoint/verify.py:agree_on_save:1": (save, "save step", "one", "save_checkpoint"),
    "io/checkpoint/verify.py:agree_on_directory:1": (save, "directory", "one",
                                                     "cannot see the directory"),
    "io/checkpoint/verify.py:resolve_on_rank0:1": (load, "rank 0's read", 0, "load_checkpoint"),
    "io/checkpoint/verify.py:agree_on_load:1": (load, "problems", "one", "Cannot load checkpoint"),
    "state/state_dict.py:set_model_state_dict:1": (state_dict, "problems", "one",
                                                   "state dict does not fit"),
    "io/pretrained/save.py:save_pretrained:1": (save_pretrained, "problems", 0,
                                                "save_pretrained"),
    "io/pretrained/save.py:save_pretrained:2": (save_pretrained, "rank 0's write", 0,
                                                "save_pretrained"),
    "io/pretrained/load.py:load_pretrained:1": (load_pretrained, "problems", "one",
                                                "load_pretrained"),
    "io/pretrained/load.py:load_pretrained:2": (load_pretrained, "problems", "one",
                                                "load_pretrained"),
    "train/planned.py:planned:1": (plan_auto, "rank 0's plan", 0, "--plan auto"),
    "deepspeed/engine_checkpoint.py:_agree_on_tag:1": (deepspeed_save, "tag", "one",
                                                       "save_checkpoint"),
    "deepspeed/engine_checkpoint.py:_checkpoint_dir:1": (deepspeed_load, "rank 0's read", 0,
                                                         "load_checkpoint"),
}
# The front doors, each through one or two of the sites above: (site, scenario, injection,
# whose rank, what the error names).
FRONT_DOORS = {
    "deepspeed: initialize": ("runtime/runtime.py:_agree_across_ranks:1", deepspeed_set_up,
                              "set-up", "one", "set-up failed"),
    "lightning: Fabric.setup": ("runtime/runtime.py:_agree_across_ranks:1", fabric_set_up,
                                "set-up", "one", "set-up failed"),
    "lightning: Fabric.load": ("io/checkpoint/verify.py:agree_on_load:1", fabric_load,
                               "problems", "one", "Cannot load checkpoint"),
}
if importlib.util.find_spec("lightning") is None:   # (set-up installs it; offline may not)
    FRONT_DOORS = {k: v for k, v in FRONT_DOORS.items() if not k.startswith("lightning")}

# Exchanges this harness does not reach yet, and why (each still agrees by construction).
NOT_REACHED = {
    "runtime/owned.py:spread_out:1": "each owner's description of its whole-tensor state, "
                                     "spread to every rank for a state dict: data, no "
                                     "finding (tests/test_owned_optimizers.py saves it)",
    "runtime/runtime.py:group_names:1": "under groups=, every rank's expert names for a "
                                        "checkpoint's param groups: names, no finding to "
                                        "agree on (tests/test_experts.py saves them)",
}

# a stand-in machine for --plan auto (probing this one would take seconds and vary)
MACHINE = Machine(device="a stand-in", matmul={"fp32": 1e11}, memory_bw=1e10,
                  cpu_adam={"fp32": 2e8}, disk_read=1e9, disk_write=5e8,
                  collectives={str(w): {"latency_s": 1e-4, "bus_bw": 1e9} for w in (2, 4)},
                  process={"base": 3e8, "overhead": 0.05}, free={})

FAILING = [1]     # the rank a scenario's own failure is on (nonfinite), set per world


# -- injection --------------------------------------------------------------------------------
_target: dict = {}


@contextlib.contextmanager
def injecting_nowhere():
    """A scenario's preparation (a save before the load under test) runs uninjected."""
    saved = dict(_target)
    _target.clear()
    try:
        yield
    finally:
        _target.update(saved)


def _at_target() -> bool:
    path, function, line = _target["where"]
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == function and code.co_filename.endswith(path) and f.f_lineno == line:
            return True
        f = f.f_back
    return False


def _install() -> None:
    gather_real, broadcast_real = dist.all_gather_object, dist.broadcast_object_list

    def all_gather_object(object_list, obj, *args, **kwargs):
        if _target and dist.get_rank() == _target["rank"] and _at_target():
            obj = _target["inject"](obj)
            _target["hits"] += 1
        return gather_real(object_list, obj, *args, **kwargs)

    def broadcast_object_list(object_list, *args, **kwargs):
        if _target and dist.get_rank() == _target["rank"] and _at_target():
            object_list[0] = _target["inject"](object_list[0])
            _target["hits"] += 1
        return broadcast_real(object_list, *args, **kwargs)

    dist.all_gather_object, dist.broadcast_object_list = all_gather_object, broadcast_object_list


def cases() -> dict:
    """``{case: (where, scenario, injection, whose, names)}``: every listed site, then each
    front door."""
    sites = check_sites()
    out = {key: (sites[key], *SITES[key]) for key in SITES if key in sites}
    out.update({door: (sites[site], *rest) for door, (site, *rest) in FRONT_DOORS.items()})
    return out


def injected_runs(rank, world, tmp, runs):
    """For each case: the error this rank raised (type, message), when it ended (the
    wall clock, which the ranks of one machine share), and how often the injection fired
    here, on which rank."""
    _install()
    failing = world - 1
    FAILING[0] = failing
    out = {}
    for key, (where, scenario, inject, whose, _) in runs.items():
        target_rank = failing if whose == "one" else 0
        _target.clear()
        if inject is not None:
            _target.update(where=where, rank=target_rank, inject=INJECT[inject], hits=0)
        directory = os.path.join(tmp, f"w{world}", "".join(c if c.isalnum() else "_"
                                                           for c in key))
        dist.barrier()
        try:
            scenario(directory, rank)
            error = None
        except Exception as e:
            error = (type(e).__name__, str(e))
        out[key] = (error, time.time(), _target.get("hits", 0), target_rank)
    _target.clear()
    return out


def test_every_check_site_is_listed():
    """A new place the ranks exchange findings needs a scenario here (or a reason in
    NOT_REACHED)."""
    found = set(check_sites())
    listed = set(SITES) | set(NOT_REACHED)
    assert found - listed == set(), f"check sites the harness does not cover: {found - listed}"
    assert listed - found == set(), f"listed sites gone from the code: {listed - found}"


@pytest.mark.parametrize("world", [2, 4])
def test_a_problem_on_one_rank_stops_every_rank_naming_it(world, tmp_path):
    runs = cases()
    results = run_ranks(world, injected_runs, str(tmp_path), runs, timeout=600)
    table = []
    for key, (_, _, inject, _, names) in runs.items():
        seen = [r[key] for r in results]
        target_rank = seen[0][3]
        if inject is not None:
            assert seen[target_rank][2] == 1, (key, "the injection did not fire once")
        for rank, (error, _, _, _) in enumerate(seen):
            assert error is not None, (key, world, rank, "no error")
            assert f"rank {target_rank}" in error[1] and names in error[1], (key, rank, error)
        ends = [end for _, end, _, _ in seen]
        # every rank ended, within this of the first (a hang would wait for the timeout)
        assert max(ends) - min(ends) < 10, (key, ends)
        table.append(f"{key:50} rank {target_rank}  {max(ends) - min(ends):5.2f} s  "
                     f"{seen[0][0][0]}: {seen[0][0][1][:90]}")
    print(f"\nworld {world}:\n" + "\n".join(table))
