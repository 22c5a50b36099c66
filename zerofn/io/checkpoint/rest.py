"""The rest of an epoch: what a ``DistributedSampler`` has yet to give when a run resumes
part way through one, dealt over the ranks that read it now.

[Note: the epoch's global order] torch's ``DistributedSampler`` (and torchdata's
``StatefulDistributedSampler``, which only skips what it yielded before) draws one order of
the dataset's rows for an epoch, from ``seed + epoch``, whatever the world. For world W it
pads that order from its start to a multiple of W (or, with ``drop_last``, cuts it to
one), and rank r reads entries r, r + W, r + 2W, ... of it. So when every rank has read c
rows, entries 0 to c*W - 1 of the epoch's order have been read, and nothing else: that
number, ``read``, with the epoch, is the data's place, and it means the same at any world.
Resumed at W', the rest (the order from ``read`` on) is padded or cut to a multiple of W'
as the sampler treats a whole epoch, and rank r' reads entries r', r' + W', ... of it. Every
row of the epoch is then read once, besides the padding the sampler adds itself where the
rows do not split evenly over the world (rows from the epoch's start, read twice) or the
tail ``drop_last`` leaves unread. With ``read`` 0 the rest is the sampler's own epoch, so at
the world that saved it the rest is what the sampler would have gone on to give.
"""
from __future__ import annotations

import math
import sys

from torch.utils.data import DistributedSampler, Sampler

from .extras import is_stateful

# The samplers whose order the note above describes; a subclass may deal rows otherwise.
KNOWN = ("torch.utils.data.distributed.DistributedSampler",
         "torchdata.stateful_dataloader.sampler.StatefulDistributedSampler")


def class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def epoch_order(rows: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of ``rows`` rows as torch's ``DistributedSampler`` draws it (its own
    code, at world 1, where it pads nothing)."""
    sampler = DistributedSampler(range(rows), num_replicas=1, rank=0, shuffle=shuffle,
                                 seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def arranged(order: list[int], read: int, world: int, drop_last: bool) -> list[int]:
    """``order`` from entry ``read`` on, cut (``drop_last``) or padded from the order's
    start to a multiple of ``world``, as ``DistributedSampler`` arranges a whole epoch."""
    rest = order[read:]
    if drop_last:
        return rest[:len(rest) // world * world]
    pad = -len(rest) % world
    return rest + (order * math.ceil(pad / max(len(order), 1)))[:pad]


def stateful_loader(obj) -> bool:
    """Whether ``obj`` is torchdata's ``StatefulDataLoader`` (none is, where torchdata was
    never imported)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    return module is not None and isinstance(obj, module.StatefulDataLoader)


def sampler_of(loader) -> DistributedSampler | None:
    """The ``DistributedSampler`` a data loader's batches are drawn from (through the rest
    placed in it, if any), or None."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, EpochRest):
        sampler = sampler.sampler
    return sampler if isinstance(sampler, DistributedSampler) else None


class EpochRest(Sampler):
    """Stands in a loader's batch sampler for its ``DistributedSampler``: while the sampler
    is at ``epoch`` and the rest has not been given to its end, a pass yields this rank's
    share of the rest of that epoch from entry ``read`` of its order (the note above);
    every pass after is the sampler's own."""

    def __init__(self, sampler: DistributedSampler, epoch: int, read: int):
        self.sampler, self.epoch, self.read = sampler, epoch, read
        self.serving = False    # the latest pass begun is the rest
        self.done = False       # the rest was given to its end, or the epoch moved on
        self._mine: list[int] | None = None

    def indices(self) -> list[int]:
        """This rank's share of the rest."""
        if self._mine is None:
            s = self.sampler
            order = epoch_order(len(s.dataset), s.seed, self.epoch, s.shuffle)
            self._mine = arranged(order, self.read, s.num_replicas,
                                  s.drop_last)[s.rank::s.num_replicas]
        return self._mine

    def active(self) -> bool:
        """Whether the loader's pass under way, or else its next, is the rest."""
        return self.serving or (not self.done and self.sampler.epoch == self.epoch)

    def __iter__(self):
        # A loader may begin a pass more than once (torch's iterator with workers calls
        # iter twice): every pass is the rest until one has given it to its end.
        self.serving = not self.done and self.sampler.epoch == self.epoch
        self.done = not self.serving
        return self._rest() if self.serving else iter(self.sampler)

    def _rest(self):
        yield from self.indices()
        self.done = True

    def __len__(self) -> int:
        return len(self.indices()) if self.active() else len(self.sampler)


class StatefulEpochRest(EpochRest):
    """``EpochRest`` for a sampler with a state of its own (torchdata's
    ``StatefulDistributedSampler``): a ``StatefulDataLoader`` saves and restores the
    sampler's state through it, as it would the sampler's."""

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def place(loader, epoch: int, read: int) -> None:
    """Make ``loader``'s next pass, if its sampler is then at ``epoch``, the rest of that
    epoch from entry ``read`` (the loader's iterator, if any, is dropped first)."""
    sampler = sampler_of(loader)
    if stateful_loader(loader):
        loader.load_state_dict({})    # start afresh, not where its iterator was
    rest = (StatefulEpochRest if is_stateful(sampler) else EpochRest)(sampler, epoch, read)
    loader.batch_sampler.sampler = rest
    sampler.set_epoch(epoch)


def unplace(loader) -> None:
    """Give ``loader``'s batch sampler its own sampler back (a rest placed earlier)."""
    batches = getattr(loader, "batch_sampler", None)
    if isinstance(getattr(batches, "sampler", None), EpochRest):
        batches.sampler = batches.sampler.sampler
