"""save_checkpoint, load_checkpoint, wait_for_checkpoint, and the background saves.

Inside a checkpoint: ``model`` and ``optim`` in the format of
``torch.distributed.checkpoint.state_dict`` (DTensor ``Shard(0)`` pieces under unchanged
FQNs), and ``extra``: the step and every extra object, each as one opaque blob
(extras.py).
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ...runtime import runtime_of
from ...state.plain import group_of as plain_group, plain_model
from ...state.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from .. import fs
from . import extras, layout, positions, verify
from .checksums import FILE_BYTES, ChecksumWriter
from .reader import SafePlanner, SafeReader
from .staging import HostCopy
from .streamed import saved_state

_log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """This process's background saves: the one in flight (at most one), the gloo twins
    of the groups they run on, and the stager that copies the state to the host."""

    def __init__(self):
        self.pending: Future | None = None
        self.stager = HostCopy()
        self._twins: dict = {}

    def start(self, state: dict, tmp: str, group, finish, final: str, planner=None,
              read=None, file_bytes: int | None = None) -> None:
        """Copy ``state`` to the host, but for ``planner``'s placeholders (read as written),
        and write it to ``tmp`` in the background in files of ``file_bytes``; then set
        ``read`` (every item read), ``finish()`` (publish), and ``wait()`` returns
        ``final``."""
        self.stager.keep = set(planner.reads) if planner is not None else set()
        # The background save runs its collectives on a gloo twin of the group, so they
        # never interleave with training's collectives on the group itself.
        writer = ChecksumWriter(tmp, file_bytes=file_bytes, written=read)
        try:
            response = dcp.async_save(state, storage_writer=writer, planner=planner,
                                      process_group=self._twin(group),
                                      async_stager=self.stager)
        except BaseException:
            if read is not None:
                read.set()      # (no step may wait for a save that never started)
            raise
        self.pending = _chain(getattr(response, "upload_completion", response), finish, final,
                              tmp, read)

    def wait(self) -> str | None:
        """Wait for the save in flight; return its directory (None if none). Raises what
        the save raised."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.result()

    def _twin(self, group):
        if group not in self._twins:
            ranks = dist.get_process_group_ranks(group)
            self._twins[group] = dist.new_group(ranks, backend="gloo",
                                                use_local_synchronization=True)
        return self._twins[group]


_background: AsyncCheckpointer | None = None    # made at the first async save


def background() -> AsyncCheckpointer:
    """This process's background saver, made at the first async save (importing zerofn
    starts nothing); from then on process exit waits for its save in flight."""
    global _background
    if _background is None:
        _background = AsyncCheckpointer()
        atexit.register(_wait_at_exit)
    return _background


def _chain(upload: Future, finish, final: str, tmp: str, read=None) -> Future:
    done: Future = Future()

    def on_upload(f: Future) -> None:
        if read is not None:
            read.set()          # (a save that failed before it wrote holds the step no more)
        try:
            f.result()
            finish()
            done.set_result(final)
        except CheckpointException as e:
            done.set_exception(save_error(e, tmp))
        except BaseException as e:  # handed to whoever waits: the next save, load or exit
            done.set_exception(e)

    upload.add_done_callback(on_upload)
    return done


def save_error(e: CheckpointException, tmp: str) -> Exception:
    """What a failed DCP save raises, as an error a loop's ``except Exception`` catches
    (DCP's ``CheckpointException`` derives from BaseException): an OSError with the first
    failing rank's errno where it was one (a full drive: ENOSPC), else a RuntimeError, naming
    the ranks and the cause. Nothing was published: the previous checkpoint stands."""
    causes = {rank: f[0] if isinstance(f, tuple) else f for rank, f in e.failures.items()}
    rank, cause = min(causes.items(), key=lambda item: item[0])
    text = (f"zerofn: writing the checkpoint {tmp} failed on rank(s) {sorted(causes)} "
            f"(rank {rank}: {type(cause).__name__}: {cause}); it was not published, the "
            f"newest complete checkpoint stands, and the run can save again (once there is "
            f"room, where the drive was full).")
    return OSError(cause.errno, text) if isinstance(cause, OSError) else RuntimeError(text)


