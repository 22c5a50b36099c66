"""load_pretrained: safetensors weights into a zerofn model, each rank reading its own rows.

[Note: rows only] A parameter's master is split by rows across ranks (units.py's layout),
so loading reads, on each rank, only this rank's rows of each tensor: safetensors slicing
reads just those bytes of the memory-mapped file. The runtime then refreshes the compute
parameters from the masters, as ``set_model_state_dict`` does (an all-gather for ZeRO-1/2,
whose compute parameters are whole on every rank). Buffers are small and read whole.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ...core.units import ParamSlot
from ...runtime import runtime_of
from ...runtime.agree import agree_or_raise
from ...state.hooks import hooked_modules, plain_keys, take_state, within
from .safetensors_writer import DTYPES, INDEX_NAME, SINGLE_NAME

_LISTED = 20     # keys named per kind in an error; the rest are counted
_DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}


def load_pretrained(model: nn.Module, path, *, rename=None, strict: bool = True):
    """Fill a zerofn model from safetensors weights; each rank reads only its own rows.

    Call on every rank, after the transforms. Works for every stage, under
    ``mixed_precision`` and ``offload``; tensors are converted to the model's dtypes. A
    module whose own load hooks shape what it takes (merging a fused projection's split
    tensors, accepting an old parameter name) loads through its own ``load_state_dict``:
    what a hook only renames is still read by rows, what it merges is read whole.

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
    model = rt.model     # (the module itself, where torch.compile wraps it)
    rt.prepare_state_dict()
    with contextlib.ExitStack() as files:
        what = f"load_pretrained({os.fspath(path)!r}) failed"
        try:
            plan, taken, missing, unexpected, problems = _load_plan(model, rt, path, rename,
                                                                    files)
        except Exception as e:  # a bad file on one rank must not leave the others waiting
            plan, taken, missing, unexpected = {}, [], [], []
            problems = [f"{type(e).__name__}: {e}"]
        if strict:
            problems += _key_problems(missing, unexpected)
        agree_or_raise(problems, rt.group, what)
        problems = _read_rows(rt, model, plan, taken)
        agree_or_raise(problems, rt.group, what)  # before refresh_params' gathers
        rt.refresh_params()
    return _IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def _read_rows(rt, model, plan: dict, taken: list) -> list[str]:
    """Read this rank's rows of every parameter's master, and every buffer whole; then
    write what the hooked modules' loads gave."""
    buffers, key = dict(model.named_buffers()), None
    try:
        for target, (reader, key) in plan.items():
            if isinstance(target, str):
                buffers[target].copy_(reader.get_tensor(key))
            elif target.local:
                start = target.rank * target.chunk
                rt.write_master_rows(target, reader.get_slice(key)[start:start + target.local])
        for target, value in taken:
            if isinstance(target, ParamSlot):
                rt.write_master_rows(target, value)
            else:
                buffers[target].copy_(value)
    except Exception as e:  # reported on every rank by the caller
        return [f"reading {key!r} failed: {type(e).__name__}: {e}"]
    return []


def _load_plan(model, rt, path, rename, files: contextlib.ExitStack):
    """What to read from where: ``{slot or buffer name: (reader, file key)}``; what the
    hooked modules' own loads give (``[(slot or buffer name, this rank's value)]``); and
    the missing keys, unexpected keys and problems."""
    by_model_name, problems = _by_model_name(os.fspath(path), rename, files)
    hooked = hooked_modules(model, load=True)
    slots = rt.slots_by_name()
    plan, missing, unexpected = _plain_plan(model, slots, by_model_name, hooked)
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    taken = []
    for prefix, module in hooked:
        more_plan, more_taken, lacks, extra = _hooked_plan(rt, prefix, module, by_model_name,
                                                           buffer_names)
        plan.update(more_plan)
        taken += more_taken
        missing += lacks
        unexpected += extra
    filled = set(plan) | {t for t, _ in taken}    # a tied parameter needs one name
    missing = [n for n in missing if slots.get(n, n) not in filled]
    problems += _shape_problems(model, plan)
    return plan, taken, missing, unexpected, problems


def _by_model_name(path: str, rename, files: contextlib.ExitStack):
    """``{model name: (reader, file key)}`` for every tensor of the file(s) ``rename``
    keeps, and the names two file keys map to."""
    located = _locate(path)
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
    return by_model_name, problems


def _plain_plan(model, slots: dict, by_model_name: dict, hooked):
    """The plan, missing and unexpected keys outside every hooked module, by name."""
    free = (lambda n: not any(within(n, prefix) for prefix, _ in hooked))
    expected = [n for n in plain_keys(model) if free(n)]
    plan, missing = {}, []
    for name in expected:
        target = slots.get(name, name)
        if name in by_model_name and target not in plan:
            plan[target] = by_model_name[name]
    for name in expected:
        if slots.get(name, name) not in plan:
            missing.append(name)
    known = set(expected)
    unexpected = [n for n in by_model_name if n not in known and free(n)]
    return plan, missing, unexpected


def _hooked_plan(rt, prefix: str, module, by_model_name: dict, buffer_names: dict):
    """What a module whose own load hooks shape what it takes (an old name accepted, split
    keys merged) takes, through its own ``load_state_dict`` (state/hooks.py).

    A first load over shape-only stand-ins shows where each of its tensors goes: one the
    hooks only renamed is read by rows like any other (``plan``); only what they made anew
    (a merge) is loaded again from tensors read whole, each rank keeping its rows
    (``taken``). A hook that needs values (the first load fails) has everything read
    whole. Returns those, and the keys missing and unexpected after the hooks."""
    dot = f"{prefix}." if prefix else ""
    mine = {n[len(dot):]: found for n, found in by_model_name.items() if within(n, prefix)}
    stand_ins = {k: _stand_in(*found) for k, found in mine.items()}
    try:
        probe = take_state(rt, module, dict(stand_ins), strict=False)
    except Exception:
        probe = None
    plan, made = {}, set()
    if probe is not None:
        key_of = {id(v): k for k, v in stand_ins.items()}
        for target, value in _targets(probe, buffer_names):
            if id(value) in key_of:       # handed over as it is: read by rows
                plan[target] = mine[key_of[id(value)]]
            else:
                made.add(target)
        if not made:
            return plan, [], [dot + k for k in probe.missing], [dot + k for k in probe.unexpected]
    by_rows = {id(found) for found in plan.values()}
    values = {k: stand_ins[k] if id(found) in by_rows else found[0].get_tensor(found[1])
              for k, found in mine.items()}
    got = take_state(rt, module, values, strict=False)
    taken = [(t, t.rows_of(v.detach()).clone() if isinstance(t, ParamSlot) else v.detach())
             for t, v in _targets(got, buffer_names) if probe is None or t in made]
    return plan, taken, [dot + k for k in got.missing], [dot + k for k in got.unexpected]


def _targets(taken, buffer_names: dict) -> list:
    """``(slot or buffer name, value)`` for each registration a load gave a value."""
    return taken.params + [(buffer_names[id(b)], v) for b, v in taken.buffers]


def _stand_in(reader, key: str) -> nn.Parameter:
    """A file tensor's shape and dtype, no data: a Parameter, so that load_state_dict(
    assign=True) hands it to a parameter as it is, and where it went can be told."""
    piece = reader.get_slice(key)
    dtype = _DTYPE_OF.get(piece.get_dtype(), torch.float32)
    return nn.Parameter(torch.empty(piece.get_shape(), dtype=dtype, device="meta"),
                        requires_grad=False)


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
