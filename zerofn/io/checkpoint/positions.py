"""Data positions: where each data loader of a checkpoint is in its epoch, in the epoch's
global order (rest.py's note), so a resume at another world size reads the rest once.

A position is a plain dict (``record``): the class of the loader that saved it, its
sampler's class, world, rows, seed, shuffle and drop_last, the epoch, ``read`` (entries of
the epoch's order read, the dataset's length once all were), ``own`` (the pass under way
is the sampler's own, not a rest placed by a load) and ``why`` (what keeps it from moving
to another world, if anything).

At a save, an extra that is a torchdata ``StatefulDataLoader`` over a
``DistributedSampler`` gets an entry beside its state, ``extra.<name>:position``
(``records``), and so does a ``ResumableLoader`` (whose own state is the same record). At
a load, ``Places``
reads them after the checkpoint's checks and before anything is loaded, and decides for
each: the loader restores itself (same world, its own pass), its next pass is the rest
placed anew (``rest.place``), or the load is refused: ``verify.agree_on_load`` raises the
refusal on every rank.
"""
from __future__ import annotations

from torch.utils.data import DataLoader

from .extras import PerRank, from_bytes, is_stateful, to_bytes
from .rest import KNOWN, EpochRest, class_name, place, sampler_of, stateful_loader, unplace
from .verify import saved_ranks

FIELDS = ("loader", "sampler", "world", "rows", "seed", "shuffle", "drop_last", "epoch", "read",
          "own", "why")


def entry(key: str) -> str:
    """The extra entry holding the position of the extra ``key``."""
    return f"{key}:position"


def record(loader, batches: int, finished: bool, why: str | None = None) -> dict:
    """``loader``'s position once its pass under way has yielded ``batches`` batches
    (``finished``: that pass ended, so the next is a fresh one, of the epoch set then)."""
    s = sampler_of(loader)
    rest = loader.batch_sampler.sampler
    serving = isinstance(rest, EpochRest) and rest.active()
    out = {"loader": type(loader).__name__, "sampler": class_name(s),
           "world": s.num_replicas, "rows": len(s.dataset), "seed": s.seed,
           "shuffle": s.shuffle, "drop_last": s.drop_last, "why": why}
    if finished:
        return {**out, "epoch": s.epoch, "read": 0, "own": True}
    start, mine = (rest.read, len(rest.indices())) if serving else (0, s.num_samples)
    rows = batches * loader.batch_sampler.batch_size
    read = len(s.dataset) if rows >= mine else start + rows * s.num_replicas
    return {**out, "epoch": rest.epoch if serving else s.epoch, "read": read,
            "own": not serving}


def loader_batches(state: dict) -> tuple[int, bool] | None:
    """(batches the pass under way has yielded, whether it ended) from a
    ``StatefulDataLoader``'s state, in torchdata 0.11's layout (its snapshot, with workers:
    the sampler itself runs ahead, drawing for the batches they prefetch); None where the
    state holds neither."""
    if "_num_yielded" in state:
        batches = state["_num_yielded"]
    else:
        snapshot = state.get("_snapshot")
        if not isinstance(snapshot, dict) or "_steps_since_snapshot" not in state:
            return None
        batches = snapshot.get("_snapshot_step", -1) + state["_steps_since_snapshot"]
    finished = state.get("_iterator_finished")
    ok = isinstance(batches, int) and batches >= 0 and isinstance(finished, bool)
    return (batches, finished) if ok else None


def unknown_sampler(sampler) -> str | None:
    """Why ``sampler``'s rows cannot be dealt over another world, if they cannot."""
    if class_name(sampler) in KNOWN:
        return None
    return (f"its sampler is a {class_name(sampler)}, whose order zerofn does not know (it "
            f"knows torch's DistributedSampler and torchdata's StatefulDistributedSampler)")


def why_not(loader, counted: bool) -> str | None:
    """What keeps ``loader``'s position from moving to another world, if anything
    (``counted``: the batches it yielded are known)."""
    if not counted:
        return ("its StatefulDataLoader's state does not say how many batches it has "
                "yielded (zerofn reads the layout of torchdata 0.11's)")
    if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
        return ("its workers hand batches over out of order (in_order=False), so the "
                "batches it yielded are not the first ones of its share")
    if stateful_loader(loader) and is_stateful(loader.dataset):
        return ("its dataset has a state of its own (state_dict), which zerofn cannot "
                "deal over another world")
    return unknown_sampler(sampler_of(loader))


