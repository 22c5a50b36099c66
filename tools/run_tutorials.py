"""Re-executes the notebooks in tutorials/ in a real Jupyter kernel and stores their outputs.

    python tools/run_tutorials.py                 # every tutorial; rewrites those that changed
    python tools/run_tutorials.py 01 fsdp2        # only those whose file name contains 01 or fsdp2
    python tools/run_tutorials.py --check         # execute, write nothing, exit 1 on a change

Each notebook runs top to bottom in a fresh ``python3`` kernel (``nbclient``, ``ipykernel``;
matplotlib inline, so plots are stored as PNG), in a temporary working directory. The
result is written back in place only where it differs from the committed notebook: a code
cell's source, or its outputs as ``outputs_differ`` compares them. So running the tool
after a change that moves no number leaves every file untouched (no churn of PNG bytes),
and a run costs what the notebooks cost, about a minute for all of them on two cores.

The notebook's metadata gets ``zerofn.code_digest``, a digest of its code cells: the fast
test in tests/test_tutorials.py compares it with the cells, so a cell edited without a
re-run is caught without executing anything. What the outputs say is checked by executing:
tests/test_tutorials.py runs every notebook with ``execute`` and compares with
``outputs_differ``. That module's docstring says why there is no digest of zerofn's sources.

Conventions for notebooks (the comparison relies on them):
- seeds everywhere, one intra-op thread, no temporary paths or timings in printed text;
- a cell whose text depends on timing is tagged ``varies`` (cell metadata ``tags``): its
  text is not compared, only that it ran and how many images it showed;
- ``metadata.zerofn.requires``: modules the notebook needs beyond zerofn's own (the test
  skips the notebook, saying why, where one is missing).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
TIMEOUT_S = 300                           # per cell
VARIES = "varies"                         # the tag of cells whose text depends on timing
DIGITS = 2                                # printed floats may differ by 2 units of the last digit
RELATIVE = 3e-4                           # ... or by this fraction of their value
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RERUN = "re-run `python tools/run_tutorials.py {name}` and commit the notebook"


class TutorialError(RuntimeError):
    """A cell raised: the message holds the notebook, the cell's source and the traceback."""


def notebooks(patterns: list[str] | None = None) -> list[Path]:
    """The tutorials, in order; with ``patterns``, those whose file name contains one."""
    found = sorted(TUTORIALS.glob("*.ipynb"))
    return [p for p in found if not patterns or any(s in p.name for s in patterns)]


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    """A cell's source as one string (a file may hold it as a list of lines)."""
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def code_digest(nb: dict) -> str:
    """sha256 over the code cells' sources, in order; markdown does not count.

    Args:
        nb: a notebook, as ``json.load`` or ``nbformat.read`` returns it.

    Returns:
        The hex digest.

    Example:
        >>> code_digest({"cells": [{"cell_type": "code", "source": "1 + 1"}]})[:8]
        '4e227367'
    """
    h = hashlib.sha256()
    for cell in code_cells(nb):
        h.update(source(cell).encode())
        h.update(b"\0")
    return h.hexdigest()


def stored_digest(nb: dict) -> str | None:
    return nb.get("metadata", {}).get("zerofn", {}).get("code_digest")


def stored_problems(nb: dict) -> list[str]:
    """Why a notebook's stored outputs are not one clean run of its code cells, if they are not.

    Checked without executing: the code digest stamped at the run is the cells' digest,
    execution counts are 1, 2, ... in order (one run, top to bottom), no cell stored an
    error or wrote to stderr (a warning shown to every reader).

    Args:
        nb: a notebook, as ``json.load`` returns it.

    Returns:
        One line per problem; empty if there is none.
    """
    cells, problems = code_cells(nb), []
    if stored_digest(nb) != code_digest(nb):
        problems.append("its code cells changed since their outputs were made")
    counts = [c.get("execution_count") for c in cells]
    if counts != list(range(1, len(cells) + 1)):
        problems.append(f"its outputs are not from one run top to bottom (counts {counts})")
    for kind, found in (("stored an error", lambda o: o["output_type"] == "error"),
                        ("wrote to stderr (fix or silence it)", lambda o: o.get("name") == "stderr")):
        bad = [i for i, c in enumerate(cells) if any(found(o) for o in c.get("outputs", []))]
        if bad:
            problems.append(f"code cells {bad} {kind}")
    return problems


