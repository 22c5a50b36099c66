"""Sharded, atomic, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP).

A checkpoint root holds::

    root/step-00000010/    a plain DCP checkpoint (FSDP2 reads it: see docs/checkpoints.md)
    root/latest            the name of the newest complete checkpoint, replaced atomically
    root/.tmp-step-...     a save in progress, renamed into place once every rank has written

Inside a checkpoint: ``model`` and ``optim`` in the format of
``torch.distributed.checkpoint.state_dict`` (DTensor ``Shard(0)`` pieces under unchanged
FQNs), and ``extra``: the step and every extra object, each as one opaque blob.

[Note: why blobs] DCP flattens nested dicts and treats plain tensors as replicated: it
writes one rank's copy and drops the others. A data loader's or generator's state differs
per rank, so each extra is serialized whole (``torch.save`` bytes) and per-rank ones are
keyed by rank (``PerRank``). Loading then needs the same structure only at the top level.

[Note: agreement] Every collective entry point first agrees across ranks in one small
``all_gather_object`` (the step and extras on save; the checkpoint's verdict on load), so
a mismatch raises the same error on every rank instead of leaving some in a collective.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import io
import logging
import os
import re
import shutil
import socket
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from .runtime.agree import agree_or_raise, from_first, gather
from .runtime.pinned import host_buffer, pins
from .runtime.runtime import runtime_of
from .state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

LATEST = "latest"
_MARK = ".zerofn-save"     # rank 0's token in a save's directory (_agree_on_directory)
_STEP_DIR = re.compile(r"step-(\d+)$")
_log = logging.getLogger(__name__)


class PerRank:
    """Marks an extra whose state differs per rank (a rank's data loader, its RNG).

    It is saved under this rank's index and restored to the same rank; it cannot move to
    another world size. ``obj`` is a ``Stateful`` or a plain value.
    """

    def __init__(self, obj):
        self.obj = obj


class _Generators:
    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(PerRank):
    """This rank's torch generators (CPU and every CUDA device), as a per-rank extra."""

    def __init__(self):
        super().__init__(_Generators())


# -- save ------------------------------------------------------------------------------
def _watched(phase: str):
    """Record ``phase`` for zerofn/failures.py while the call runs, and let a collective
    it fails (a rank gone or stalled) raise ``RankFailure`` naming that rank."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(path, model, *args, **kwargs):
            watch = runtime_of(model).watch
            watch.enter(phase)
            return watch.guarded(fn)(path, model, *args, **kwargs)
        return call
    return wrap


@_watched("checkpoint save")
def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                    keep: int | None = None, async_save: bool = False, **extra) -> str:
    """Save ``model``, ``optimizer`` and ``extra`` as ``path/step-<step>``; call on every rank.

    Args:
        path: the checkpoint root (created if missing).
        step: names the checkpoint and is returned by ``load_checkpoint``.
        keep: after this save, keep only the newest ``keep`` checkpoints (None: all).
        async_save: return once the state is copied; write in the background. The next
            save or load, ``wait_for_checkpoint()`` and process exit wait for it.
        **extra: ``Stateful`` objects (LR scheduler, ``StatefulDataLoader``) or plain
            values, the same on every rank; wrap per-rank ones in ``PerRank``
            (``RNGState()`` already is).

    Returns:
        The checkpoint's final directory (complete once the save has finished).
    """
    global _pending
    wait_for_checkpoint()
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint being written (keep >= 1).")
    group = runtime_of(model).group    # every rank (HSDP: both mesh dims)
    root, name = os.fspath(path), _step_name(step)
    tmp, final = os.path.join(root, ".tmp-" + name), os.path.join(root, name)
    msd, osd = get_state_dict(model, optimizer)
    blobs = _extra_blobs({"step": step, **extra}, dist.get_rank(group))
    if dist.get_rank(group) == 0:
        _clear_unfinished(root)
        _mark(tmp)
    _agree_on_save(step, blobs, group)   # also orders rank 0's clean-up before any write
    _agree_on_directory(tmp, group)
    os.makedirs(tmp, exist_ok=True)
    state = {"model": msd, "optim": osd, "extra": blobs}
    finish = (lambda: _publish(root, name, keep)) if dist.get_rank(group) == 0 else (lambda: None)
    if not async_save:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
        finish()
        return final
    # The background save runs its collectives on a gloo twin of the group, so they never
    # interleave with training's collectives on the group itself.
    response = dcp.async_save(state, checkpoint_id=tmp, process_group=_background_group(group),
                              async_stager=_STAGER)
    _pending = _chain(getattr(response, "upload_completion", response), finish, final)
    return final


def wait_for_checkpoint() -> str | None:
    """Wait for this process's background save; return its directory (None if none).

    Raises what the save raised. Call it before ``destroy_process_group``.
    """
    global _pending
    pending, _pending = _pending, None
    return None if pending is None else pending.result()


_pending: Future | None = None
_twins: dict = {}


def _step_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: pass the training step as a non-negative int.")
    return f"step-{step:08d}"


def _extra_blobs(extra: dict, rank: int) -> dict:
    blobs = {}
    for key, value in extra.items():
        obj = value.obj if isinstance(value, PerRank) else value
        blob = _to_bytes(obj.state_dict() if _is_stateful(obj) else obj)
        blobs[key] = {f"rank{rank}": blob} if isinstance(value, PerRank) else blob
    return blobs


def _is_stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _agree_on_save(step: int, blobs: dict, group) -> None:
    replicated = {k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()
                  if isinstance(v, bytes) and k != "step"}
    gathered = gather((step, replicated), group)
    first_step, first = gathered[0]   # every rank is held to rank 0's: one error on all
    for rank, (other_step, other) in enumerate(gathered):
        if other_step != first_step:
            raise ValueError(f"save_checkpoint: rank {rank} saves step {other_step}, rank 0 "
                             f"step {first_step}; pass the same step on every rank.")
        if other.keys() != first.keys():
            raise ValueError(f"save_checkpoint: rank {rank} passes extras "
                             f"{sorted(other)}, rank 0 {sorted(first)}.")
        for key in first:
            if other[key] != first[key]:
                raise ValueError(
                    f"save_checkpoint: extra {key!r} differs between ranks 0 and {rank}, so "
                    f"saving one copy would lose the others; wrap it in "
                    f"zerofn.checkpoint.PerRank(...) to save each rank's own.")


def _mark(tmp: str) -> None:
    """Rank 0 leaves a token in the save's directory, for every rank to find there."""
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, _MARK), "w") as f:
        f.write(os.urandom(8).hex())


