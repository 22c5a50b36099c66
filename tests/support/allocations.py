"""The bytes a piece of code allocates, at their peak, counted from the storages torch's ops
make while it runs (a CPU keeps no allocator statistics of its own)."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Allocations(TorchDispatchMode):
    """Each new storage an op returns counts from then until its tensor (the view's base)
    is freed; ``peak`` is the most live at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if not torch.is_tensor(t):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self.seen or key in given:    # (an in-place op's result)
                continue
            self.seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t if t._base is None else t._base, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)
