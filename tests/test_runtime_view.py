"""The runtime's surface is a type: every module outside zerofn/runtime/ uses of a runtime
only the members ``RuntimeView`` declares (zerofn/runtime/view.py), calls nothing on its
optimizer that torch's optimizers lack, imports from runtime/'s modules only what
``IMPORTABLE`` lists, and reads or writes a slot's runtime state (``SLOT_STATE``) only
through the view. The test reads the source: a runtime is what ``runtime_of(...)``
returns, a name assigned from it, and the ``rt`` an observer is attached to
(``attach(rt)``, ``self.rt``).

The parameter state the runtime makes at set-up has one owner, its table
(zerofn/runtime/param_table.py): core's layout declares none of it, and every module, the
runtime's too, reaches it in one form, ``table[key].field``."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import torch
import torch.nn as nn

from support.ranks import run_ranks
from zerofn.core.units import ParamSlot, Unit
from zerofn.runtime import __all__ as PACKAGE_NAMES
from zerofn.runtime.param_table import SlotState, UnitState
from zerofn.runtime.view import IMPORTABLE, SLOT_STATE, SURFACE, RuntimeView

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zerofn"


def _is_runtime_of(node) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "runtime_of" \
        or isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "runtime_of"


def uses(source: str) -> list[tuple[int, str]]:
    """``(line, member)`` for each member of a runtime the source uses."""
    tree = ast.parse(source)
    names = {"rt"}                      # observers are attached to ``rt``
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_runtime_of(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if _is_runtime_of(base) or isinstance(base, ast.Name) and base.id in names or \
                isinstance(base, ast.Attribute) and base.attr == "rt" and \
                isinstance(base.value, ast.Name) and base.value.id == "self":
            out.append((node.lineno, node.attr))
    return out


OPTIMIZER = frozenset(dir(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)))


def _optimizer_uses(tree, names: set) -> list[tuple[int, str]]:
    """``(line, member)`` for ``rt.optimizer.member`` that torch's optimizers lack: a
    method zerofn would have patched onto the user's optimizer."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "optimizer" and node.attr not in OPTIMIZER:
            base = node.value.value
            if _is_runtime_of(base) or isinstance(base, ast.Name) and base.id in names:
                out.append((node.lineno, f"optimizer.{node.attr}"))
    return out


