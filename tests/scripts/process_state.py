"""What zerofn changes process-wide, for tests/test_process_unchanged.py: imports every zerofn
module and applies transforms (ZeRO-3 with CPU offload, ZeRO-2 with NVMe offload, ZeRO-1
with ``timeout=``; a step each) in a one-rank gloo group the script made with its own timeout, then makes
each process-wide change on purpose, one at a time. Prints one JSON line: which of the
watched things changed after the transforms, and after each change made on purpose.

    python tests/scripts/process_state.py
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import importlib
import json
import os
import pkgutil
import sys
import tempfile

import torch
import torch._dynamo  # noqa: F401  (torch's own exit handlers: registered at its first use)
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

USER_TIMEOUT = 1234.0     # seconds: the user's group's
MALLOPT_CALLS = []        # (param, value) of every mallopt called through ctypes
ZEROFN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "zerofn")     # (this script is tests/scripts/process_state.py)
REGISTER = atexit.register
FOREIGN_EXIT_HANDLERS = [0]   # registered from outside zerofn: the libraries it imports


def register_counted(function, *args, **kwargs):
    """``atexit.register``, counting the handlers registered by code outside zerofn
    (matplotlib, filelock, huggingface_hub register theirs as zerofn's modules import
    them), so that the count left is zerofn's own."""
    if not sys._getframe(1).f_code.co_filename.startswith(ZEROFN + os.sep):
        FOREIGN_EXIT_HANDLERS[0] += 1
    return REGISTER(function, *args, **kwargs)


class SpyLibrary(ctypes.CDLL):
    """A ctypes library whose ``mallopt`` is recorded before it is called."""

    def __getattr__(self, name):
        function = super().__getattr__(name)
        if name != "mallopt":
            return function

        def recorded(*args):
            MALLOPT_CALLS.append(args)
            return function(*args)
        return recorded


def lightning_names() -> list[str]:
    """The names in Lightning's Trainer and Fabric strategy registries (none without it)."""
    try:
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:
        return []
    return sorted(StrategyRegistry) + sorted(STRATEGY_REGISTRY)


def group_timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def state() -> dict:
    return {"excepthook": id(sys.excepthook),
            "atexit": atexit._ncallbacks() - FOREIGN_EXIT_HANDLERS[0],
            "user group timeout": group_timeout(dist.group.WORLD),
            "mallopt": len(MALLOPT_CALLS), "lightning": lightning_names()}


def changed(before: dict, after: dict) -> list[str]:
    return [key for key in before if before[key] != after[key]]


def large_frees_returned() -> bool:
    """Whether a 16 MiB block freed after a 24 MiB one goes back to the OS: glibc's moving
    threshold (the process's own) rose to 24 MiB and keeps it in the heap; a threshold
    fixed at 16 MiB or less (``mallopt`` by any route, ctypes or C++) maps and returns it
    (tests/test_host_malloc.py shows it does, after ``zf.return_large_frees()``). Once:
    what it frees into the heap would serve a second probe's blocks."""
    from support.memory import large_free_returned_mib   # (after the spies are in place)
    return large_free_returned_mib() > 15


def import_everything() -> None:
    import zerofn
    for module in pkgutil.walk_packages(zerofn.__path__, "zerofn."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def apply_transforms(swap_dir: str) -> None:
    import zerofn as zf
    torch.manual_seed(0)
    for transform in (zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                 zf.offload("cpu")),
                      zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                                 zf.offload("nvme", path=swap_dir)),
                      zf.shard_optimizer(timeout=60)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        model, opt = transform(model, torch.optim.AdamW(model.parameters()))
        model(torch.randn(4, 64)).sum().backward()
        opt.step()


def main() -> None:
    ctypes.CDLL, atexit.register = SpyLibrary, register_counted
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=USER_TIMEOUT))
    before = state()
    import_everything()
    with tempfile.TemporaryDirectory() as swap_dir:
        apply_transforms(swap_dir)
    report = {"after transforms": changed(before, state()), "lightning installed":
              bool(lightning_names())}
    if large_frees_returned():
        report["after transforms"].append("large frees returned")

    import zerofn as zf
    from zerofn.io.checkpoint.api import background
    plants = {"name_uncaught_errors": zf.name_uncaught_errors,
              "background": background,      # the async saver, its exit wait
              "_set_pg_timeout": lambda: c10d._set_pg_timeout(datetime.timedelta(seconds=77),
                                                              dist.group.WORLD),
              "return_large_frees": zf.return_large_frees,
              "finish_collectives_at_exit": zf.finish_collectives_at_exit}
    if report["lightning installed"]:
        from zerofn.integrations.lightning import register_strategies
        plants["register_strategies"] = register_strategies
    for name, plant in plants.items():
        before = state()
        plant()
        report[name] = changed(before, state())
    dist.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
