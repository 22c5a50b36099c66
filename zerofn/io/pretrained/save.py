"""save_pretrained: a zerofn model as a Hugging Face model directory.

[Note: streaming save] Saving gathers one unit at a time: every rank sends its rows of
the unit's masters, rank 0 writes the gathered tensors straight into the open shard file
and drops them, the other ranks drop them at once. Shapes and dtypes are known before
anything is gathered, so each shard's safetensors header (which lists every tensor's
byte range) is written first and the tensors follow in order, with no shard held in
memory. The files go to a hidden sibling directory that replaces ``directory`` only when
complete.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import shutil

import torch
import torch.distributed as dist
from torch import nn

from ...core.units import ParamSlot, local_rows
from ...runtime import runtime_of
from ...runtime.agree import agree_or_raise, from_first
from ...state.hooks import hooked_modules, module_state, persistent_buffers, within
from .. import fs
from ..weights import refuse_own_groups
from .safetensors_writer import DTYPES, Entry, Writer, shards

# What save_pretrained writes (or would have written) in a model directory; everything
# else found in a directory it replaces is kept (a tokenizer, a README, checkpoints).
_OWNED = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                    r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json|"
                    r"config\.json|generation_config\.json)$")
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1}


def save_pretrained(model: nn.Module, directory, *, max_shard_size="5GB", dtype=None) -> str:
    """Write the model in Hugging Face's layout, one unit in memory at a time; call on every
    rank (rank 0 writes).

    Writes ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json``), and ``config.json`` / ``generation_config.json``
    when the model has a Hugging Face ``config`` / ``generation_config``. Tied parameters
    are written once, under the name Hugging Face keeps. A module whose own state-dict
    hooks reshape its state dict (a fused projection saved as several tensors, a renamed
    weight) is written under the names they give, its parameters gathered whole one such
    module at a time. The directory is replaced only once the new one is complete; files
    in it that are not model weights or configs (a tokenizer, checkpoints) are kept.

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
    model = rt.model     # (the module itself, where torch.compile wraps it)
    refuse_own_groups(rt, "save_pretrained")
    limit = _shard_bytes(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_pretrained(dtype={dtype!r}): pass a floating torch dtype or None.")
    directory = os.path.abspath(os.fspath(directory))
    rt.prepare_state_dict()
    hooked = hooked_modules(model, load=False)
    entries = _entries(model, rt, dtype, hooked)
    tmp = _hidden(directory, "tmp")
    first = dist.get_rank(rt.group) == 0    # (HSDP: each replica has a shard rank 0)
    problems = _save_problems(directory, tmp, entries) if first else []
    agree_or_raise(problems, rt.group, f"save_pretrained({directory!r}) failed")
    writer = Writer(tmp, shards(entries, limit)) if first else None
    _stream(rt, entries, hooked, writer)
    if writer is not None:
        buffers = persistent_buffers(model)
        for e in entries:
            if isinstance(e.source, str):
                writer.write(e.source, [buffers[e.source]])
        writer.finish(functools.partial(_complete, model, entries, directory))
    error = from_first(writer.error if writer is not None else None, rt.group)
    if error:
        raise OSError(f"save_pretrained({directory!r}) failed on rank 0: {error}")
    return directory


def _stream(rt, entries: list[Entry], hooked, writer) -> None:
    """Gather the parameters unit by unit, then each hooked module's state dict, every rank
    joining each gather; rank 0 (``writer``) writes them as they come."""
    plain = {e.source for e in entries if isinstance(e.source, ParamSlot)}
    for unit in rt.units:
        slots = [s for s in unit.slots if s in plain]
        full = rt.gather_unit(unit) if slots else None
        if writer is not None:
            for s in slots:
                writer.write(s, _pieces(rt, s, full))
        del full
    for name, module in hooked:
        state = _hooked_state(rt, name, module)
        if writer is not None:
            for e in entries:
                if e.source == (name, e.name):
                    writer.write(e.source, [state[e.name]])
        del state


def _entries(model, rt, dtype, hooked) -> list[Entry]:
    """Every tensor to write, in the order they stream: parameters unit by unit, then the
    state dict of each module whose own hooks shape it (under the names they give), then
    buffers."""
    names = _names_by_slot(rt)
    tied = _tied_patterns(model)
    out_dtype = (lambda dt: dtype if dtype is not None and dt.is_floating_point else dt)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    entries = []
    for s in (s for u in rt.units for s in u.slots):
        free = [n for n in names[s] if not _hooked_name(n, hooked)]
        if free:
            entries.append(Entry(_kept_name(free, s.fqn, tied), out_dtype(rt.master_rows(s).dtype),
                                 s.shape, s))
    for name, module in hooked:    # (the values are dropped: only names and shapes count here)
        for key, value in _hooked_state(rt, name, module).items():
            if torch.is_tensor(value) and key not in ignored:
                entries.append(Entry(key, out_dtype(value.dtype), value.shape, (name, key)))
    for name, buf in persistent_buffers(model).items():
        if name not in ignored and not _hooked_name(name, hooked):
            entries.append(Entry(name, out_dtype(buf.dtype), buf.shape, name))
    return entries


def _hooked_name(name: str, hooked) -> bool:
    return any(within(name, prefix) for prefix, _ in hooked)


def _hooked_state(rt, name: str, module) -> dict:
    """A module whose own hooks shape its state dict (a fused projection saved as several
    tensors) is saved as its ``state_dict()`` gives it, over its parameters' full masters:
    gathered whole, one such module at a time. Collective."""
    return module_state(rt, module, lambda s: rt.full_tensor(s, rt.master_rows(s)),
                        prefix=f"{name}." if name else "")


def _names_by_slot(rt) -> dict:
    names: dict = {}
    for name, slot in rt.slots_by_name().items():
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


def _hidden(directory: str, what: str) -> str:
    """A hidden sibling of ``directory``: where its next version is written (``tmp``), or
    where the old one waits while they swap (``old``)."""
    return os.path.join(os.path.dirname(directory),
                        f".{os.path.basename(directory)}.zerofn-{what}")


def _save_problems(directory: str, tmp: str, entries: list[Entry]) -> list[str]:
    """Rank 0, before any gather: can it write there at all?"""
    bad = sorted({str(e.dtype) for e in entries if e.dtype not in DTYPES})
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


def _pieces(rt, slot, ranks: torch.Tensor) -> list[torch.Tensor]:
    """A parameter's rows as they lie in the gathered buffer, rank after rank: written one
    after the other they are the full tensor's bytes, with no full copy made."""
    out = []
    for r in range(rt.world):
        n = local_rows(slot.rows, rt.world, r) * slot.inner
        out.append(ranks[r, slot.offset:slot.offset + n])
    return out


def _complete(model, entries: list[Entry], directory: str, tmp: str) -> None:
    """Rank 0, once the weights are written: the configs, then the swap into place."""
    _write_configs(model, entries, tmp)
    _swap_into_place(tmp, directory)


def _write_configs(model, entries: list[Entry], tmp: str) -> None:
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
    directory stays whole until the swap), then swap; as for checkpoints, a crash leaves
    both complete directories under hidden names or the new one in place."""
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            if not _OWNED.match(entry):
                fs.link_tree(os.path.join(directory, entry), os.path.join(tmp, entry))
    fs.replace(tmp, directory, aside=_hidden(directory, "old"))