def _wait_at_exit() -> None:
    try:
        wait_for_checkpoint()
    except BaseException:  # the interpreter is exiting: say so rather than lose it silently
        _log.exception("zerofn: the background checkpoint save failed")


def _watched(phase: str):
    """Record ``phase`` for the failure watch (observe/failures.py) while the call runs, and let a collective
    it fails (a rank gone or stalled) raise ``RankFailure`` naming that rank."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(path, model, *args, **kwargs):
            if plain_model(model) is not None:     # (no runtime: nothing watches)
                return fn(path, model, *args, **kwargs)
            return runtime_of(model).in_phase(phase, fn, path, model, *args, **kwargs)
        return call
    return wrap


# -- save ------------------------------------------------------------------------------
@_watched("checkpoint save")
def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                    keep: int | None = None, async_save: bool = False,
                    staging_bytes: int | None = None, **extra) -> str:
    """Save ``model``, ``optimizer`` and ``extra`` as ``path/step-<step>``; call on every rank.

    Args:
        path: the checkpoint root (created if missing): a local path, or an fsspec URL
            (``s3://bucket/run``, ``file:///shared/run``; docs/checkpoints.md, "Where
            checkpoints can live").
        step: names the checkpoint and is returned by ``load_checkpoint``.
        keep: after this save, keep only the newest ``keep`` checkpoints (None: all).
        async_save: return at once and write in the background while training goes on.
            Each unit's masters and moments are copied out as they are written; the
            first step that would change a unit the save has not written yet copies it
            aside first (within ``staging_bytes``) or waits for the writer
            (``checkpoint/waits``, ``time/checkpoint_wait``), so the checkpoint holds the
            state at this call. The next save or load, ``wait_for_checkpoint()`` and
            process exit wait for it.
        staging_bytes: the copies a save holds at once, at most (default: two data files,
            512 MiB): its data files are half of it each (written one item at a time), a
            background save's copies made before a change the other half.
        **extra: ``Stateful`` objects (LR scheduler, ``StatefulDataLoader``) or plain
            values, the same on every rank; wrap per-rank ones in ``PerRank``
            (``RNGState()`` already is).

    Returns:
        The checkpoint's final directory (complete once the save has finished).
    """
    wait_for_checkpoint()
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint being written (keep >= 1).")
    file_bytes = _file_bytes(staging_bytes)
    group = _group(model)
    root, name = os.fspath(path), layout.step_name(step)
    tmp, final = layout.unfinished(root, name), os.path.join(root, name)
    msd, osd, planner = _saved_state(model, optimizer, async_save, staging_bytes)
    blobs = extras.blobs({"step": step, **extra}, dist.get_rank(group))
    blobs.update(positions.records(extra))     # where each data loader is in its epoch
    if dist.get_rank(group) == 0:
        layout.clear_unfinished(root, name)
        verify.mark(tmp)
    verify.agree_on_save(step, blobs, group)   # also orders rank 0's clean-up before any write
    verify.agree_on_directory(tmp, group)
    fs.makedirs(tmp)
    state = {"model": msd, "optim": osd, "extra": blobs}
    first = dist.get_rank(group) == 0
    finish = (lambda: layout.publish(root, name, keep)) if first else (lambda: None)
    if not async_save:
        try:
            dcp.save(state, storage_writer=ChecksumWriter(tmp, file_bytes=file_bytes),
                     planner=planner, process_group=group)
        except CheckpointException as e:
            raise save_error(e, tmp) from e
        finish()
        return final
    read = threading.Event() if planner is None else planner.copies
    if planner is not None:       # (else every tensor was copied: nothing to hold)
        runtime_of(model).hold_state(read)
    background().start(state, tmp, group, finish, final, planner, read, file_bytes)
    return final


def _file_bytes(staging_bytes: int | None) -> int | None:
    """A data file's bytes at most: half of ``staging_bytes`` (None: the default's)."""
    if staging_bytes is None:
        return None
    if not isinstance(staging_bytes, int) or staging_bytes < 2:
        raise ValueError(f"staging_bytes={staging_bytes!r}: pass the bytes of copies a save "
                         f"may hold, a positive int (at least 2: two files' worth), or "
                         f"leave it out (512 MiB).")
    return staging_bytes // 2


def _saved_state(model, optimizer, async_save: bool, staging_bytes: int | None):
    """``(model, optim)`` state dicts to save, and the planner that writes them (None:
    DCP's). A synchronous save reads offloaded state a unit at a time as it writes it
    (streamed.py); a background save copies each unit out as it writes it or before a
    step changes it, within the half of ``staging_bytes`` a data file's size leaves
    (unit_copies.py)."""
    if plain_model(model) is not None:
        return (*get_state_dict(model, optimizer), None)
    budget = None
    if async_save:
        staging = 2 * FILE_BYTES if staging_bytes is None else staging_bytes
        budget = staging - _file_bytes(staging)
    return saved_state(runtime_of(model), model, optimizer, budget)


def _group(model):
    """Every rank the model's state is spread over (HSDP: both mesh dims)."""
    return plain_group(model) if plain_model(model) is not None else runtime_of(model).group


def wait_for_checkpoint() -> str | None:
    """Wait for this process's background save; return its directory (None if none).

    Raises what the save raised. Call it before ``destroy_process_group``.
    """
    return None if _background is None else _background.wait()


# -- load ------------------------------------------------------------------------------
@_watched("checkpoint load")
def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, trusted: bool = False, **extra) -> dict | None:
    """Load a checkpoint into ``model``, ``optimizer`` and ``extra``; call on every rank.

    Args:
        path: a checkpoint root (its ``latest`` is loaded) or one checkpoint directory,
            a local path or an fsspec URL, also one written by FSDP2 with
            ``dcp.save({"model": ..., "optim": ...})``.
            Any world size and any stage may have saved it.
        optimizer: None loads the model alone (e.g. weights converted by
            ``python -m zerofn.consolidate to-dcp``).
        trusted: read the checkpoint's pickles as torch does, running them. Without it
            (the default) a checkpoint whose pickles name anything but the classes
            checkpoints hold is refused, before any code in it runs; ``trust_class``
            admits one class instead. docs/checkpoints.md, "Loading checkpoints you did
            not write".
        **extra: as for ``save_checkpoint``: ``Stateful`` objects are loaded in place;
            for a plain value pass any placeholder and read the result from the return.

    Returns:
        ``{name: value}`` for the plain extras, and ``"step"`` when the checkpoint has one;
        None, with nothing loaded, when ``path`` holds no checkpoint yet (it does not exist,
        is empty, or holds only a save that never finished), so a job may call this
        unconditionally on start-up. A checkpoint that is there but broken or partial
        raises ``ValueError`` on every rank, as does one whose files do not match their
        checksums or whose pickles a safe load refuses; then nothing was loaded.

    Example:
        >>> state = zf.load_checkpoint("ckpt", model, opt, sched=sched)
        >>> start = state["step"] if state else 0
    """
    wait_for_checkpoint()
    group = _group(model)
    ckpt = verify.resolve_on_rank0(os.fspath(path), group)
    if ckpt is None:
        return None
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    rank = dist.get_rank(group)
    state["extra"] = extras.placeholders(extra, rank)
    places = positions.Places(extra, dist.get_world_size(group), trusted)
    verify.agree_on_load(ckpt, state, group, trusted, places)
    dcp.load(state, storage_reader=SafeReader(ckpt, trusted=trusted),
             planner=SafePlanner(trusted=trusted), process_group=group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, state["model"], state["optim"])
    out = extras.restore(places.restored(), state["extra"], rank, trusted)
    places.place()
    return out