def _agree_on_directory(tmp: str, group) -> None:
    """Every rank must see rank 0's token (``_mark``): the checkpoint root is one shared
    directory. Raises the same ValueError on every rank otherwise, before any is written
    (node-local paths would leave no complete checkpoint: docs/checkpoints.md)."""
    try:
        with open(os.path.join(tmp, _MARK)) as f:
            seen = f.read()
    except OSError:
        seen = None
    gathered = gather((seen, socket.gethostname(), os.path.abspath(tmp)), group)
    token, host, path = gathered[0]
    blind = [f"rank {r} on {other}" for r, (seen, other, _) in enumerate(gathered)
             if seen != token]
    if blind:
        raise ValueError(
            f"save_checkpoint: {', '.join(blind)} cannot see the directory rank 0 (on "
            f"{host}) writes, {os.path.dirname(path)}: every rank must see one "
            f"shared checkpoint root (NFS, Lustre, ...), or no complete checkpoint is "
            f"written. Put --save-dir / the path on a filesystem every node mounts at "
            f"that path.")
    if dist.get_rank(group) == 0:
        os.remove(os.path.join(tmp, _MARK))


def _background_group(group):
    if group not in _twins:
        ranks = dist.get_process_group_ranks(group)
        _twins[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _twins[group]


class _HostCopy(AsyncStager):
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

    def stage(self, state_dict):
        devices = [t for t in _leaves(state_dict) if t.device.type != "cpu"]
        if not devices:
            return _host_copy(state_dict, iter(()))
        staged = _host_copy(state_dict, self._views(devices))
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


_ALIGN = 64          # bytes between staged tensors
_STAGER = _HostCopy()


def _leaves(obj):
    """The plain tensors in a state dict, DTensors' local pieces in their place."""
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)


def _host_copy(obj, device_views):
    """``obj`` with every tensor copied to the host: device tensors into the next of
    ``device_views`` (non-blocking), host tensors into new memory."""
    if isinstance(obj, DTensor):
        return DTensor(_host_copy(obj.to_local(), device_views), obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return torch.empty_like(obj, device="cpu").copy_(obj)
        return next(device_views).copy_(obj, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v, device_views) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, device_views) for v in obj)
    return obj


