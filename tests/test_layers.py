"""The package's layers (docs/design.md, "The house"): every import in zerofn/, lazy ones
inside functions included, runs down a layer or within one, never up, and no modules
import each other in a circle. The test reads the source, so it sees imports no test
happens to run. And docs/design.md's map ("Where things are") names every module of
zerofn/, and none that is not there."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zerofn"

# Each top-level room of zerofn/ and the rooms it may import from (its own always).
LAYERS = {
    "models": set(),                  # nanogpt.py, data/: plain torch
    "optim": set(),                   # the C++ kernels (its extension, zerofn._C, too)
    "core": set(),                    # what is asked: the plan, the units, the formulas
    "runtime": {"core", "optim"},
    "state": {"core", "runtime"},
    "observe": {"core", "runtime", "state"},
    "io": {"core", "runtime", "state", "observe"},
    "api": {"core", "runtime", "observe"},   # the transforms: a plan applied builds a runtime
    "adapters": {"core", "runtime", "state", "observe", "io", "api", "face", "models"},
    "programs": {"core", "runtime", "state", "observe", "io", "api", "face", "models",
                 "adapters", "optim"},
}
ROOM_OF = {"nanogpt": "models", "data": "models", "_C": "optim", "optim": "optim",
           "core": "core", "runtime": "runtime", "state": "state", "observe": "observe",
           "io": "io", "api": "api", "config": "api", "deepspeed": "adapters", "integrations": "adapters",
           "train": "programs", "cli": "programs", "report": "programs",
           "planner": "programs",
           "__main__": "programs", "__init__": "face",
           # faces that keep a documented path: each re-exports from its room
           "checkpoint": "io", "consolidate": "io", "pretrained": "io", "state_dict": "state"}
# The face imports every room but the adapters, which it loads lazily (PEP 562).
LAYERS["face"] = set(LAYERS) - {"adapters", "face"}


def modules() -> dict[str, pathlib.Path]:
    out = {"zerofn._C": PACKAGE / "_C"}     # the extension (no source here)
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, known) -> set[str]:
    """The zerofn modules ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # a submodule imported by name depends on it, not on the package's face
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def missing(known) -> list[str]:
    """zerofn names imported that no module holds (a module moved, its importer not): a
    stale import is found here, not only when its code happens to run."""
    out = []
    for name, path in known.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                      .startswith("zerofn")):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    if base not in known and f"{base}.{a.name}" not in known:
                        out.append(f"{name}: from {base} import {a.name}")
                    elif base in known and f"{base}.{a.name}" not in known and \
                            known[base].name == "__init__.py" and not _defines(known[base], a.name):
                        out.append(f"{name}: from {base} import {a.name}")
    return out


def _defines(init: pathlib.Path, name: str) -> bool:
    """Whether a package's ``__init__`` binds ``name`` (or loads it lazily, PEP 562)."""
    tree = ast.parse(init.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name).split(".")[0] == name for a in node.names):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in node.targets):
            return True
        if isinstance(node, ast.Constant) and node.value == name:   # (a lazy name's string)
            return True
    return False


def room(module: str) -> str:
    parts = module.split(".")
    return ROOM_OF["__init__"] if len(parts) == 1 else ROOM_OF[parts[1]]


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    lazy_face = {"zerofn"}      # (its deepspeed import is in __getattr__, checked below)
    out = []
    for module, targets in graph.items():
        for target in targets:
            mine, theirs = room(module), room(target)
            if theirs != mine and theirs not in LAYERS[mine] and not (
                    module in lazy_face and theirs == "adapters"):
                out.append(f"{module} ({mine}) imports {target} ({theirs})")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: imports_of(name, path, known) if path.suffix == ".py" else set()
             for name, path in known.items()}
    # A package's face re-exporting its own modules is not a circle with them.
    return {m: {t for t in ts if not (t.startswith(m + ".") and known[m].name == "__init__.py")
                or m == "zerofn"}
            for m, ts in graph.items()}


def test_every_import_runs_down_a_layer_and_none_in_a_circle():
    graph = import_graph()
    unplaced = sorted({m.split(".")[1] for m in graph if "." in m} - set(ROOM_OF))
    assert not unplaced, f"rooms without a layer: {unplaced}; add them to ROOM_OF"
    assert forbidden(graph) == []
    assert circles(graph) == []


def test_every_zerofn_import_names_something_that_exists():
    assert missing(modules()) == []


def test_the_check_finds_an_upward_import_and_a_circle():
    graph = import_graph()
    planted = {**graph, "zerofn.core.plan": graph["zerofn.core.plan"] | {"zerofn.runtime.step_grads"}}
    assert forbidden(planted) == ["zerofn.core.plan (core) imports zerofn.runtime.step_grads (runtime)"]
    planted["zerofn.runtime.step_grads"] = graph["zerofn.runtime.step_grads"] | {"zerofn.runtime.grads"}
    planted["zerofn.runtime.grads"] = graph["zerofn.runtime.grads"] | {"zerofn.runtime.step_grads"}
    assert ["zerofn.runtime.grads", "zerofn.runtime.step_grads"] in circles(planted)


@pytest.mark.parametrize("module", ["zerofn.core.plan", "zerofn.runtime.runtime"])
def test_lazy_imports_inside_functions_are_seen(module, tmp_path):
    source = modules()[module].read_text() + "\n\ndef _planted():\n    from zerofn.train import main\n"
    path = tmp_path / "planted.py"
    path.write_text(source)
    assert "zerofn.train" in imports_of(module, path, modules())


DESIGN = PACKAGE.parent / "docs" / "design.md"
# Folders the map heads that hold no __init__.py (namespace packages).
_FOLDERS_WITHOUT_INIT = {p.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.iterdir()
                         if p.is_dir() and not (p / "__init__.py").exists()
                         and any(p.glob("*.py"))}


def mapped(design: str) -> set[str]:
    """The modules docs/design.md's map ("Where things are") names: the backquoted names in
    the first cell of each of its table's rows."""
    section = design.split("### Where things are", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| ")]
    return {name for cell in rows[1:] for name in re.findall(r"`([^`]+)`", cell)}


def map_names() -> set[str]:
    """What the map must name: each module's path below zerofn/, a package's
    ``__init__.py`` as its folder (``runtime/homes/``); the face, ``__init__.py``."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        out.add(rel[:-len("__init__.py")] if rel.endswith("/__init__.py") else rel)
    return out


def test_the_design_map_names_every_module_and_no_other():
    names, listed = map_names(), mapped(DESIGN.read_text())
    assert sorted(names - listed) == [], "modules missing from docs/design.md's map"
    assert sorted(listed - names - _FOLDERS_WITHOUT_INIT) == [], \
        "names in docs/design.md's map that are no module of zerofn/"


def test_the_map_check_finds_a_missing_and_a_stale_module():
    design = DESIGN.read_text()
    row = "| `runtime/param_table.py` |"
    assert row in design
    without = design.replace(row, "| `runtime/homes.py` |")
    assert sorted(map_names() - mapped(without)) == ["runtime/param_table.py"]
    assert sorted(mapped(without) - map_names() - _FOLDERS_WITHOUT_INIT) == ["runtime/homes.py"]
