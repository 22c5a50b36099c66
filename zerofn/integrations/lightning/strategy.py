"""What both strategies do alike, as plain functions of the strategy: ``ZeroStrategy``
(trainer.py, Lightning's ``Trainer``) and ``ZeroFabricStrategy`` (fabric.py, ``Fabric``)
derive from different base classes and name their precision plugin differently
(``precision_plugin``, ``precision``), so each passes what differs."""
from __future__ import annotations

import os

import zerofn as zf

from ...runtime import is_transformed
from . import checkpoints as ckpt
from .options import REGISTERED, refuse
from .precision import zero_precision


def checked_precision(strategy, plugin, kind):
    """Lightning's plugin for the precision flag as zerofn trains it (a ``kind``), its
    problems with the strategy's options raised here, at construction: before any process
    starts."""
    zero = zero_precision(plugin, kind)
    if plugin is not None:     # (None: the default, until Lightning sets the flag's)
        refuse(strategy.zero.precision_problems(zero.precision))
    return zero


def mesh_group(strategy):
    """The group ``device_mesh=`` asks for, once the process group is up; None: the world."""
    if strategy.zero.device_mesh is None:
        return None
    return strategy.zero.mesh(strategy.root_device, strategy.world_size)


def refuse_optimizers(count: int, where: str) -> None:
    """One optimizer per model: zerofn shards them together."""
    if count != 1:
        refuse([f"{where} {count} optimizers: zerofn shards a model together with its one "
                "optimizer"])


def save_path(strategy, path) -> tuple[str, bool]:
    """``(path, sharded)``: rank 0's path, which every rank saves to, and whether the save
    is zerofn's sharded checkpoint; what the other kind left there is gone (rank 0)."""
    path = os.fspath(strategy.broadcast(path))
    sharded = strategy.zero.state_dict_type == "sharded"
    if strategy.is_global_zero:
        ckpt.clear_other_kind(path, sharded)
    return path, sharded


def load(strategy, path, module, optimizer, extra: str, split, weights_only=None) -> dict:
    """Load rank 0's ``path`` into ``module`` (and ``optimizer``, unless None): zerofn's
    sharded checkpoint (a directory), whose ``extra`` entries it returns, or one full file,
    of which ``split(entries)`` pops ``(model state, optimizer state or None)``; it returns
    the rest."""
    path = os.fspath(strategy.broadcast(path))
    if os.path.isdir(path):
        return ckpt.load_sharded(path, module, optimizer, extra)
    entries = strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    ckpt.load_full(module, optimizer, *split(entries), strategy._names)
    return entries


def tear_down(strategy, module, precision) -> None:
    """The model stays sharded on its devices (no move to the CPU); zerofn's TensorBoard
    files are flushed, then the strategy's plugins torn down."""
    if is_transformed(module) and strategy.zero.tensorboard:
        zf.flush_logs(module)
    strategy.cluster_environment.teardown()
    precision.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


def register(cls, registry) -> None:
    """``cls`` under each ``zerofn_stage_*`` name in one of Lightning's registries."""
    for name, (description, options) in REGISTERED.items():
        registry.register(name, cls, description=f"zerofn {description}", override=True,
                          **options)
