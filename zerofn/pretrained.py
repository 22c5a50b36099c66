"""Hugging Face weight files in and out of a zerofn model, without a full copy on any rank.

``load_pretrained`` reads a ``.safetensors`` file or a Hugging Face model directory (one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) into a
transformed model; ``save_pretrained`` writes that layout, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

[Note: rows only] A parameter's master is split by rows across ranks (units.py's layout),
so loading reads, on each rank, only this rank's rows of each tensor: safetensors slicing
reads just those bytes of the memory-mapped file. The runtime then refreshes the compute
parameters from the masters, as ``set_model_state_dict`` does (an all-gather for ZeRO-1/2,
whose compute parameters are whole on every rank). Buffers are small and read whole.

[Note: streaming save] Saving gathers one unit at a time: every rank sends its rows of
the unit's masters, rank 0 writes the gathered tensors straight into the open shard file
and drops them, the other ranks drop them at once. Shapes and dtypes are known before
anything is gathered, so each shard's safetensors header (which lists every tensor's
byte range) is written first and the tensors follow in order, with no shard held in
memory. The files go to a hidden sibling directory that replaces ``directory`` only when
complete.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .runtime.agree import agree_or_raise, from_first
from .runtime.runtime import runtime_of
from .runtime.units import local_rows
from .state_dict import _slots_by_name

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# What save_pretrained writes (or would have written) in a model directory; everything
# else found in a directory it replaces is kept (a tokenizer, a README, checkpoints).
_OWNED = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                    r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json|"
                    r"config\.json|generation_config\.json)$")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1}
_LISTED = 20     # keys named per kind in an error; the rest are counted


# -- load --------------------------------------------------------------------------------
def load_pretrained(model: nn.Module, path, *, rename=None, strict: bool = True):
    """Fill a zerofn model from safetensors weights; each rank reads only its own rows.

    Call on every rank, after the transforms. Works for every stage, under
    ``mixed_precision`` and ``offload``; tensors are converted to the model's dtypes.

    Args:
        model: a model transformed by zerofn.
        path: a ``.safetensors`` file (e.g. ``python -m zerofn.consolidate to-full``'s
            output), or a directory holding ``model.safetensors.index.json`` and its shards
            (Hugging Face's sharded layout) or a single ``model.safetensors``.
        rename: maps the file's names to the model's: a dict (names it lacks are kept), or
            a callable returning the model's name, or None to skip that tensor.
        strict: raise if the file lacks some of the model's weights or holds weights the
            model does not have. Shape mismatches always raise. Of two tied parameters
            (e.g. ``lm_head.weight`` and the embedding) the file needs only one.

    Returns:
        ``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict`` returns them.

    Example:
        >>> model, opt = zerofn.shard_params()(model, opt)
        >>> zerofn.load_pretrained(model, "llama-dir", rename=lambda k: k.removeprefix("base."))
    """
    rt = runtime_of(model)
    with contextlib.ExitStack() as files:
        what = f"load_pretrained({os.fspath(path)!r}) failed"
        try:
            plan, missing, unexpected, problems = _load_plan(model, rt, path, rename, files)
        except Exception as e:  # a bad file on one rank must not leave the others waiting
            plan, missing, unexpected, problems = {}, [], [], [f"{type(e).__name__}: {e}"]
        if strict:
            problems += _key_problems(missing, unexpected)
        agree_or_raise(problems, rt.group, what)
        rt.prepare_state_dict()
        agree_or_raise(_read_rows(model, plan), rt.group, what)  # before refresh_params' gathers
        rt.refresh_params()
    return _IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def _read_rows(model, plan: dict) -> list[str]:
    """Read this rank's rows of every parameter's master, and every buffer whole."""
    buffers, key = dict(model.named_buffers()), None
    try:
        for target, (reader, key) in plan.items():
            if isinstance(target, str):
                buffers[target].copy_(reader.get_tensor(key))
            elif target.local:
                start = target.rank * target.chunk
                target.opt_param.copy_(reader.get_slice(key)[start:start + target.local])
    except Exception as e:  # reported on every rank by the caller
        return [f"reading {key!r} failed: {type(e).__name__}: {e}"]
    return []


def _load_plan(model, rt, path, rename, files: contextlib.ExitStack):
    """What to read from where: ``{slot or buffer name: (reader, file key)}``, and the
    missing keys, unexpected keys and shape problems."""
    located = _locate(os.fspath(path))
    readers = {f: files.enter_context(_open(f)) for f in sorted(set(located.values()))}
    by_model_name, problems = {}, []
    for key, file in located.items():
        name = _renamed(key, rename)
        if name is None:
            continue
        if name in by_model_name:
            problems.append(f"two file keys map to the model's {name!r} "
                            f"({by_model_name[name][1]!r} and {key!r}); fix rename=.")
        by_model_name[name] = (readers[file], key)
    expected = list(model.state_dict())
    slots = _slots_by_name(rt)
    plan, missing = {}, []
    for name in expected:
        target = slots.get(name, name)
        if name in by_model_name and target not in plan:
            plan[target] = by_model_name[name]
    for name in expected:
        if slots.get(name, name) not in plan:
            missing.append(name)
    unexpected = [n for n in by_model_name if n not in set(expected)]
    problems += _shape_problems(model, plan)
    return plan, missing, unexpected, problems


def _locate(path: str) -> dict[str, str]:
    """``{file key: safetensors file}`` for a file or a Hugging Face model directory."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path} is not a .safetensors file; load_pretrained reads "
                             "safetensors only (convert .bin files with safetensors first).")
        return {k: path for k in _keys_of(path)}
    if not os.path.isdir(path):
        raise ValueError(f"{path} does not exist: pass a .safetensors file or a model directory.")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is not a Hugging Face index (no weight_map): {e}.")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return {k: single for k in _keys_of(single)}
    raise ValueError(f"{path} holds neither {INDEX_NAME} nor {SINGLE_NAME}; pass the directory "
                     "save_pretrained wrote, or a .safetensors file.")


