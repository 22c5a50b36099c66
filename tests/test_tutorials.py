"""The notebooks in tutorials/ run in a real Jupyter kernel, and their stored outputs (the
numbers and plots GitHub shows) are what the current code prints.

How the stored outputs are kept honest (tools/run_tutorials.py writes them):

- Fast, without executing: each notebook's metadata holds ``zerofn.code_digest``, a digest
  of its code cells, which the tool stamps when it executes them; the cells must still
  have that digest, and their outputs must come from one clean run (execution counts 1, 2,
  ... in order, no error, nothing on stderr). This catches the common slip, a cell edited
  and committed without a re-run, in milliseconds.
- For real: every notebook is executed with ``nbclient`` in a fresh ``python3`` kernel; a
  cell that raises fails the test with the cell's source and the kernel's traceback. Then
  what each cell printed and returned is compared with what is stored: text equal, floats
  within rounding or 3e-4 of their value, which another CPU's kernels move a trained loss
  by (``run_tutorials.same_text``), the same number of plots. So a change in
  zerofn that moves a number fails here, saying which cell printed what.

Why no digest of zerofn's sources: it would fail on every edit to any file under
``zerofn/``, a comment included, several times a day on a codebase many people change,
forcing a re-run and a notebook commit that changes nothing; and a matching digest would
only prove that the tool ran, not that the outputs are right. Comparing the outputs of a
real run checks what matters, and fails only when a notebook would now show something
else. Text that depends on timing sits in cells tagged ``varies``, which are run but not
compared. PNG bytes are not compared (matplotlib and font versions change them); their
number is, and the values they plot are printed beside them.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import run_tutorials as rt  # noqa: E402

TUTORIALS = rt.notebooks()


def rerun(path: Path) -> str:
    return rt.RERUN.format(name=path.stem)


def test_tutorials_exist():
    assert len(TUTORIALS) >= 2, "tutorials/ lost its notebooks"


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.name)
def test_stored_outputs_come_from_the_code_cells(notebook):
    nb = json.loads(notebook.read_text())
    assert nb["nbformat"] == 4 and rt.code_cells(nb), f"{notebook.name} holds no code"
    problems = rt.stored_problems(nb)
    assert not problems, f"{notebook.name}: {'; '.join(problems)}; {rerun(notebook)}"


def test_stored_problems_are_found():
    ran = {"cells": [{"cell_type": "code", "source": "print(1)", "execution_count": 1,
                      "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}]}]}
    ran["metadata"] = {"zerofn": {"code_digest": rt.code_digest(ran)}}
    assert not rt.stored_problems(ran)
    edited = json.loads(json.dumps(ran))
    edited["cells"][0]["source"] = "print(2)"
    assert rt.stored_problems(edited) == ["its code cells changed since their outputs were made"]
    rerun_once = json.loads(json.dumps(ran))
    rerun_once["cells"][0]["execution_count"] = 3
    assert "not from one run" in rt.stored_problems(rerun_once)[0]
    noisy = json.loads(json.dumps(ran))
    noisy["cells"][0]["outputs"].append({"output_type": "stream", "name": "stderr", "text": "w"})
    assert rt.stored_problems(noisy) == ["code cells [0] wrote to stderr (fix or silence it)"]


def missing_modules(nb: dict) -> list[str]:
    needed = ["nbclient", "ipykernel"] + nb["metadata"].get("zerofn", {}).get("requires", [])
    return [m for m in needed if importlib.util.find_spec(m) is None]


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.name)
def test_notebook_runs_and_prints_what_is_stored(notebook):
    committed = json.loads(notebook.read_text())
    missing = missing_modules(committed)
    if missing:
        pytest.skip(f"{notebook.name} needs {', '.join(missing)} (bash scripts/setup.sh installs them)")
    try:
        fresh = rt.execute(notebook)
    except rt.TutorialError as e:
        pytest.fail(str(e), pytrace=False)
    changes = rt.outputs_differ(committed, fresh)
    assert not changes, f"{notebook.name}: {rerun(notebook)}\n" + "\n".join(changes)


def test_a_failing_cell_reports_its_source_and_traceback(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("def broken():\n    return 1 / 0\n\nbroken()"),
        nbformat.v4.new_code_cell("print('never')")])
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(rt.TutorialError) as failed:
        rt.execute(path)
    message = str(failed.value)
    assert "broken.ipynb, code cell 1 failed" in message
    assert "def broken():\n    return 1 / 0" in message            # the cell's source
    assert "ZeroDivisionError" in message and "----> 2     return 1 / 0" in message
    assert "\x1b[" not in message                                   # no terminal colours


def cell(text: str, images: int = 0, tags=()) -> dict:
    outputs = [{"output_type": "stream", "name": "stdout", "text": text}]
    outputs += [{"output_type": "display_data", "metadata": {},
                 "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}}] * images
    return {"cell_type": "code", "source": "f()", "metadata": {"tags": list(tags)},
            "outputs": outputs}


def test_outputs_compare_text_exactly_and_floats_within_rounding():
    stored = {"cells": [cell("loss 5.5432 bytes 1,024\n", images=1)]}
    assert not rt.outputs_differ(stored, {"cells": [cell("loss 5.5433 bytes 1,024\n", images=1)]})
    assert rt.same_text("loss 5.5432", "loss 5.5446")       # 2.5e-4 of the value: kernels
    assert not rt.same_text("step 0.0012", "step 0.0015")   # 2 digits rule small values
    for other in ("loss 5.5452 bytes 1,024\n",       # a float beyond both tolerances
                  "loss 5.5432 bytes 1,028\n",       # an integer
                  "loss 5.5432 B 1,024\n"):          # words
        assert rt.outputs_differ(stored, {"cells": [cell(other, images=1)]}), other
    assert rt.outputs_differ(stored, {"cells": [cell("loss 5.5432 bytes 1,024\n")]})  # lost plot
    timed = {"cells": [cell("step 12.1 ms\n", tags=["varies"])]}
    assert not rt.outputs_differ(timed, {"cells": [cell("step 15.9 ms\n", tags=["varies"])]})
    edited = {"cells": [dict(cell("loss 5.5432 bytes 1,024\n", images=1), source="g()")]}
    assert rt.outputs_differ(stored, edited) == ["the code cells differ from the executed ones"]