def records(extra: dict) -> dict:
    """``{"<name>:position": blob}`` for each extra (or ``PerRank`` extra) that is a
    ``ResumableLoader``, or a ``StatefulDataLoader`` over a ``DistributedSampler``, from
    the state it saves."""
    out = {}
    for key, value in extra.items():
        obj = value.obj if isinstance(value, PerRank) else value
        if isinstance(obj, ResumableLoader):
            out[entry(key)] = to_bytes(obj.state_dict())
        elif stateful_loader(obj) and sampler_of(obj) is not None:
            counts = loader_batches(obj.state_dict())
            position = record(obj, *(counts or (0, False)), why_not(obj, counts is not None))
            out[entry(key)] = to_bytes(position)
    return out


# -- load ------------------------------------------------------------------------------
def _sampler_text(rec: dict) -> str:
    return (f"a {rec['sampler'].rsplit('.', 1)[-1]} over {rec['rows']} rows (seed "
            f"{rec['seed']}, shuffle={rec['shuffle']}, drop_last={rec['drop_last']})")


def _again(key: str, rec: dict) -> str:
    return f"leave {key!r} out and start epoch {rec['epoch']} again " \
           f"(sampler.set_epoch({rec['epoch']}))"


def judge(key: str, obj, rec, world: int, own: bool = True) -> tuple[str | None, str | None]:
    """(what becomes of the extra ``key``, ``obj``, saved at the position ``rec``: "own"
    for its own restore, "move" for the rest placed anew; or None and why the load must be
    refused). ``world``: the load's, for a loader with no DistributedSampler; ``own``: its
    own state can be loaded here (not a per-rank one saved at another world)."""
    if not isinstance(rec, dict) or set(rec) != set(FIELDS):
        return None, (f"extra {key!r} holds no data position zerofn wrote: load it into the "
                      f"kind of loader that saved it, or leave it out")
    loader = obj.loader if isinstance(obj, ResumableLoader) else obj
    sampler = sampler_of(loader)
    here = world if sampler is None else sampler.num_replicas
    saved = f"extra {key!r} was saved part way through epoch {rec['epoch']} at world " \
            f"{rec['world']} and is loaded at world {here}"
    if sampler is None:
        if rec["world"] == here and own:
            return "own", None
        into = type(getattr(getattr(loader, "batch_sampler", None), "sampler", loader))
        return None, (f"{saved}, where its batches come from no DistributedSampler (from a "
                      f"{into.__module__}.{into.__qualname__}), so the rest of that epoch "
                      f"cannot be dealt: give it a DistributedSampler as at the save "
                      f"({_sampler_text(rec)}), or {_again(key, rec)}")
    if own and rec["own"] and rec["world"] == here and rec["loader"] == type(obj).__name__ \
            and not isinstance(obj, ResumableLoader):
        return "own", None
    why = rec["why"] or unknown_sampler(sampler)
    if why:
        return None, (f"{saved}, but {why}, so the rest of that epoch cannot be dealt over "
                      f"{here} ranks: load it at world {rec['world']}, or {_again(key, rec)}")
    now = {"rows": len(sampler.dataset), "seed": sampler.seed, "shuffle": sampler.shuffle,
           "drop_last": sampler.drop_last}
    differ = [f"{v} rows" if k == "rows" else f"{k} {v}" if k == "seed" else f"{k}={v}"
              for k, v in now.items() if rec[k] != v]
    if differ:
        return None, (f"{saved}, from {_sampler_text(rec)}; here its sampler has "
                      f"{', '.join(differ)}, so the rest of the saved epoch is not the rest of "
                      f"this one: build the sampler as it was saved, or {_again(key, rec)}")
    return "move", None