def _open(file: str):
    from safetensors import safe_open
    if not os.path.isfile(file):
        raise ValueError(f"{file} is missing (named by the index).")
    return safe_open(file, framework="pt", device="cpu")


def _keys_of(file: str) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _renamed(key: str, rename):
    if rename is None:
        return key
    if isinstance(rename, dict):
        return rename.get(key, key)
    return rename(key)


def _shape_problems(model, plan: dict) -> list[str]:
    buffers = dict(model.named_buffers())
    wrong = []
    for target, (reader, key) in plan.items():
        shape = tuple(buffers[target].shape if isinstance(target, str) else target.shape)
        saved = tuple(reader.get_slice(key).get_shape())
        if saved != shape:
            name = target if isinstance(target, str) else target.fqn
            wrong.append(f"{name}: file {saved}, model {shape}")
    if not wrong:
        return []
    return [f"{len(wrong)} shapes differ ({_listed(wrong)}): the file holds another model "
            "configuration"]


def _key_problems(missing: list[str], unexpected: list[str]) -> list[str]:
    problems = []
    if missing:
        problems.append(f"the file lacks {len(missing)} of the model's keys ({_listed(missing)})")
    if unexpected:
        problems.append(f"the file holds {len(unexpected)} keys the model does not have "
                        f"({_listed(unexpected)})")
    if problems:
        problems.append("map names with rename= (e.g. to strip a prefix), or pass strict=False "
                        "to load what matches.")
    return problems


def _listed(names: list[str]) -> str:
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f", and {more} more" if more > 0 else "")


