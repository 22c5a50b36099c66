"""What a load takes from the pickles in a checkpoint: nothing that runs code.

[Note: pickles in a checkpoint] Unpickling calls whatever a pickle names (``os.system``,
``open``, any class's constructor), so a checkpoint from elsewhere could run code the
moment it is read. A DCP checkpoint holds pickles in three places, and each is read
admitting only the globals it holds when zerofn, DCP or FSDP2 wrote it:

- ``.metadata``: DCP's ``pickle.dump`` of its dataclasses, in a pickle protocol torch's
  weights-only unpickler does not read. A ``pickle.Unpickler`` whose ``find_class``
  admits ``METADATA_GLOBALS`` reads it: DCP's metadata dataclasses, the storage-info and
  tensor-properties types, ``torch.Size``, dtypes, layouts and the checkpoint's path
  (what torch 2.11 and 2.13 write; their ``metadata.py`` and ``filesystem.py`` pickle the
  same classes).
- every entry: a ``torch.save`` archive, of a tensor or, as a "bytes" entry, of any other
  value (an optimizer's hyperparameters, zerofn's extras).
- zerofn's extras: one more ``torch.save`` blob inside their bytes entry (extras.py).

An entry or blob is first scanned for the globals its pickle names, by torch's own scan,
which runs nothing, and refused unless every one is in ``ENTRY_GLOBALS``: tensors, their
storages and dtypes, and plain containers, which is all zerofn and DCP write there (the
step, RNG states, the loss scaler, LR schedulers', ``StatefulDataLoader`` and data
loaders' states); a narrower list than torch's weights-only defaults. It is then read
with ``torch.load(weights_only=True)``.

A class the user trusts is admitted everywhere: ``trust_class(cls)`` registers it with
torch (``torch.serialization.add_safe_globals``, which is honoured as well). A load
given ``trusted=True`` reads the checkpoint as torch itself would, running its pickles.
"""
from __future__ import annotations

import enum
import io
import pickle

import torch
from torch._weights_only_unpickler import get_globals_in_pkl
from torch.serialization import _open_zipfile_reader

ALLOW = ("If you trust where this checkpoint came from, allow the class once with "
         "zerofn.trust_class(cls) (or torch.serialization.add_safe_globals([cls])), or "
         "load it with trusted=True (--trusted on the command line)")