class Places:
    """The data positions one load finds, and what becomes of each loader extra (the
    module's docstring). ``verify.agree_on_load`` calls ``request`` and ``problems``."""

    def __init__(self, extra: dict, world: int, trusted: bool = False):
        self.extra, self.world, self.trusted = extra, world, trusted
        self.moves: dict[str, dict] = {}    # extras whose next pass is placed anew
        self.foreign: set[str] = set()      # per-rank extras saved by another world

    def request(self, metadata, wanted: dict) -> None:
        """Add to ``wanted`` (the load's extras) the positions saved for this load's extras,
        so that the checks before the load read and check their files too; a per-rank
        extra's own state, saved by another number of ranks, is not loaded (its position
        decides)."""
        saved = metadata.state_dict_metadata
        for key, value in self.extra.items():
            if f"extra.{entry(key)}" not in saved:
                continue
            wanted[entry(key)] = b""
            if isinstance(value, PerRank) and saved_ranks(saved, key) != self.world:
                del wanted[key]
                self.foreign.add(key)

    def problems(self, reader, metadata) -> list[str]:
        """Why this rank cannot load its loader extras from ``reader``'s checkpoint, if it
        cannot; records the loaders to place anew."""
        out = []
        for key, value in self.extra.items():
            if f"extra.{entry(key)}" not in metadata.state_dict_metadata:
                continue
            rec = from_bytes(reader.value(f"extra.{entry(key)}"), entry(key), self.trusted)
            obj = value.obj if isinstance(value, PerRank) else value
            fate, problem = judge(key, obj, rec, self.world, own=key not in self.foreign)
            if problem:
                out.append(problem)
            elif fate == "move":
                self.moves[key] = rec
        return out

    def restored(self) -> dict:
        """The extras that restore themselves from their own state: all but the loaders
        placed anew (a rest an earlier load placed in one is taken out first)."""
        out = {}
        for key, value in self.extra.items():
            if key not in self.moves:
                unplace(value.obj if isinstance(value, PerRank) else value)
                out[key] = value
        return out

    def place(self) -> None:
        """Make the next pass of each loader placed anew the rest of its saved epoch."""
        for key, rec in self.moves.items():
            value = self.extra[key]
            obj = value.obj if isinstance(value, PerRank) else value
            if isinstance(obj, ResumableLoader):
                obj.load_state_dict(rec)
            else:
                place(obj, rec["epoch"], rec["read"])


class ResumableLoader:
    """A ``torch.utils.data.DataLoader`` over torch's ``DistributedSampler`` that keeps its
    place in the epoch for checkpoints: it counts the batches the loop takes from it.

    A plain DataLoader keeps no state, so a checkpoint could not say how far it read. Loop
    over this instead of the loader, and pass it to ``save_checkpoint`` and
    ``load_checkpoint`` as an extra: after a load, at this world size or another, its next
    pass is the rest of the saved epoch dealt over the ranks that read it now, so every row
    of the epoch is read once (docs/checkpoints.md, "Resuming the data at another world
    size"). Call
    ``sampler.set_epoch(epoch)`` before each pass, as with the loader alone.

    Args:
        loader: a DataLoader made with ``batch_size`` and
            ``sampler=DistributedSampler(...)`` (torch's, or torchdata's
            ``StatefulDistributedSampler``).

    Example:
        >>> sampler = DistributedSampler(data, shuffle=True, seed=0)
        >>> loader = zf.ResumableLoader(DataLoader(data, batch_size=8, sampler=sampler))
        >>> zf.load_checkpoint("ckpt", model, opt, loader=loader)
        >>> for x, y in loader:
        ...     ...
    """

    def __init__(self, loader: DataLoader):
        if sampler_of(loader) is None:
            drawn = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            raise TypeError(
                f"ResumableLoader: the loader's batches must come from a DistributedSampler, "
                f"as in DataLoader(data, batch_size=b, sampler=DistributedSampler(data, "
                f"...)); this one's come from "
                f"{type(drawn).__name__ if drawn else 'no sampler'} ({type(loader).__name__} "
                f"with batch_size={getattr(loader, 'batch_size', None)}).")
        why = why_not(loader, counted=True)
        if why:
            raise TypeError(f"ResumableLoader: {why}, so its place in the epoch cannot be "
                            f"kept.")
        self.loader = loader
        self.batches, self.finished = 0, False

    def __iter__(self):
        self.batches, self.finished = 0, False
        return self._count(iter(self.loader))

    def _count(self, batches):
        for batch in batches:
            self.batches += 1
            yield batch
        self.finished = True

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        """The loader's position (the module's docstring): the same on every rank."""
        position = record(self.loader, self.batches, self.finished)
        return {**position, "loader": "ResumableLoader"}

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the rest of the epoch ``state`` was saved in, dealt over the
        ranks of this loader's sampler; raises ValueError where it cannot be."""
        _, problem = judge("loader", self, state, sampler_of(self.loader).num_replicas)
        if problem:
            raise ValueError(problem)
        place(self.loader, state["epoch"], state["read"])
        self.batches, self.finished = 0, False
