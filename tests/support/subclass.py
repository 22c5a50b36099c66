"""A tensor subclass of the kind float8 and NF4 weights are: a ``__torch_dispatch__``
wrapper whose values live in an inner tensor (``inner``), without FSDP2's all-gather
hooks. zerofn refuses such a parameter (core/units.py, ``_refuse_subclass``)."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class Wrapped(torch.Tensor):
    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(tensors, meta, *_):
        return Wrapped(tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t     # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        # nn.Parameter needs detach() to keep the type.
        return Wrapped(out) if func is torch.ops.aten.detach.default else out
