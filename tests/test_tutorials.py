"""Every notebook in tutorials/ runs for real: its code cells, in order, in one namespace,
in a fresh interpreter (no Jupyter needed), and must finish without an exception."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parent.parent / "tutorials").glob("*.ipynb"))

# Runs in the child: exec each code cell, naming it in tracebacks and on failure.
RUNNER = """
import json, sys
cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
namespace = {"__name__": "__main__"}
for i, cell in enumerate(cells):
    source = "".join(cell["source"])
    try:
        exec(compile(source, f"<{sys.argv[1]} code cell {i}>", "exec"), namespace)
    except BaseException:
        print(f"code cell {i} failed:\\n{source}", file=sys.stderr)
        raise
"""


def test_tutorials_exist():
    assert TUTORIALS, "tutorials/ holds no notebooks"


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.name)
def test_notebook_runs(notebook, tmp_path):
    nb = json.loads(notebook.read_text())
    assert nb["nbformat"] == 4
    assert any(c["cell_type"] == "code" for c in nb["cells"])
    done = subprocess.run([sys.executable, "-c", RUNNER, str(notebook)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
