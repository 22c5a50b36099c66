"""The tests' own layout: a test file imports helpers from tests/support, never from another
test file, so each can be read, moved or deleted on its own; tools/ imports no test file;
and a script some test launches sits in tests/scripts/."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TOOLS = TESTS.parent / "tools"


def imported(source: str) -> set[str]:
    """Every module ``source`` imports, anywhere in it (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def imports_of_tests(paths) -> dict[str, list[str]]:
    """{file: the test modules (``test_x``, ``tests.test_x``) it imports}, where any."""
    found = {}
    for path in paths:
        names = sorted(n for n in imported(path.read_text())
                       if any(part.startswith("test_") for part in n.split(".")))
        if names:
            found[path.name] = names
    return found


def test_the_check_sees_imports_inside_functions(tmp_path):
    (tmp_path / "test_a.py").write_text("def f():\n    import tests.test_b as b\n"
                                        "    from test_c import x\n")
    assert imports_of_tests([tmp_path / "test_a.py"]) == {"test_a.py": ["test_c",
                                                                       "tests.test_b"]}


def test_no_test_file_imports_another():
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 40 and imports_of_tests(files) == {}, "import from tests/support"


def test_no_tool_imports_a_test_file():
    files = sorted(TOOLS.rglob("*.py"))     # packages of tools (gpu_check/) too
    assert files and imports_of_tests(files) == {}, "import from tests/support"


def test_tests_hold_test_files_and_scripts_hold_scripts_no_test_imports():
    """Beside the test files sit only conftest.py and folders: helpers go in support/, a
    script some test starts (under torchrun, or in a fresh interpreter) in scripts/."""
    loose = [p.name for p in TESTS.glob("*.py")
             if not p.name.startswith("test_") and p.name != "conftest.py"]
    assert loose == [], f"{loose}: helpers go in support/, scripts in scripts/"
    scripts = sorted((TESTS / "scripts").glob("*.py"))
    assert scripts
    for path in scripts:
        assert "__main__" in path.read_text(), f"{path.name} is no script: move it to support/"
    everything = set().union(*(imported(p.read_text()) for p in TESTS.rglob("*.py")))
    names = {p.stem for p in scripts} | {f"scripts.{p.stem}" for p in scripts}
    assert not everything & names
