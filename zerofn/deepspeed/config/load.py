"""Reading a DeepSpeed config in: the dict, file or base64 it comes as, and the checks
DeepSpeed makes or skips before using it (duplicate keys, removed keys, unknown keys)."""
from __future__ import annotations

import base64
import binascii
import copy
import difflib
import json
import math
import os
import warnings

from .. import keys as K
from .settings import DeepSpeedConfigWarning


def load_config(config_or_path) -> dict:
    """A private copy of the config: a dict, a JSON file's path, or base64 JSON (as DeepSpeed
    accepts). Duplicate keys in a file are an error, as in DeepSpeed."""
    if isinstance(config_or_path, dict):
        return copy.deepcopy(config_or_path)
    if isinstance(config_or_path, (str, os.PathLike)):
        path = os.fspath(config_or_path)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f, object_pairs_hook=_no_duplicates)
        try:
            return json.loads(base64.urlsafe_b64decode(path).decode("utf-8"),
                              object_pairs_hook=_no_duplicates)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"A DeepSpeed config is a dict, the path of a JSON file or base64 JSON; "
                     f"got {config_or_path!r} (no such file).")


def _no_duplicates(pairs) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"DeepSpeed config: key {key!r} appears twice in one section.")
        out[key] = value
    return out


def reject_removed(config: dict) -> None:
    removed = [k for k in K.REMOVED if k in config]
    if removed:
        raise ValueError(f"DeepSpeed config: {removed} were removed from DeepSpeed (0.19.8 "
                         f"refuses them too); delete them from the config.")


def check_sections(config: dict) -> None:
    """Each section zerofn reads into is a JSON object (or the other form DeepSpeed allows
    it): anything else is refused, naming the section, before any of it is read."""
    if not isinstance(config, dict):
        raise ValueError(f"A DeepSpeed config is a JSON object of sections; got "
                         f"{type(config).__name__} {config!r}.")
    for path, forms in K.SECTION_FORMS.items():
        parent, _, name = path.rpartition(".")
        holder = config.get(parent) if parent else config
        if not isinstance(holder, dict) or name not in holder:
            continue
        value = holder[name]
        if not any(value is None if form is None else
                   isinstance(value, form) for form in forms):
            kinds = " or ".join("null" if f is None else "true/false" if f is bool else
                                "an object {...}" for f in forms)
            raise ValueError(f"DeepSpeed config: {path} must be {kinds}; got {value!r}. "
                             f"Write it as DeepSpeed's documentation does, or leave it out.")


def check_values(config: dict) -> None:
    """Each value zerofn acts on is of the kind and range it takes (keys.py's ``VALUES``),
    after "auto" is filled: anything else is refused, naming the key and what it takes."""
    for path, takes in K.VALUES.items():
        *parents, name = path.split(".")
        holder = config
        for parent in parents:
            holder = holder.get(parent) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and name in holder and not _fits(holder[name], takes):
            raise ValueError(f"DeepSpeed config: {path} takes {_described(takes)}; got "
                             f"{holder[name]!r}.")


def _fits(value, takes: K.Takes) -> bool:
    if value is None:
        return takes.null
    if takes.kind in ("bool", "str"):
        return isinstance(value, bool if takes.kind == "bool" else str)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if takes.kind == "int" and not float(value).is_integer():
        return False
    low_ok = takes.low is None or (value > takes.low if takes.above else value >= takes.low)
    return low_ok and (takes.high is None or value <= takes.high)


def _described(takes: K.Takes) -> str:
    kind = {"int": "a whole number", "number": "a number", "bool": "true or false",
            "str": "a string"}[takes.kind]
    if takes.low is not None:
        kind += f" {'above' if takes.above else 'from'} {takes.low:g}"
        kind += f" to {takes.high:g}" if takes.high is not None else \
            ("" if takes.above else " up")
    return kind + (" (or null)" if takes.null else "")


# -- unknown keys -------------------------------------------------------------------------
def _sections(config: dict):
    """``(dotted prefix, section dict, its known keys)`` for every section zerofn checks."""
    yield "", config, K.TOP_KNOWN
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        yield "zero_optimization.", zero, K.ZERO_KNOWN
        for name, known in (("offload_optimizer", K.OFFLOAD_OPTIMIZER_KNOWN),
                            ("offload_param", K.OFFLOAD_PARAM_KNOWN)):
            if isinstance(zero.get(name), dict):
                yield f"zero_optimization.{name}.", zero[name], known
    for name, known in (("fp16", K.FP16_KNOWN), ("bf16", K.BF16_KNOWN),
                        ("bfloat16", K.BF16_KNOWN), ("optimizer", K.OPTIMIZER_KNOWN),
                        ("scheduler", K.SCHEDULER_KNOWN),
                        ("activation_checkpointing", K.ACTIVATION_CHECKPOINTING_KNOWN),
                        ("tensorboard", K.WRITER_KNOWN), ("csv_monitor", K.WRITER_KNOWN)):
        if isinstance(config.get(name), dict):
            yield f"{name}.", config[name], known


def warn_unknown(config: dict) -> None:
    """One warning per key DeepSpeed would ignore silently (a typo, usually), naming the
    closest known key."""
    for prefix, section, known in _sections(config):
        for key in section:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f"did you mean {prefix}{close[0]!r}?" if close else \
                    "no known key is close to it"
                warnings.warn(f"DeepSpeed config: unknown key {prefix}{key!r} (DeepSpeed would "
                              f"ignore it silently); {hint}", DeepSpeedConfigWarning, stacklevel=4)
