"""The API reference (docs/api) builds with Sphinx, warnings as errors, and holds an entry for
every public name: each name of the ``__all__`` of ``zerofn``, ``zerofn.deepspeed``,
``zerofn.optim`` and ``zerofn.integrations``, and of the zerofn submodules those list
(``zerofn.deepspeed.utils``, ``zerofn.integrations.transformers``, ...), is in the built
``objects.inv``. A docstring that is bad reStructuredText, or a public name without one,
fails the build (docs/api/_ext/zerofn_public.py). Sphinx and furo come from
scripts/setup.sh; without Sphinx (a GPU machine with no package index) this skips."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="Sphinx is not installed (scripts/setup.sh installs it)")

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["zerofn", "zerofn.deepspeed", "zerofn.optim", "zerofn.integrations"]


def sphinx_build(source: Path, out: Path, env_path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [env_path,
                                                                      os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(source), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)


def inventory(path: Path) -> set[str]:
    """The object names in a Sphinx ``objects.inv`` (version 2: four header lines, then
    zlib-compressed ``name domain:role priority uri dispname`` lines)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    assert data.startswith(b"# Sphinx inventory version 2"), data[:40]
    lines = zlib.decompress(data[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.split(" ")[1].startswith("py:")}


def public_names() -> dict[str, list[str]]:
    """{module: the full names it makes public}: its ``__all__``, and the ``__all__`` of each
    zerofn module it lists."""
    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        names = []
        for each in module.__all__:
            names.append(f"{name}.{each}")
            try:
                obj = getattr(module, each)
            except AttributeError:        # a submodule named in __all__, not yet imported
                obj = importlib.import_module(f"{name}.{each}")
            if isinstance(obj, types.ModuleType) and obj.__name__.startswith("zerofn."):
                names += [f"{obj.__name__}.{sub}" for sub in obj.__all__]
        found[name] = names
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api_html")
    done = sphinx_build(ROOT / "docs" / "api", out, str(ROOT))
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_reference_builds_without_warnings(built):
    assert (built / "index.html").is_file()
    for page in ("zerofn", "deepspeed", "optim", "integrations"):
        assert (built / f"{page}.html").is_file(), page


def test_every_public_name_has_an_entry(built):
    documented = inventory(built / "objects.inv")
    missing = {module: [n for n in names if n not in documented]
               for module, names in public_names().items()}
    assert not any(missing.values()), f"not in the reference: {missing}"
    assert set(MODULES) <= documented


def test_a_public_name_without_a_docstring_fails_the_build(tmp_path):
    """The check itself, on a made-up module: an undocumented function and a value with no
    ``#:`` comment are warnings, so errors under -W; a documented one is not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "madeup_public.py").write_text(
        '"""A module."""\n__all__ = ["documented", "bare", "LIMIT", "NOTED"]\n\n'
        'LIMIT = 3\n#: The noted value.\nNOTED = 4\n\n\n'
        'def documented():\n    """Has one."""\n\n\ndef bare():\n    pass\n')
    source = tmp_path / "src"
    source.mkdir()
    (source / "conf.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'docs' / 'api' / '_ext')!r})\n"
        "extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon', 'zerofn_public']\n"
        "zerofn_public_modules = ['madeup_public']\n")
    (source / "index.rst").write_text("Made up\n=======\n\n.. public-names:: madeup_public\n")
    done = sphinx_build(source, tmp_path / "out", str(tmp_path / "pkg"))
    assert done.returncode != 0
    assert "madeup_public.bare has no docstring" in done.stderr, done.stderr
    assert "madeup_public.LIMIT has no '#:' comment" in done.stderr, done.stderr
    assert "madeup_public.documented" not in done.stderr
    assert "madeup_public.NOTED" not in done.stderr
