"""The runtime's surface is a type: every module outside zerofn/runtime/ uses of a runtime
only the members ``RuntimeView`` declares (zerofn/runtime/view.py). The test reads the
source: a runtime is what ``runtime_of(...)`` returns, a name assigned from it, and the
``rt`` an observer is attached to (``attach(rt)``, ``self.rt``)."""
from __future__ import annotations

import ast
import pathlib

from zerofn.runtime.view import SURFACE, RuntimeView

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


def past_the_view(source: str) -> list[tuple[int, str]]:
    return [(line, name) for line, name in uses(source) if name not in SURFACE]


def test_no_module_outside_the_runtime_uses_more_than_its_view():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "runtime" in path.relative_to(PACKAGE).parts[:1]:
            continue
        bad = past_the_view(path.read_text())
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    assert not found, f"members outside RuntimeView (zerofn/runtime/view.py): {found}"


def test_the_check_finds_a_planted_use():
    planted = ("from zerofn.runtime import runtime_of\n"
               "def f(model):\n"
               "    rt = runtime_of(model)\n"
               "    rt.homes.step()\n"
               "    runtime_of(model).reducer.zero_grad()\n"
               "    return rt.device\n")
    assert past_the_view(planted) == [(4, "homes"), (5, "reducer")]


def test_the_runtime_has_every_member_of_its_view():
    from zerofn.runtime.runtime import Runtime
    declared = {n for n in dir(RuntimeView) if not n.startswith("_")}
    methods = {n for n in declared if callable(getattr(RuntimeView, n))}
    missing = [n for n in methods if not hasattr(Runtime, n)]
    assert not missing, missing
    assert SURFACE >= set(RuntimeView.__annotations__)