def _chain(upload: Future, finish, final: str) -> Future:
    done: Future = Future()

    def on_upload(f: Future) -> None:
        try:
            f.result()
            finish()
            done.set_result(final)
        except BaseException as e:  # handed to whoever waits: the next save, load or exit
            done.set_exception(e)

    upload.add_done_callback(on_upload)
    return done


def _clear_unfinished(root: str) -> None:
    """Remove saves a crash left behind (ours is awaited before this runs)."""
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        if entry.startswith(".tmp-") or entry.startswith(".old-"):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _publish(root: str, name: str, keep: int | None) -> None:
    """Rank 0, after every rank has written: rename into place, point ``latest``, prune.

    Each step is one atomic rename, so a crash anywhere leaves ``latest`` naming a
    complete checkpoint.
    """
    tmp, final = os.path.join(root, ".tmp-" + name), os.path.join(root, name)
    if os.path.exists(final):          # the same step saved again: the new one wins
        os.replace(final, os.path.join(root, ".old-" + name))
    os.replace(tmp, final)
    pointer = os.path.join(root, ".latest.tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    _fsync_dir(root)
    shutil.rmtree(os.path.join(root, ".old-" + name), ignore_errors=True)
    if keep is not None:
        for old in _complete_steps(root)[:-keep]:
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_steps(root: str) -> list[str]:
    """Checkpoint directories under ``root``, oldest step first."""
    names = [n for n in os.listdir(root) if _STEP_DIR.match(n)
             and os.path.exists(os.path.join(root, n, ".metadata"))]
    return sorted(names, key=lambda n: int(_STEP_DIR.match(n).group(1)))


def _wait_at_exit() -> None:
    try:
        wait_for_checkpoint()
    except BaseException:  # the interpreter is exiting: say so rather than lose it silently
        _log.exception("zerofn: the background checkpoint save failed")


atexit.register(_wait_at_exit)


# -- load ------------------------------------------------------------------------------
@_watched("checkpoint load")
def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    **extra) -> dict | None:
    """Load a checkpoint into ``model``, ``optimizer`` and ``extra``; call on every rank.

    Args:
        path: a checkpoint root (its ``latest`` is loaded) or one checkpoint directory,
            also one written by FSDP2 with ``dcp.save({"model": ..., "optim": ...})``.
            Any world size and any stage may have saved it.
        optimizer: None loads the model alone (e.g. weights converted by
            ``python -m zerofn.consolidate to-dcp``).
        **extra: as for ``save_checkpoint``: ``Stateful`` objects are loaded in place;
            for a plain value pass any placeholder and read the result from the return.

    Returns:
        ``{name: value}`` for the plain extras, and ``"step"`` when the checkpoint has one;
        None, with nothing loaded, when ``path`` holds no checkpoint yet (it does not exist,
        is empty, or holds only a save that never finished), so a job may call this
        unconditionally on start-up. A checkpoint that is there but broken or partial
        raises ``ValueError`` on every rank.

    Example:
        >>> state = zf.load_checkpoint("ckpt", model, opt, sched=sched)
        >>> start = state["step"] if state else 0
    """
    wait_for_checkpoint()
    rt = runtime_of(model)
    group = rt.group
    ckpt = _resolve_on_rank0(os.fspath(path), group)
    if ckpt is None:
        return None
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    rank = dist.get_rank(group)
    state["extra"] = {k: ({f"rank{rank}": b""} if isinstance(v, PerRank) else b"")
                      for k, v in extra.items()}
    metadata = _agree_on_load(ckpt, state, group)
    if "extra.step" in metadata and "step" not in extra:
        state["extra"]["step"] = b""
    dcp.load(state, checkpoint_id=ckpt, process_group=group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, state["model"], state["optim"])
    return _restore_extras(extra, state["extra"], rank)


def _resolve_on_rank0(path: str, group) -> str | None:
    """Rank 0 reads ``latest`` (it alone publishes it) and tells the others; None where
    ``path`` holds no checkpoint at all."""
    found = None
    if dist.get_rank(group) == 0:
        try:
            found = None if _holds_nothing(path) else _resolve(path)
        except (OSError, ValueError) as e:
            found = e
    found = from_first(found, group)
    if isinstance(found, BaseException):
        raise ValueError(str(found))
    return found