def _internal_imports(tree, relative_depth: int) -> list[tuple[int, str]]:
    """``(line, "module.name")`` for each name imported from a module inside runtime/ that
    ``IMPORTABLE`` does not list (``relative_depth``: how far the file is below zerofn/)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:            # relative: resolve against zerofn/
            if node.level != relative_depth + 1:
                continue
        elif module.startswith("zerofn."):
            module = module[len("zerofn."):]
        else:
            continue
        if module == "runtime":
            out += [(node.lineno, a.name) for a in node.names if a.name not in PACKAGE_NAMES]
        elif module.startswith("runtime."):
            inner = module[len("runtime."):]
            out += [(node.lineno, f"{inner}.{a.name}") for a in node.names
                    if a.name not in IMPORTABLE.get(inner, ())]
    return out


def _slot_state(tree) -> list[tuple[int, str]]:
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in SLOT_STATE]


def past_the_view(source: str, relative_depth: int = 1) -> list[tuple[int, str]]:
    """Every use in ``source`` beyond the view: members, patched optimizer methods,
    internal imports and slot state."""
    tree = ast.parse(source)
    names = {"rt"} | {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                      and _is_runtime_of(node.value) for t in node.targets
                      if isinstance(t, ast.Name)}
    found = [(line, name) for line, name in uses(source) if name not in SURFACE]
    found += _optimizer_uses(tree, names) + _internal_imports(tree, relative_depth)
    return sorted(found + _slot_state(tree))


def test_no_module_outside_the_runtime_uses_more_than_its_view():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if "runtime" in parts[:1]:
            continue
        bad = past_the_view(path.read_text(), len(parts) - 1)
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    assert not found, f"uses outside RuntimeView (zerofn/runtime/view.py): {found}"


def test_the_check_finds_a_planted_use():
    planted = ("from zerofn.runtime import runtime_of\n"
               "def f(model):\n"
               "    rt = runtime_of(model)\n"
               "    rt.homes.step()\n"
               "    runtime_of(model).reducer.zero_grad()\n"
               "    return rt.device\n")
    assert past_the_view(planted) == [(4, "homes"), (5, "reducer")]


def test_the_check_finds_a_planted_patched_method_internal_import_and_slot_state():
    planted = ("from ..runtime import runtime_of, Runtime\n"
               "from ..runtime.comm import Comm, gloo_scratch\n"
               "from zerofn.runtime.homes import Homes\n"
               "def f(model, slot):\n"
               "    rt = runtime_of(model)\n"
               "    rt.optimizer.scale(1.0)\n"
               "    rt.optimizer.step()\n"
               "    slot.opt_param.zero_()\n"
               "    return slot.sharded\n")
    assert past_the_view(planted) == [(1, "Runtime"), (2, "comm.gloo_scratch"),
                                      (3, "homes.Homes"), (6, "optimizer.scale"),
                                      (8, "opt_param"), (9, "sharded")]


TABLE_FIELDS = frozenset(f.name for cls in (SlotState, UnitState)
                         for f in dataclasses.fields(cls))
# Fields whose name nothing else uses: every use, read or write, is on a table entry.
# ``shard`` is also a process group's (mesh.py's ``groups.shard``): its writes are checked.
ONLY_ON_TABLE = frozenset({"opt_param", "sharded"})


def _on_table(node: ast.Attribute) -> bool:
    """Whether the attribute is a field of an entry of the runtime's table:
    ``table[key].field`` or ``<obj>.table[key].field``."""
    base = node.value
    return isinstance(base, ast.Subscript) and (
        getattr(base.value, "id", None) == "table" or getattr(base.value, "attr", None) == "table")


def _written(tree) -> list[ast.expr]:
    """Every target an assignment writes, tuples unpacked."""
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
    out = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        else:
            out.append(t)
    return out


def off_the_table(source: str) -> list[tuple[int, str]]:
    """``(line, field)`` for each use of the table's state not in the table's one form: any
    use of ``opt_param`` or ``sharded``, and any write of ``shard`` (an assignment or a
    ``setattr``), on anything but ``table[key]``."""
    tree = ast.parse(source)
    found = [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr in ONLY_ON_TABLE and not _on_table(n)]
    found += [(t.lineno, t.attr) for t in _written(tree) if isinstance(t, ast.Attribute)
              and t.attr in TABLE_FIELDS - ONLY_ON_TABLE and not _on_table(t)]
    found += [(n.lineno, n.args[1].value) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr"
              and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)
              and n.args[1].value in TABLE_FIELDS]
    return sorted(set(found))


def test_every_module_reaches_the_parameter_state_through_the_table_alone():
    found = {str(path.relative_to(PACKAGE)): bad for path in PACKAGE.rglob("*.py")
             if (bad := off_the_table(path.read_text()))}
    assert not found, f"parameter state outside runtime/param_table.py's table: {found}"


def test_the_check_finds_a_planted_write_of_the_state_from_core_or_outside_the_runtime():
    # as core/units.py might fill a slot, and io/ or the runtime in the old form would
    planted = ("def lay_out(unit, table, rows, p):\n"
               "    for slot in unit.slots:\n"
               "        slot.opt_param = slot.shard_of(rows)\n"
               "    unit.shard, other.sharded = rows, p\n"
               "    setattr(unit, 'shard', rows)\n"
               "    table[slot].opt_param = rows\n"
               "    self.table[unit].shard = rows\n"
               "    return groups.shard, table[slot].sharded\n")
    assert off_the_table(planted) == [(3, "opt_param"), (4, "shard"), (4, "sharded"),
                                      (5, "shard")]
    assert past_the_view(planted) == [(3, "opt_param"), (4, "sharded"), (6, "opt_param"),
                                      (8, "sharded")]
    # the same write appended to core's own layout, and to a checkpoint module
    write = "\ndef fill(slot, rows):\n    slot.opt_param = rows\n"
    for module in ("core/units.py", "io/checkpoint/api.py"):
        source = (PACKAGE / module).read_text()
        line = source.count("\n") + 3
        assert off_the_table(source) == [] and off_the_table(source + write) == \
            [(line, "opt_param")], module


def _declared_state(*classes) -> dict[str, set[str]]:
    return {c.__name__: {f.name for f in dataclasses.fields(c)} & TABLE_FIELDS
            for c in classes if {f.name for f in dataclasses.fields(c)} & TABLE_FIELDS}


def test_core_declares_none_of_the_runtime_state():
    """The layout (core/units.py) holds no field of the table's; a planted one is found."""
    assert _declared_state(ParamSlot, Unit) == {}

    @dataclasses.dataclass
    class Planted(ParamSlot):
        opt_param: object = None

    assert _declared_state(ParamSlot, Unit, Planted) == {"Planted": {"opt_param"}}


def _missing_data_attributes(rank, world, names):
    import zerofn as zf
    from zerofn.runtime import runtime_of
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, _ = zf.shard_params()(model, torch.optim.AdamW(model.parameters()))
    rt = runtime_of(model)
    return [n for n in names if not hasattr(rt, n)]


def test_the_runtime_has_every_data_attribute_of_its_view():
    """Each attribute the view declares is there on a real runtime; a planted declaration
    the runtime lacks is found."""
    names = list(RuntimeView.__annotations__) + ["planted_step_count"]
    assert run_ranks(1, _missing_data_attributes, names) == [["planted_step_count"]]


def test_the_runtime_has_every_member_of_its_view():
    from zerofn.runtime.runtime import Runtime
    declared = {n for n in dir(RuntimeView) if not n.startswith("_")}
    methods = {n for n in declared if callable(getattr(RuntimeView, n))}
    missing = [n for n in methods if not hasattr(Runtime, n)]
    assert not missing, missing
    assert SURFACE >= set(RuntimeView.__annotations__)
