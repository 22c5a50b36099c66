"""``.. public-names:: MODULE``: the reference entry of every name in ``MODULE.__all__``.

The page list is not written by hand: each page holds one directive, and the directive
reads the module's ``__all__`` when the reference is built, so a name added to
``__all__`` is documented without touching these files. Each name is documented where it
is exported (``zerofn.from_deepspeed_config`` and ``zerofn.deepspeed.from_deepspeed_config``
are two entries, the second pointing at the first), with autodoc for functions, classes
and zerofn's own modules, and ``py:data`` for values, whose text is the ``#:`` comment
above the line that binds the name (followed into the zerofn module it was imported from).

A public name without a docstring (a value without a ``#:`` comment) is a warning, which
``sphinx-build -W`` makes an error.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import types

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


def public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``; a module without one has not declared its public names."""
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"{module.__name__} is public but has no __all__")
    return list(names)


def member(module: types.ModuleType, name: str):
    """``module.name``, importing a submodule named in ``__all__`` as ``import *`` does."""
    try:
        return getattr(module, name)
    except AttributeError:
        return importlib.import_module(f"{module.__name__}.{name}")


def _comment_above(lines: list[str], lineno: int) -> list[str]:
    """The ``#:`` lines right above line ``lineno`` (1-based), without their marker."""
    out = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        out.insert(0, lines[i].lstrip()[2:].removeprefix(" "))
        i -= 1
    return out


def value_doc(module_name: str, name: str, depth: int = 0) -> list[str]:
    """The ``#:`` comment documenting module-level ``name`` in ``module_name``, following a
    ``from zerofn... import name`` without one to where the name is defined."""
    module = sys.modules[module_name]
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return []
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return _comment_above(lines, node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) != name:
                    continue
                doc = _comment_above(lines, node.lineno)
                if doc or not isinstance(node, ast.ImportFrom) or depth > 4:
                    return doc
                package = module_name if hasattr(module, "__path__") else module_name.rpartition(".")[0]
                source_module = (importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                             package)
                                 if node.level else node.module)
                if source_module.split(".")[0] == "zerofn" and source_module in sys.modules:
                    return value_doc(source_module, alias.name, depth + 1)
                return doc
    return []


def own_module(obj) -> bool:
    """Whether ``obj`` is a module of zerofn's (documented by autodoc, not as a value)."""
    return isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] == "zerofn"


def own_doc(obj) -> str | None:
    """The object's own docstring: not one inherited from a base class."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__")
    return getattr(obj, "__doc__", None)


def documented_by_autodoc(obj) -> bool:
    """A class, function or zerofn module: autodoc documents it from its docstring."""
    return inspect.isclass(obj) or inspect.isroutine(obj) or own_module(obj)


def canonical_names(module_names: list[str]) -> dict[int, str]:
    """``id(object)`` -> the first public name it has, over the modules in this order (for
    classes, functions and modules only: equal values may be one cached object)."""
    first: dict[int, str] = {}
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            obj = member(module, name)
            if documented_by_autodoc(obj):
                first.setdefault(id(obj), f"{module_name}.{name}")
    return first


# A name exported again after its first export -> the first name: its entry points there.
ALIASES: dict[str, str] = {}


class PublicNames(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        first = canonical_names(self.config.zerofn_public_modules)
        rst: list[str] = []
        for name in public_names(module):
            self._entry(module_name, name, member(module, name), first, rst)
        rst += [f".. py:currentmodule:: {module_name}", ""]
        content = StringList(rst, source=f"<public-names {module_name}>")
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(content, 0, node)
        return node.children

    def _missing(self, full: str, what: str) -> None:
        logger.warning("public name %s has no %s", full, what,
                       location=self.get_location(), type="zerofn", subtype="undocumented")

    def _entry(self, module_name: str, name: str, obj, first, rst: list[str]) -> None:
        full = f"{module_name}.{name}"
        canonical = first.get(id(obj), full) if documented_by_autodoc(obj) else full
        if canonical != full:
            ALIASES[full] = canonical
        elif documented_by_autodoc(obj) and not (own_doc(obj) or "").strip():
            self._missing(full, "docstring")
        if own_module(obj) and canonical == full:
            if not hasattr(obj, "__all__"):
                self._missing(full, "__all__ (its public names)")
                return
            rst += [f".. automodule:: {obj.__name__}", ""]
            for name_ in public_names(obj):
                self._entry(obj.__name__, name_, member(obj, name_), first, rst)
            rst += [f".. py:currentmodule:: {module_name}", ""]
        elif inspect.isclass(obj):
            kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
            rst += [f".. {kind}:: {full}"] + (["   :members:"] if canonical == full else []) + [""]
        elif inspect.isroutine(obj):
            rst += [f".. autofunction:: {full}", ""]
        else:   # a value, or a module not zerofn's: documented by its "#:" comment
            doc = value_doc(module_name, name) if canonical == full else [
                f"The same module as :mod:`{canonical}`, documented there."]
            if not doc:
                self._missing(full, "'#:' comment")
            rst += [f".. py:data:: {name}", f"   :module: {module_name}"]
            if isinstance(obj, types.ModuleType):
                rst += [f"   :type: module {obj.__name__}"]
            elif isinstance(obj, (int, float, str, bool)):
                rst += [f"   :value: {obj!r}"]
            rst += [""] + [f"   {line}" if line else "" for line in doc] + [""]


def alias_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    """A name exported again elsewhere points at its first entry instead of repeating it."""
    canonical = ALIASES.get(name)
    if canonical:
        role = {"function": "func", "class": "class", "exception": "exc"}.get(what, "obj")
        lines[:] = [f"The same {what} as :{role}:`{canonical}`, documented there.", ""]


def setup(app):
    app.add_config_value("zerofn_public_modules", [], "env")
    app.add_directive("public-names", PublicNames)
    app.connect("autodoc-process-docstring", alias_docstring)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