def execute(path: Path, timeout: int = TIMEOUT_S):
    """Runs a notebook top to bottom in a fresh kernel and returns it with its new outputs.

    Args:
        path: the .ipynb file (left unchanged).
        timeout: seconds any one cell may run.

    Returns:
        The executed ``nbformat`` notebook, its metadata stamped with ``code_digest``.

    Raises:
        TutorialError: a cell raised; the message names the notebook and the cell, and holds
            the cell's source and the kernel's traceback.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    for cell in code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    with tempfile.TemporaryDirectory(prefix="tutorial-") as cwd:
        # "python3" with argv "python": jupyter_client runs it with this interpreter.
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                record_timing=False, coalesce_streams=True,
                                resources={"metadata": {"path": cwd}})
        try:
            client.execute()
        except CellExecutionError as e:
            index = next((i for i, c in enumerate(code_cells(nb))
                          if any(o.output_type == "error" for o in c.outputs)), "?")
            raise TutorialError(f"{path.name}, code cell {index} failed:\n"
                                f"{ANSI.sub('', str(e))}") from None
    nb.metadata.setdefault("zerofn", {})["code_digest"] = code_digest(nb)
    return nb


def text_of(cell: dict) -> str:
    """What a cell printed and returned, as text: stdout and every text/plain result."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream" and out["name"] == "stdout":
            parts.append(source({"source": out["text"]}))
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(source({"source": out["data"].get("text/plain", "")}) + "\n")
    return "".join(parts)


def images_of(cell: dict) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def _last_digit(number: str) -> float:
    """The unit of a float's last printed digit: 1e-4 for "5.5432", 1e-7 for "2.6e-06"."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (int(exponent or 0) - decimals)


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    if not any(ch in a + b for ch in ".eE"):
        return False                       # integers (bytes, counts) must be exact
    return abs(float(a) - float(b)) <= max(DIGITS * _last_digit(a), RELATIVE * abs(float(a)))


def same_text(a: str, b: str) -> bool:
    """Equal text, where numbers printed with a decimal point may differ in rounding.

    Floats agree within ``DIGITS`` units of their last printed digit or a ``RELATIVE``
    fraction of their value, whichever is larger: another torch build, or another CPU
    family's kernels (AVX2 or AVX-512, with or without bf16 instructions), round sums
    differently, and a loss after tens of steps drifts by about 1e-4 of itself (tutorial
    03's did, between two x86 machines). What zerofn computes is held to plain PyTorch
    exactly by the parity tests, in one process; this compares a notebook with itself.
    Integers and all other text must be equal.
    """
    if NUMBER.split(a) != NUMBER.split(b):
        return False
    return all(_same_number(x, y) for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)))


def outputs_differ(committed: dict, fresh: dict) -> list[str]:
    """What tells the fresh run of a notebook from the committed one; empty if nothing.

    Args:
        committed: the notebook as stored.
        fresh: the same notebook as ``execute`` returned it.

    Returns:
        One line per difference: a code cell whose source, text (see ``same_text``; not for
        cells tagged ``varies``) or number of images differ.
    """
    old, new = code_cells(committed), code_cells(fresh)
    if [source(c) for c in old] != [source(c) for c in new]:
        return ["the code cells differ from the executed ones"]
    problems = []
    for i, (a, b) in enumerate(zip(old, new)):
        if images_of(a) != images_of(b):
            problems.append(f"code cell {i}: {images_of(b)} images now, {images_of(a)} stored")
        varies = VARIES in a.get("metadata", {}).get("tags", [])
        if not varies and not same_text(text_of(a), text_of(b)):
            problems.append(f"code cell {i} prints otherwise now:\n--- stored\n{text_of(a)}"
                            f"--- now\n{text_of(b)}")
    return problems


def run(path: Path, check: bool) -> list[str]:
    """Executes one notebook; writes it back where it changed (unless ``check``).

    Returns:
        What changed (or, with ``check``, would change) in the stored notebook.
    """
    import nbformat

    committed = json.loads(path.read_text())
    fresh = execute(path)
    changes = stored_problems(committed) + outputs_differ(committed, fresh)
    if changes and not check:
        nbformat.write(fresh, path)
    for problem in stored_problems(json.loads(nbformat.writes(fresh))):
        print(f"{path.name}: {problem}; the tests refuse that", file=sys.stderr)
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="run only notebooks whose name contains one")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a notebook's stored outputs are stale")
    args = parser.parse_args(argv)
    paths = notebooks(args.names)
    if not paths:
        parser.error(f"no notebook in {TUTORIALS} matches {args.names}")
    stale = []
    for path in paths:
        changes = run(path, args.check)
        verdict = ("stale" if args.check else "rewritten") if changes else "unchanged"
        print(f"{path.name}: {verdict}", flush=True)
        if args.check:
            print("".join(f"  {line}\n" for c in changes for line in c.splitlines()), end="")
        stale += [path.name] if changes else []
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
