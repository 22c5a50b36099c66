"""The oldest Python zerofn supports: pyproject.toml's ``requires-python``, which the
README states too. No module under zerofn/, tools/ or tests/ may use syntax or a known
standard-library name newer than it. The suite itself runs on one interpreter, so this
reads the source instead: ``ast.parse(feature_version=...)`` for the syntax, and a list of
names for the library (best effort, as the syntax check is)."""
from __future__ import annotations

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Names that exist only from a given Python version, looked for as attributes, names and
# imports. Only names specific enough not to be a project's own.
NEWER_NAMES = {
    "add_note": (3, 11), "__notes__": (3, 11), "ExceptionGroup": (3, 11),
    "BaseExceptionGroup": (3, 11), "tomllib": (3, 11), "TaskGroup": (3, 11),
    "StrEnum": (3, 11), "assert_never": (3, 11), "reveal_type": (3, 11),
    "batched": (3, 12), "override": (3, 12), "TypeAliasType": (3, 12),
    "deprecated": (3, 13), "PythonFinalizationError": (3, 13),
}
# tomllib is used by this test, which reads the floor: the floor is at least 3.11.
ALLOWED = {("tests/test_python_floor.py", "tomllib")}


def floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m, f"requires-python is {spec!r}; this test reads only '>=3.X'"
    return 3, int(m.group(1))


def sources():
    for folder in ("zerofn", "tools", "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield ROOT / "setup.py"


def newer_names(tree: ast.AST, version: tuple[int, int]) -> set[str]:
    """Names in ``tree`` from ``NEWER_NAMES`` that ``version`` does not have."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        found |= {n for n in names if NEWER_NAMES.get(n, (0, 0)) > version}
    return found


def test_the_readme_states_the_declared_floor():
    major, minor = floor()
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python ≥ (3\.\d+)", readme))
    assert stated == {f"{major}.{minor}"}, (stated, floor())


def test_every_module_parses_at_the_floor():
    bad = []
    for path in sources():
        try:
            ast.parse(path.read_text(), str(path), feature_version=floor())
        except SyntaxError as e:
            bad.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, f"syntax newer than Python {floor()}:\n" + "\n".join(bad)


def test_no_module_uses_a_library_name_newer_than_the_floor():
    bad = []
    for path in sources():
        rel = str(path.relative_to(ROOT))
        names = newer_names(ast.parse(path.read_text()), floor())
        bad += [f"{rel}: {n} (Python {'.'.join(map(str, NEWER_NAMES[n]))})"
                for n in sorted(names) if (rel, n) not in ALLOWED]
    assert not bad, f"newer than the declared Python {floor()}:\n" + "\n".join(bad)


def test_the_name_check_sees_an_exception_note():
    """What 3.10 lacked: ``BaseException.add_note`` (zerofn's failure notes use it)."""
    tree = ast.parse("try:\n    f()\nexcept ValueError as e:\n    e.add_note('x')\n    raise\n")
    assert newer_names(tree, (3, 10)) == {"add_note"}
    assert newer_names(tree, (3, 11)) == set()
