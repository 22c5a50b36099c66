"""Staging for background saves: the host copy of the state that DCP writes from."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ...runtime.pinned import host_buffer, pins

_ALIGN = 64          # bytes between staged tensors


class HostCopy(AsyncStager):
    """Stages a private host copy of the state, so training may go on changing it.

    Ours rather than DCP's DefaultStager, which (torch 2.13) fails with "invalid python
    storage" on a DTensor whose local piece is a view at a non-zero offset: exactly
    zerofn's shards, views into one flat buffer per unit.

    Device tensors are copied into views of one page-locked host buffer, each copy
    non-blocking, with one synchronization at the end; the buffer is kept for the next
    save (the previous save has finished by then: ``save_checkpoint`` waits for it).
    Host tensors (offloaded state) are copied as they are.
    """

    _synchronize_after_execute = False

    def __init__(self):
        self._staging: torch.Tensor | None = None
        self.keep: set = set()     # ids of the placeholders a save reads as it writes them

    def stage(self, state_dict):
        devices = [t for t in _leaves(state_dict, self.keep) if t.device.type != "cpu"]
        if not devices:
            return _host_copy(state_dict, iter(()), self.keep)
        staged = _host_copy(state_dict, self._views(devices), self.keep)
        torch.cuda.current_stream(devices[0].device).synchronize()   # once, for every copy
        return staged

    def _views(self, tensors):
        """One page-locked view per device tensor, in order, of a kept staging buffer."""
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if self._staging is None or self._staging.numel() < total:
            self._staging = None     # let the old one go before pinning a new one
            self._staging = host_buffer(total, torch.uint8, pins(tensors[0].device))
        for t, start in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            yield self._staging[start:start + nbytes].view(t.dtype).view(t.shape)


def _leaves(obj, keep: set):
    """The plain tensors in a state dict, DTensors' local pieces in their place, but for
    the placeholders ``keep`` names."""
    if id(obj) in keep:
        return
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v, keep)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v, keep)


def _host_copy(obj, device_views, keep: set):
    """``obj`` with every tensor copied to the host (device tensors into the next of
    ``device_views``, non-blocking; host tensors into new memory), the placeholders
    ``keep`` names as they are."""
    if id(obj) in keep:
        return obj
    if isinstance(obj, DTensor):
        return DTensor(_host_copy(obj.to_local(), device_views, keep), obj._spec,
                       requires_grad=False)
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return torch.empty_like(obj, device="cpu").copy_(obj)
        return next(device_views).copy_(obj, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v, device_views, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, device_views, keep) for v in obj)
    return obj
