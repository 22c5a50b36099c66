"""scripts/setup.sh's choice of interpreter (scripts/python.sh, which train.sh and test.sh
run too), decided for real interpreters in a temporary checkout holding a copy of scripts/.
``--dry-run`` prints the choice and changes nothing, so nothing is installed. Cases:

- an interpreter in a virtual environment (chosen by PYTHON, VIRTUAL_ENV, CONDA_PREFIX or
  the PATH) is used as it is;
- any other interpreter only makes .venv in the checkout. That .venv sees the
  interpreter's packages where the interpreter imports torch;
- an existing .venv is used, unless PYTHON names an interpreter it was not made from.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The interpreter running the tests, outside its virtual environment if it is in one: what
# a system's or pyenv's Python is to setup.sh.
BASE = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(
    os.path.isdir(os.path.join(sys.base_prefix, "conda-meta")),
    reason="this Python is a conda environment's: there is no interpreter here outside one")


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A checkout holding only what --dry-run reads: scripts/ and pyproject.toml."""
    shutil.copytree(ROOT / "scripts", tmp_path / "checkout" / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "checkout")
    return tmp_path / "checkout"


def plain_python(directory: Path, torch: bool) -> Path:
    """``directory/python3``: BASE, with a module named torch first on its path, empty or
    raising ImportError, so that whether it imports torch does not hang on BASE's packages."""
    stub = directory / ("with_torch" if torch else "without_torch")
    stub.mkdir(parents=True)
    (stub / "torch.py").write_text("" if torch else "raise ImportError('no torch here')\n")
    exe = directory / "python3"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{stub}" exec "{BASE}" "$@"\n')
    exe.chmod(0o755)
    return exe


def virtual_env(path: Path) -> Path:
    """A real virtual environment made from BASE (without pip: nothing is installed)."""
    subprocess.run([BASE, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def dry_run(checkout: Path, path: list[Path], keep_venv: bool = False, **env) -> dict[str, str]:
    """setup.sh --dry-run's decision, with these directories first on the PATH and only
    the given ones of PYTHON, VIRTUAL_ENV and CONDA_PREFIX set."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")}
    base["PATH"] = os.pathsep.join([*map(str, path), "/usr/bin", "/bin"])
    done = subprocess.run([BASH, str(checkout / "scripts" / "setup.sh"), "--dry-run"],
                          env={**base, **{k: str(v) for k, v in env.items()}},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert keep_venv or not (checkout / ".venv").exists(), "--dry-run made .venv"
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def refusal(checkout: Path, python: str) -> str:
    """What setup.sh --dry-run says as it stops, with PYTHON=python."""
    done = subprocess.run([BASH, str(checkout / "scripts" / "setup.sh"), "--dry-run"],
                          env={**os.environ, "PYTHON": python}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done
    return done.stderr


@pytest.mark.parametrize("torch", [True, False], ids=["imports_torch", "no_torch"])
def test_a_python_outside_any_environment_makes_venv_in_the_checkout(checkout, tmp_path, torch):
    python3 = plain_python(tmp_path / "system", torch)
    assert dry_run(checkout, [python3.parent]) == {
        "python": f"{checkout}/.venv/bin/python", "venv": "make", "base": str(python3),
        "system_site_packages": "yes" if torch else "no"}
    # PYTHON chooses the interpreter, and the same rule holds for it.
    assert dry_run(checkout, [], PYTHON=python3) == {
        "python": f"{checkout}/.venv/bin/python", "venv": "make", "base": str(python3),
        "system_site_packages": "yes" if torch else "no"}


def test_an_interpreter_in_a_virtual_environment_is_used_as_it_is(checkout, tmp_path):
    python3 = plain_python(tmp_path / "system", torch=True)
    env = virtual_env(tmp_path / "env")
    used = {"python": f"{env}/bin/python", "venv": "none", "system_site_packages": "no"}
    # Activated (its bin/ first on the PATH), named by VIRTUAL_ENV or CONDA_PREFIX alone
    # (a plain python3 first on the PATH), or chosen with PYTHON.
    assert dry_run(checkout, [env / "bin"]) == {**used, "base": f"{env}/bin/python3",
                                                 "python": f"{env}/bin/python3"}
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        assert dry_run(checkout, [python3.parent], **{name: env}) == {
            **used, "base": f"{env}/bin/python"}
    assert dry_run(checkout, [python3.parent], PYTHON=f"{env}/bin/python") == {
        **used, "base": f"{env}/bin/python"}
    # PYTHON outranks an active environment.
    assert dry_run(checkout, [env / "bin"], VIRTUAL_ENV=env, PYTHON=python3)["venv"] == "make"


def test_an_existing_venv_is_used_unless_python_names_another_interpreter(checkout, tmp_path):
    python3 = plain_python(tmp_path / "system", torch=True)
    venv = virtual_env(checkout / ".venv")
    assert dry_run(checkout, [python3.parent], keep_venv=True) == {
        "python": f"{venv}/bin/python", "venv": "exists", "base": str(python3),
        "system_site_packages": "no"}
    # PYTHON naming .venv's own interpreter (through a symlink here) is no conflict...
    link = tmp_path / "link" / "python"
    link.parent.mkdir()
    link.symlink_to(BASE)
    assert dry_run(checkout, [], PYTHON=link, keep_venv=True)["venv"] == "exists"
    # ...but one .venv was not made from stops set-up, saying what to do.
    cfg = venv / "pyvenv.cfg"
    cfg.write_text("".join(f"executable = {tmp_path}/elsewhere/python3\n"
                           if line.startswith("executable") else line
                           for line in cfg.read_text().splitlines(keepends=True)))
    assert "rm -rf .venv" in refusal(checkout, str(link))


def test_an_interpreter_that_does_not_run_or_is_too_old_is_refused(checkout, tmp_path):
    assert f"cannot run {tmp_path}/nothing" in refusal(checkout, f"{tmp_path}/nothing")
    assert not (checkout / ".venv").exists()
    # The floor is pyproject.toml's requires-python.
    project = checkout / "pyproject.toml"
    project.write_text(re.sub(r'requires-python = ">=[0-9.]+"', 'requires-python = ">=3.99"',
                              project.read_text()))
    assert "zerofn needs 3.99 or later" in refusal(checkout, BASE)