def _dtypes() -> set[str]:
    return {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _legacy_storages() -> set[str]:
    """``torch.FloatStorage`` and the like: the storage a tensor of a classic dtype is
    pickled with."""
    return {f"torch.{name}" for name, v in vars(torch).items()
            if name.endswith("Storage") and isinstance(v, type)
            and name not in ("TypedStorage", "UntypedStorage")}


_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset({
    *(f"{_DCP}.metadata.{name}" for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    f"{_DCP}.filesystem._StorageInfo",
    "torch.Size", "torch.serialization._get_layout", *_dtypes(),
    # StorageMeta.checkpoint_id: the directory written, a pathlib path (pathlib._local
    # from Python 3.13)
    *(f"pathlib{where}.{cls}" for where in ("", "._local")
      for cls in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
})

ENTRY_GLOBALS = frozenset({
    # tensors, as torch.save pickles them, with their storages and dtypes
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2", "torch.Tensor", "torch.nn.parameter.Parameter",
    "torch.storage.UntypedStorage", *_legacy_storages(), *_dtypes(),
    "torch.Size", "torch.device", "torch.serialization._get_layout",
    # plain containers and values: OrderedDict (a tensor's hooks, a loader's state),
    # set, bytes (protocol 2 pickles them through _codecs.encode), bytearray, complex
    "collections.OrderedDict", "builtins.set", "_codecs.encode", "builtins.bytearray",
    "builtins.complex",
})


class Refused(ValueError):
    """A pickle in a checkpoint names globals a safe load does not take; nothing of it ran."""

    def __init__(self, where: str, names):
        self.where, self.names = where, sorted(names)
        super().__init__(refusal(where, self.names))


def refusal(where: str, names) -> str:
    return (f"{where} holds {', '.join(names)}, which a safe load refuses: unpickling would "
            f"run it, and zerofn reads only the classes checkpoints hold (nothing of the "
            f"file was run). {ALLOW}.")


class Unreadable(ValueError):
    """An entry that is no ``torch.save`` archive a safe load reads."""


def trust_class(cls, name: str | None = None):
    """Let every safe load read objects of ``cls`` (a class, or a function a pickle
    calls) from checkpoints; returns ``cls``, so it also decorates a class.

    Register it once, before loading, in every process that loads. Only trust a class
    whose construction from arbitrary arguments does nothing but build the object.

    Args:
        cls: the class a user's extra pickles, e.g. the class of a data loader's state.
        name: the ``module.qualname`` the pickle names it by, where that differs from
            ``cls``'s own (a class that moved).

    Example:
        >>> @zf.trust_class
        ... class Progress:
        ...     ...
        >>> zf.load_checkpoint("ckpt", model, opt, progress=progress)
    """
    if not callable(cls):
        raise TypeError(f"trust_class({cls!r}): pass the class (or function) itself.")
    torch.serialization.add_safe_globals([cls if name is None else (cls, name)])
    return cls


def trusted_globals() -> dict[str, object]:
    """``{module.qualname: object}`` of every global trusted through torch's registry."""
    out = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        out[name or f"{obj.__module__}.{obj.__qualname__}"] = obj
    return out


# -- .metadata ---------------------------------------------------------------------------
class StandIn:
    """Stands in for a class a pickle names that a read does not take: it keeps what the
    pickle held, ``args`` and ``state``, and runs nothing. ``path`` is the name stood in
    for."""

    path = ""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.path}, not run>"


def stand_in(name: str) -> type:
    """A ``StandIn`` subclass for the global ``name``."""
    return type(name.rsplit(".", 1)[-1], (StandIn,), {"path": name})


class MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``, resolving only ``METADATA_GLOBALS`` and trusted
    globals. Any other global raises ``Refused`` before anything is called; with
    ``survey=True`` it is recorded in ``refused`` and stood in for instead, so one read
    lists every global a safe load would refuse."""

    def __init__(self, file, where: str, survey: bool = False):
        super().__init__(file)
        self.where, self.survey, self.refused = where, survey, []
        self._trusted = trusted_globals()

    def find_class(self, module: str, name: str):
        path = f"{module}.{name}"
        if path == "builtins.getattr":
            return self._enum_member
        if path in METADATA_GLOBALS:
            return super().find_class(module, name)
        if path in self._trusted:
            return self._trusted[path]
        if not self.survey:
            raise Refused(self.where, [path])
        self.refused.append(path)
        return stand_in(path)

    def _enum_member(self, cls, name):
        """``getattr`` as a pickle may call it: only for a member of an admitted enum, by
        name, which is how Python 3.11's first releases (Debian 12's 3.11.2) pickle
        ``_MEM_FORMAT_ENCODING``'s members; anything else is refused as ``getattr``."""
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) \
                and name in cls.__members__:
            return cls[name]
        if not self.survey:
            raise Refused(self.where, ["builtins.getattr"])
        self.refused.append("builtins.getattr")
        return stand_in("builtins.getattr")


def load_metadata(data: bytes, where: str, trusted_file: bool = False):
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file."""
    if trusted_file:
        return pickle.loads(data)
    return MetadataUnpickler(io.BytesIO(data), where).load()


# -- entries: torch.save archives -------------------------------------------------------
def globals_in(stream) -> set[str]:
    """Every global the pickle of the ``torch.save`` archive ``stream`` (a seekable binary
    file) names, read as torch's ``get_unsafe_globals_in_checkpoint`` reads them, without
    running any; raises ``Unreadable`` where it is no such archive."""
    start = stream.tell()
    try:
        with _open_zipfile_reader(stream) as archive:
            return get_globals_in_pkl(io.BytesIO(archive.get_record("data.pkl")))
    except Exception as e:  # whatever the archive's fault, a safe load does not read it
        raise Unreadable(f"it is no torch.save archive a safe load reads ({type(e).__name__}: "
                         f"{e})") from e
    finally:
        stream.seek(start)


def refused_in(stream) -> list[str]:
    """The globals the archive ``stream`` names that a safe load refuses."""
    return sorted(globals_in(stream) - ENTRY_GLOBALS - set(trusted_globals()))


def load_entry(stream, where: str, trusted_file: bool = False):
    """``torch.load`` of the archive ``stream`` (``where`` names it in errors): scanned and
    then read with the weights-only unpickler, or, for a trusted file, as torch would."""
    if not trusted_file:
        try:
            names = refused_in(stream)
        except Unreadable as e:
            raise Unreadable(f"{where}: {e}") from e
        if names:
            raise Refused(where, names)
    return torch.load(stream, map_location="cpu", weights_only=not trusted_file)