# -- save --------------------------------------------------------------------------------
def save_pretrained(model: nn.Module, directory, *, max_shard_size="5GB", dtype=None) -> str:
    """Write the model in Hugging Face's layout, one unit in memory at a time; call on every
    rank (rank 0 writes).

    Writes ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json``), and ``config.json`` / ``generation_config.json``
    when the model has a Hugging Face ``config`` / ``generation_config``. Tied parameters
    are written once, under the name Hugging Face keeps. The directory is replaced only
    once the new one is complete; files in it that are not model weights or configs
    (a tokenizer, checkpoints) are kept.

    Args:
        model: a model transformed by zerofn.
        directory: the model directory to write.
        max_shard_size: bytes per shard file, an int or a string such as ``"5GB"`` or
            ``"500MiB"``; a tensor larger than that gets a shard of its own.
        dtype: floating tensors are written in this dtype (default: the masters' dtype,
            i.e. the model's dtype before ``mixed_precision``).

    Returns:
        The directory written.

    Example:
        >>> zerofn.save_pretrained(model, "out/llama")
        >>> transformers.AutoModelForCausalLM.from_pretrained("out/llama")
    """
    rt = runtime_of(model)
    limit = _shard_bytes(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_pretrained(dtype={dtype!r}): pass a floating torch dtype or None.")
    directory = os.path.abspath(os.fspath(directory))
    rt.prepare_state_dict()
    entries = _entries(model, rt, dtype)
    shards = _shards(entries, limit)
    tmp = _staging_dir(directory)
    first = dist.get_rank(rt.group) == 0    # (HSDP: each replica has a shard rank 0)
    problems = _save_problems(directory, tmp, entries) if first else []
    agree_or_raise(problems, rt.group, f"save_pretrained({directory!r}) failed")
    writer = _Writer(tmp, shards) if first else None
    for unit in rt.units:
        full = _gather_unit(rt, unit)
        if writer is not None:
            for s in unit.slots:
                writer.write(s, _pieces(rt, s, full))
        del full
    if writer is not None:
        buffers = dict(model.named_buffers())
        for e in entries:
            if isinstance(e.source, str):
                writer.write(e.source, [buffers[e.source]])
        writer.finish(model, entries, shards, directory)
    error = from_first(writer.error if writer is not None else None, rt.group)
    if error:
        raise OSError(f"save_pretrained({directory!r}) failed on rank 0: {error}")
    return directory


class _Entry:
    """One tensor of the saved file: its name, dtype and shape, and where it comes from
    (a parameter's slot, or a buffer's name)."""

    def __init__(self, name: str, dtype: torch.dtype, shape, source):
        self.name, self.dtype, self.shape, self.source = name, dtype, tuple(shape), source

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _entries(model, rt, dtype) -> list[_Entry]:
    """Every tensor to write, in the order the units stream them, buffers last."""
    names = _names_by_slot(rt)
    tied = _tied_patterns(model)
    out_dtype = (lambda dt: dtype if dtype is not None and dt.is_floating_point else dt)
    entries = [_Entry(_kept_name(names[s], s.fqn, tied), out_dtype(s.opt_param.dtype), s.shape, s)
               for u in rt.units for s in u.slots]
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    slot_names = {n for ns in names.values() for n in ns}
    buffers = dict(model.named_buffers())
    for name in model.state_dict():
        if name not in slot_names and name not in ignored and name in buffers:
            entries.append(_Entry(name, out_dtype(buffers[name].dtype), buffers[name].shape, name))
    return entries


def _names_by_slot(rt) -> dict:
    names: dict = {}
    for name, slot in _slots_by_name(rt).items():
        names.setdefault(slot, []).append(name)
    return names


def _tied_patterns(model) -> list[str]:
    """The names Hugging Face drops from a tied pair: ``_tied_weights_keys`` of every
    submodule (a dict of target -> source in transformers 5, a list in 4.x)."""
    out = []
    for prefix, module in model.named_modules():
        for key in getattr(module, "_tied_weights_keys", None) or ():
            out.append(f"{prefix}.{key}" if prefix else key)
    return out


def _kept_name(names: list[str], default: str, tied: list[str]) -> str:
    """Of a parameter's names, the one not declared tied (as transformers keeps it)."""
    if len(names) == 1:
        return names[0]
    kept = [n for n in sorted(names) if not any(re.search(p, n) for p in tied)]
    return kept[0] if kept else default


def _shard_bytes(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper())
        if match:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    raise ValueError(f"save_pretrained(max_shard_size={size!r}): pass a positive int of bytes "
                     "or a string such as '5GB', '500MB' or '2GiB'.")


def _shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive runs of entries of at most ``limit`` bytes (a larger tensor alone), so
    each shard can be written as the units stream in."""
    shards, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _shard_name(i: int, n: int) -> str:
    return SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _staging_dir(directory: str) -> str:
    return os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.zerofn-tmp")


def _save_problems(directory: str, tmp: str, entries: list[_Entry]) -> list[str]:
    """Rank 0, before any gather: can it write there at all?"""
    bad = sorted({str(e.dtype) for e in entries if e.dtype not in _SAFETENSORS_DTYPES})
    if bad:
        return [f"safetensors cannot hold dtypes {bad}."]
    if os.path.exists(directory) and not os.path.isdir(directory):
        return [f"{directory} exists and is not a directory."]
    try:
        shutil.rmtree(tmp, ignore_errors=True)     # a save that crashed
        os.makedirs(tmp)
    except OSError as e:
        return [f"cannot create {tmp} next to it ({e}); choose a writable place."]
    return []


def _gather_unit(rt, unit) -> torch.Tensor | None:
    """All ranks' master rows of ``unit`` as one rank-major ``(world, shard)`` buffer; it
    is kept on rank 0 only (every rank must join the collective)."""
    if not unit.slots:
        return None
    dtype = unit.slots[0].opt_param.dtype
    recv = torch.empty(rt.world * unit.shard_numel, dtype=dtype, device=rt.device)
    send = recv.view(rt.world, unit.shard_numel)[rt.rank]
    send.zero_()
    for s in unit.slots:
        send[s.offset:s.offset + s.local_numel].copy_(s.opt_param.detach().reshape(-1))
    rt.comm.all_gather(recv, send)
    return recv.view(rt.world, unit.shard_numel) if rt.rank == 0 else None


def _pieces(rt, slot, ranks: torch.Tensor) -> list[torch.Tensor]:
    """A parameter's rows as they lie in the gathered buffer, rank after rank: written one
    after the other they are the full tensor's bytes, with no full copy made."""
    out = []
    for r in range(rt.world):
        n = local_rows(slot.rows, rt.world, r) * slot.inner
        out.append(ranks[r, slot.offset:slot.offset + n])
    return out


class _Writer:
    """Rank 0's files: safetensors shards written tensor by tensor in entry order, then the
    index and configs, then the swap into place. A failure is kept (``error``), not raised,
    so rank 0 goes on joining the gathers and every rank learns of it at the end."""

    def __init__(self, tmp: str, shards: list[list[_Entry]]):
        self.tmp, self.error = tmp, None
        self._queue = [(i, e) for i, shard in enumerate(shards) for e in shard]
        self._shards, self._file, self._open_shard, self._at = shards, None, None, 0

    def write(self, source, pieces) -> None:
        """Write the next entry (``source`` must be it) from its pieces, in order."""
        if self.error:
            return
        try:
            shard, entry = self._queue[self._at]
            assert entry.source is source or entry.source == source, (entry.name, source)
            self._at += 1
            if shard != self._open_shard:
                self._start(shard)
            for piece in pieces:
                t = piece.detach().to("cpu", entry.dtype).contiguous().reshape(-1)
                self._file.write(memoryview(t.view(torch.uint8).numpy()))
        except Exception as e:   # kept for every rank to raise; rank 0 goes on gathering
            self._fail(e)

    def _start(self, shard: int) -> None:
        self._close()
        entries = self._shards[shard]
        path = os.path.join(self.tmp, _shard_name(shard, len(self._shards)))
        self._file = open(path, "wb")
        self._file.write(_safetensors_header(entries))
        self._open_shard = shard

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _fail(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            if self._file is not None:
                self._file.close()
        self._file = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, model, entries: list[_Entry], shards, directory: str) -> None:
        if self.error:
            return
        try:
            for shard in range(len(shards)):
                if not shards[shard] and shard != self._open_shard:
                    self._start(shard)      # a model without tensors: an empty file
            self._close()
            if len(shards) > 1:
                _write_json(os.path.join(self.tmp, INDEX_NAME), _index(shards))
            _write_configs(model, entries, self.tmp)
            _swap_into_place(self.tmp, directory)
        except Exception as e:
            self._fail(e)


def _safetensors_header(entries: list[_Entry]) -> bytes:
    """The safetensors header: 8 bytes of length, then JSON naming each tensor's dtype,
    shape and byte range in the data that follows, padded with spaces to 8 bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _index(shards) -> dict:
    n = len(shards)
    return {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
            "weight_map": {e.name: _shard_name(i, n) for i, s in enumerate(shards) for e in s}}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_configs(model, entries: list[_Entry], tmp: str) -> None:
    """``config.json`` (with the saved dtype and the model's class, as transformers records
    them) and ``generation_config.json``, for a Hugging Face model."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_file", None)):
        config = copy.deepcopy(config)
        floating = [e.dtype for e in entries if e.dtype.is_floating_point]
        if floating:
            config.dtype = str(floating[0]).removeprefix("torch.")
        config.architectures = [type(model).__name__]
        config.to_json_file(os.path.join(tmp, "config.json"))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: True)
    if callable(getattr(generation, "to_json_file", None)) and can_generate():
        generation.to_json_file(os.path.join(tmp, "generation_config.json"))


def _swap_into_place(tmp: str, directory: str) -> None:
    """Carry over what the old directory holds besides model files (hard links, so the old
    directory stays whole until the swap), then swap. As for checkpoints, each step is one
    rename; a crash between them leaves both complete directories under hidden names."""
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            if not _OWNED.match(entry):
                _link_tree(os.path.join(directory, entry), os.path.join(tmp, entry))
        old = os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.zerofn-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    fd = os.open(os.path.dirname(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_tree(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.makedirs(dst)
        for entry in os.listdir(src):
            _link_tree(os.path.join(src, entry), os.path.join(dst, entry))
    else:
        try:
            os.link(src, dst)
        except OSError:        # a filesystem without hard links
            shutil.copy2(src, dst)
