"""DeepSpeed's ``deepspeed.utils`` ZeRO-3 leaf-module calls, on zerofn's units.

DeepSpeed's ZeRO-3 hooks every submodule and gathers parameters in the order modules
ran; a mixture's experts, run only where some token chose them, then gather on some ranks
and not others, and the ranks hang. Marking the mixture's block a "leaf" makes it gather
all of its parameters when it runs and hook nothing below it. A zerofn unit is that
already: its module's parameters are gathered together when it runs. So here a leaf is a
unit (under ZeRO-3, where units are gathered): ``initialize`` and
``from_deepspeed_config(model=...)`` make every marked module a unit of its own, in
addition to the default units not inside a leaf (``leaf_units``). zerofn's default units
already keep a block's experts inside the block's unit, so unlike DeepSpeed it marks no
classes by default.

Modules are marked as DeepSpeed marks them (``module._z3_leaf``), so a model marked by
DeepSpeed's own calls is read the same.
"""
from __future__ import annotations

from torch import nn

from ..core.units import default_unit_modules

# DeepSpeed's calls; mark_from_config and leaf_units serve the config reader.
__all__ = ["z3_leaf_module", "get_z3_leaf_modules", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]

FLAG = "_z3_leaf"


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked a leaf."""
    return bool(getattr(module, FLAG, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked leaves, in ``model.modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                        ) -> list[nn.Module]:
    """Mark as leaves the modules that are instances of ``leaf_module_classes``: classes,
    or their names, bare (``"MixtralSparseMoeBlock"``) or dotted with their module
    (``"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"``). Returns
    them; raises ValueError where none matched, unless ``raise_if_not_found`` is False."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo ``set_z3_leaf_modules`` for these classes."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):
    """Mark the modules named exactly so in ``model.named_modules()``. Returns ``(marked
    modules, names that matched none)``."""
    return _mark_names(model, module_names, lambda path, name: path == name, flag,
                       raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """Mark the modules whose name in ``model.named_modules()`` ends with a suffix (a
    whole dotted component or more: "experts" matches "layers.0.mlp.experts"). Returns
    ``(marked modules, suffixes that matched none)``."""
    return _mark_names(model, module_name_suffixes,
                       lambda path, suffix: path == suffix or path.endswith("." + suffix),
                       flag, raise_if_not_found)


def mark_from_config(model: nn.Module, section: dict) -> list[str]:
    """Mark the leaves a config's ``zero_optimization.leaf_module`` section names (each of
    ``classes``, ``names``, ``name_suffixes`` one string or a list); returns the entries
    that matched no module."""
    unknown = sorted(set(section) - {"classes", "names", "name_suffixes"})
    if unknown:
        raise ValueError(f"DeepSpeed config: zero_optimization.leaf_module has {unknown}; it "
                         "takes \"classes\", \"names\" and \"name_suffixes\".")
    missing = [c for c in _as_list(section.get("classes", ()))
               if not set_z3_leaf_modules(model, c, raise_if_not_found=False)]
    missing += set_z3_leaf_modules_by_name(model, section.get("names", ()),
                                           raise_if_not_found=False)[1]
    missing += set_z3_leaf_modules_by_suffix(model, section.get("name_suffixes", ()),
                                             raise_if_not_found=False)[1]
    return missing


def leaf_units(model: nn.Module) -> list[nn.Module] | None:
    """zerofn's ``units`` for a model with leaves (None for one without): the default units
    and the leaves, those inside a leaf left out (a leaf hooks nothing below it), in the
    order of ``model.modules()``."""
    leaves = get_z3_leaf_modules(model)
    if not leaves:
        return None
    below = {id(m) for leaf in leaves for m in leaf.modules() if m is not leaf}
    chosen = {id(m) for m in default_unit_modules(model) + leaves if id(m) not in below}
    return [m for m in model.modules() if id(m) in chosen]


def _as_list(items) -> list:
    return [items] if isinstance(items, (str, type)) else list(items)


def _class_matches(module: nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return any(wanted in (c.__name__, f"{c.__module__}.{c.__qualname__}")
               for c in type(module).__mro__)


def _mark_classes(model, classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = _as_list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names; got {bad!r}.")
    marked = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not marked and raise_if_not_found:
        raise ValueError(f"No module of {classes!r} in the model: nothing marked a ZeRO-3 leaf.")
    for m in marked:
        setattr(m, FLAG, flag)
    return marked


def _mark_names(model, wanted, matches, flag: bool, raise_if_not_found: bool):
    wanted = _as_list(wanted)
    named = list(model.named_modules())
    marked, missing = [], []
    for w in wanted:
        hits = [m for path, m in named if matches(path, w)]
        if not hits:
            missing.append(w)
        marked += [m for m in hits if all(m is not k for k in marked)]
    if missing and raise_if_not_found:
        raise ValueError(f"No module of the model is named {missing!r} (names as "
                         "model.named_modules() gives them): nothing marked a ZeRO-3 leaf.")
    for m in marked:
        setattr(m, FLAG, flag)
    return marked, missing
