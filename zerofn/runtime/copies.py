"""Copies between the device and host buffers of offload, ordered per unit.

[Note: copy streams] On CUDA, gradient shards go device to host on one side stream and
updated parameter rows host to device on another, so both overlap compute. Every copy
belongs to a unit; one event per unit and direction, created once, marks where that
unit's latest copy ends. Five waits order everything else against those events:

- ``host_wait``: the host is about to read what ``to_host`` wrote (blocks the host).
- ``device_wait``: device work is about to read what ``to_device`` wrote (the current
  stream waits; the host goes on).
- ``before_host_write``: the host is about to rewrite ``to_device``'s source (blocks the
  host).
- ``before_device_write``: device work is about to rewrite ``to_host``'s source (a
  reduction adding into a gradient shard under accumulation): the current stream waits
  for the copy to have read it; the host goes on.
- ``after_to_device``: a collective about to read what ``to_device`` wrote (ZeRO-3's
  gather of an offloaded shard) is issued on the copy's own stream, so it follows the copy
  while the current stream, computing the unit before, is not held up.

The events are blocking: a host waiting on one sleeps instead of spinning a core.

A copy itself first waits for the work already queued on the current stream, which
produced (or still reads) what it touches. Non-blocking copies overlap only from pinned
host memory: offload's arenas are pinned where CUDA exists (homes/host.py).

Without CUDA the same calls run: copies are synchronous ``copy_``s and waits do nothing.
Copies between tensors on the same device are always plain ``copy_``s in stream order.
"""
from __future__ import annotations

import contextlib

import torch

from .timing import NOTHING, UNTIMED


class CopyStreams:
    """The copy streams and per-unit events of one runtime (see the module note); they
    live as long as the runtime.

    Args:
        offloaded: copies cross between host and device, and are labelled and timed as
            d2h and h2d; without offload the same calls cast on the device.
        timing: labels and (under a monitor) times the copies.
    """

    def __init__(self, device: torch.device, units, offloaded: bool = False, timing=UNTIMED):
        self.device, self.offloaded, self.timing = device, offloaded, timing
        if not self.streaming:
            return
        self._streams = {d: torch.cuda.Stream(device) for d in ("d2h", "h2d")}
        self._done = {d: {u: torch.cuda.Event(blocking=True) for u in units}
                      for d in ("d2h", "h2d")}
        self._fence = torch.cuda.Event()      # reused: recorded and waited back to back

    @property
    def streaming(self) -> bool:
        return self.device.type == "cuda"

    def to_host(self, unit, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying ``src`` (the unit's device shard) into the host buffer ``dst``."""
        self._copy("d2h", unit, dst, src)

    def to_device(self, unit, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying the host rows ``src`` into ``dst`` (on the device, or on the host
        under parameter offload, where it is a plain copy)."""
        self._copy("h2d", unit, dst, src)

    def _copy(self, direction: str, unit, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.streaming or dst.device == src.device:
            with self._span(direction, unit):
                dst.copy_(src)
            return
        stream = self._streams[direction]
        self._fence.record(torch.cuda.current_stream(self.device))
        stream.wait_event(self._fence)
        with torch.cuda.stream(stream), self._span(direction, unit):
            dst.copy_(src, non_blocking=True)
        # The caching allocator must not hand the device block to other work before this
        # stream is done with it, should its tensor be freed meanwhile.
        (src if src.is_cuda else dst).record_stream(stream)
        self._done[direction][unit].record(stream)

    def _span(self, direction: str, unit):
        return self.timing.span(direction, direction, unit.name) if self.offloaded else NOTHING

    def host_wait(self, unit) -> None:
        if self.streaming:
            self._done["d2h"][unit].synchronize()

    def device_wait(self, unit) -> None:
        if self.streaming:
            torch.cuda.current_stream(self.device).wait_event(self._done["h2d"][unit])

    def before_host_write(self, unit) -> None:
        if self.streaming:
            self._done["h2d"][unit].synchronize()

    def before_device_write(self, unit) -> None:
        # (an event never recorded is no wait: the unit has not been copied yet)
        if self.streaming:
            torch.cuda.current_stream(self.device).wait_event(self._done["d2h"][unit])

    @contextlib.contextmanager
    def after_to_device(self, unit):
        """Device work issued inside reads what the unit's latest ``to_device`` wrote."""
        if not self.streaming:
            self.device_wait(unit)
            yield
            return
        with torch.cuda.stream(self._streams["h2d"]):
            yield
