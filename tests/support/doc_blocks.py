"""The examples in README.md and docs/*.md that are marked runnable: finding, running, and
comparing what they print with what the text quotes (tests/test_docs.py).

A marker is an HTML comment (invisible on GitHub) on the line before a fenced block:

    <!-- run: ranks=2 -->            the python block below runs on 2 gloo ranks (1, 2 or 4)
    <!-- run: shell -->              the bash block below runs, line by line as bash does
    <!-- run: ranks=1, slow -->      ... only with ZEROFN_SLOW=1
    <!-- run: ranks=2, needs=torchao --> ... skipped, saying so, where torchao does not import
    <!-- run: no, REASON -->         cannot run here (CUDA, several nodes, ...): REASON says why
    <!-- output -->                  the text block below is what the run block before it
                                     prints (rank 0's stdout for python); `...` is any lines
    <!-- file: NAME -->              the block below is the file NAME, written into the
                                     directory where the document's later run blocks run

tests/README.md says the same for writers of docs.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from run_tutorials import same_text  # noqa: E402 (floats within rounding, the rest equal)

MARKER = re.compile(r"^<!--\s*(run|output|file)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")


@dataclass
class Block:
    path: str            # relative to the repository root
    line: int            # the marker's line, 1-based
    kind: str            # "python", "shell" or "no"
    code: str
    ranks: int = 1
    slow: bool = False
    needs: list[str] = field(default_factory=list)   # modules it imports beyond set-up's core
    reason: str = ""
    lang: str = ""
    output: str | None = None       # what the text quotes, if it does
    files: dict = field(default_factory=dict)   # file blocks before it: name -> text
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _fenced(lines: list[str], i: int) -> tuple[str, str, int] | None:
    """The fenced block starting at or after line i (blank lines skipped): its language,
    its text and the line after it; None if the next thing is no fence."""
    while i < len(lines) and not lines[i].strip():
        i += 1
    m = FENCE.match(lines[i]) if i < len(lines) else None
    if not m:
        return None
    fence, body, j = m.group(1), [], i + 1
    while j < len(lines) and not lines[j].startswith(fence):
        body.append(lines[j])
        j += 1
    return m.group(2), "\n".join(body) + "\n", j + 1


def parse(path: Path) -> list[Block]:
    """Every marked block of one document, with what is wrong with its marker, if anything."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    files: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        what, args = m.group(1), [a.strip() for a in (m.group(2) or "").split(",")]
        fenced = _fenced(lines, i + 1)
        if what == "file":
            name = (m.group(2) or "").strip()
            if fenced and re.fullmatch(r"[\w.-]+", name):
                files[name] = fenced[1]
            else:
                blocks.append(Block(rel, i + 1, "no", "", problems=[
                    "`<!-- file: NAME -->` needs a plain file name and a fenced block"]))
            continue
        if what == "output":
            if blocks and blocks[-1].output is None and blocks[-1].kind != "no" and fenced:
                blocks[-1].output = fenced[1]
            else:
                blocks.append(Block(rel, i + 1, "no", "", problems=[
                    "an output marker must follow a run block (and quote one fenced block)"]))
            continue
        block = Block(rel, i + 1, "no", fenced[1] if fenced else "",
                      lang=fenced[0] if fenced else "", files=dict(files))
        if fenced is None:
            block.problems.append("no fenced block follows the marker")
        if args[0] == "no":
            block.reason = ", ".join(args[1:]).strip()
            if not block.reason:
                block.problems.append("`run: no` needs a reason: `<!-- run: no, REASON -->`")
        else:
            for a in args:
                if a == "shell":
                    block.kind = "shell"
                elif a == "slow":
                    block.slow = True
                elif a.startswith("needs="):
                    block.needs.append(a[len("needs="):])
                elif re.fullmatch(r"ranks=[124]", a):
                    block.kind, block.ranks = "python", int(a[6:])
                else:
                    block.problems.append(f"unknown run option {a!r} (ranks=1|2|4, shell, slow, "
                                          "needs=MODULE, no)")
            if block.kind == "no" and not block.problems:
                block.problems.append("say ranks=N (python) or shell")
            want = {"python": {"python"}, "shell": {"bash", "sh", "shell", "console"}}
            if fenced and block.kind in want and block.lang not in want[block.kind]:
                block.problems.append(f"a {block.kind} marker before a ```{block.lang} block")
        blocks.append(block)
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in documents() for b in parse(p)]


# --- running ---------------------------------------------------------------------------

def run_python(rank: int, world: int, code: str, name: str, cwd: str) -> str:
    """On a rank run_ranks started: the block as a script under torchrun would run, the
    process group already made (so its own init_process_group and destroy_process_group
    are let through as no-ops); returns what it printed."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None
    dist.destroy_process_group = lambda *a, **k: None
    os.chdir(cwd)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    return out.getvalue()


def shims(directory: Path) -> dict:
    """An environment in which `zerofn`, `python` and `python3` are this interpreter with
    this checkout first on the path (no install needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, line in (("zerofn", f'exec "{sys.executable}" -m zerofn "$@"'),
                       ("python", f'exec "{sys.executable}" "$@"'),
                       ("python3", f'exec "{sys.executable}" "$@"')):
        f = directory / name
        f.write_text(f"#!/usr/bin/env bash\n{line}\n")
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{directory}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               ZEROFN_REPO=str(ROOT))
    return env


def run_shell(code: str, cwd: Path, env: dict, timeout: float = 150) -> str:
    """The block under `bash -e` in cwd; returns stdout, raising with both streams on a
    failure."""
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise AssertionError(f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n"
                             f"{p.stderr[-4000:]}")
    return p.stdout


def differences(quoted: str, printed: str) -> str | None:
    """None if every quoted line matches a printed line in order (same_text: numbers
    within rounding, runs of spaces as one), `...` standing for any lines and both ends
    being whole; else why."""
    want = [" ".join(ln.split()) for ln in quoted.rstrip("\n").splitlines()]
    got = [" ".join(ln.split()) for ln in printed.rstrip("\n").splitlines()]

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and same_text(want[i], got[j]) and match(i + 1, j + 1)

    if match(0, 0):
        return None
    return "the text quotes:\n" + quoted + "\nbut the block printed:\n" + printed