def _holds_nothing(path: str) -> bool:
    """No checkpoint was ever published here: no such path, or a directory holding nothing
    but unfinished saves (which the next save removes)."""
    if not os.path.exists(path):
        return True
    return os.path.isdir(path) and all(e.startswith(".tmp-") for e in os.listdir(path))


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    pointer = os.path.join(path, LATEST)
    if not os.path.exists(pointer):
        raise ValueError(f"No checkpoint at {path}: it has neither a {LATEST!r} file nor a "
                         f"DCP .metadata file. Pass a checkpoint root or one checkpoint "
                         f"directory.")
    with open(pointer) as f:
        name = f.read().strip()
    ckpt = os.path.join(path, name)
    if not os.path.exists(os.path.join(ckpt, ".metadata")):
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint "
                         f"(no {os.path.join(ckpt, '.metadata')}).")
    return ckpt


def _agree_on_load(ckpt: str, state: dict, group) -> dict:
    """Check the checkpoint against what this rank will load; raise on every rank if any
    rank found a problem, before the collective load could leave some ranks waiting."""
    try:
        metadata = FileSystemReader(ckpt).read_metadata()
        problems = _problems(ckpt, metadata, state, dist.get_world_size(group))
    except Exception as e:  # an unreadable checkpoint is one more problem to agree on
        metadata, problems = None, [f"cannot read its metadata ({type(e).__name__}: {e}); "
                                    f"the save did not finish or the file is corrupt"]
    agree_or_raise(problems, group, f"Cannot load checkpoint {ckpt}")
    return metadata.state_dict_metadata


def _problems(ckpt: str, metadata, state: dict, world: int) -> list[str]:
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    problems = _per_rank_problems(flat, saved, world)
    missing = [k for k in flat if k not in saved and not _PER_RANK.match(k)]
    if missing:
        problems.append(f"it lacks {len(missing)} entries this model needs, e.g. "
                        f"{', '.join(missing[:3])}" + _missing_hint(missing, saved))
    wrong = [f"{k}: saved {_shape(saved[k])}, here {_shape_of(v)}"
             for k, v in flat.items() if k in saved and _shape(saved[k]) != _shape_of(v)]
    if wrong:
        problems.append(f"{len(wrong)} shapes differ ({'; '.join(wrong[:3])}): it was saved "
                        f"from another model configuration")
    return problems + _file_problems(ckpt, metadata)


_PER_RANK = re.compile(r"extra\.(.+)\.rank\d+$")


def _per_rank_problems(flat: dict, saved: dict, world: int) -> list[str]:
    problems = []
    for key in flat:
        match = _PER_RANK.match(key)
        if match:
            prefix = f"extra.{match.group(1)}.rank"
            ranks = sum(1 for k in saved if k.startswith(prefix) and k[len(prefix):].isdigit())
            if ranks != world:
                problems.append(f"per-rank state {match.group(1)!r} was saved by {ranks} "
                                f"ranks, not {world}: it cannot move to another world size; "
                                f"load without it")
    return problems


def _missing_hint(missing: list[str], saved: dict) -> str:
    if any(k.startswith("optim.") for k in missing) and \
            not any(k.startswith("optim.") for k in saved):
        return " (it holds no optimizer state: pass optimizer=None to load the model alone)"
    return ": was it saved from another model?"


def _shape(meta) -> str:
    return "bytes" if isinstance(meta, BytesStorageMetadata) else str(tuple(meta.size))


def _shape_of(value) -> str:
    if isinstance(value, (torch.Tensor, DTensor)):
        return str(tuple(value.shape))
    return "bytes"


def _file_problems(ckpt: str, metadata) -> list[str]:
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(need.items()):
        file = os.path.join(ckpt, name)
        if not os.path.exists(file):
            problems.append(f"data file {name} is missing")
        elif os.path.getsize(file) < size:
            problems.append(f"data file {name} is truncated ({os.path.getsize(file)} of "
                            f"{size} bytes)")
    return problems


def _restore_extras(extra: dict, loaded: dict, rank: int) -> dict:
    out = {}
    if "step" in loaded and "step" not in extra:
        out["step"] = _from_bytes(loaded["step"])
    for key, value in extra.items():
        blob = loaded[key][f"rank{rank}"] if isinstance(value, PerRank) else loaded[key]
        obj = value.obj if isinstance(value, PerRank) else value
        if _is_stateful(obj):
            obj.load_state_dict(_from_bytes(blob))
        else:
            out[key] = _from_bytes(blob)
    return out


def _from_bytes(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)
