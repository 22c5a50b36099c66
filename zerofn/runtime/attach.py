"""How a runtime sits on its model: in the model's ``_zerofn`` attribute, with the model's
class swapped for one that mixes in ``ZeroModule`` (as FSDP2's ``fully_shard`` swaps in
``FSDPModule``), and swapped back by ``detach``: the model keeps its identity, and no
method is shadowed on the instance."""
from __future__ import annotations

import contextlib

from torch import nn

from .view import RuntimeView

ATTR = "_zerofn"
_swapped: dict[type, type] = {}     # the user's class -> its ZeroModule subclass
_original: dict[type, type] = {}    # and back


class ZeroModule:
    """What a transformed model adds to its class: DDP's ``no_sync``, and a ``zero_grad``
    that clears the reduced gradient shards as ``optimizer.zero_grad()`` does."""

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction in backward, like DDP's ``no_sync``: gradients
        accumulate locally and are reduced by the first backward outside the context."""
        with runtime_of(self).no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Torch's own would leave the reduced shards for the next backward to add to."""
        super().zero_grad(set_to_none)
        runtime_of(self).zero_grad()


def runtime_of(model: nn.Module) -> RuntimeView:
    """The runtime a zerofn transform put on ``model`` (or on the module a
    ``torch.compile`` wrapper holds), as ``RuntimeView`` shows it; a clear error where none
    did."""
    rt = unwrap(model).__dict__.get(ATTR) if isinstance(model, nn.Module) else None
    if rt is None:
        raise ValueError("This model has not been transformed by zerofn; apply e.g. "
                         "zerofn.shard_optimizer() to it first (model = transform(model), or "
                         "model, opt = transform(model, opt)).")
    return rt


def is_transformed(model: nn.Module) -> bool:
    """Whether a zerofn transform put a runtime on ``model`` (or the module it compiles)."""
    return isinstance(model, nn.Module) and ATTR in unwrap(model).__dict__


def unwrap(model):
    """The module a ``torch.compile`` wrapper holds (``_orig_mod``), else ``model``: zerofn
    keeps its runtime on the module itself, so it takes the model compiled or not."""
    inner = model.__dict__.get("_modules", {}).get("_orig_mod") \
        if type(model).__name__ == "OptimizedModule" else None
    return inner if inner is not None else model


def attach(model: nn.Module, runtime) -> None:
    model.__dict__[ATTR] = runtime
    cls = type(model)
    if cls not in _swapped:
        # Named as the user's class: what transformers writes into a saved config's
        # "architectures", and what a model's repr shows.
        _swapped[cls] = type(cls.__name__, (ZeroModule, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _original[_swapped[cls]] = cls
    model.__class__ = _swapped[cls]


def detach(model: nn.Module) -> None:
    """The exact inverse of ``attach``."""
    del model.__dict__[ATTR]
    model.__class__ = _original[type(model)]
