"""The examples in README.md and docs/*.md marked runnable run, and print what the text
quotes (the markers: tests/README.md, "Docs that run"; the machinery: support/doc_blocks.py).

A python block runs on 1, 2 or 4 real gloo ranks (run_ranks; the block's own
init_process_group is the one already made), a shell block under bash with `zerofn` and
`python3` meaning this checkout. A quoted output is compared with what rank 0 printed,
numbers within rounding. So a doc change that breaks a marked example fails here, and so
does a code change that makes one print something other than what the text says.
"""
from __future__ import annotations

import importlib.util

import pytest

from support.doc_blocks import all_blocks, differences, run_python, run_shell, shims
from support.ranks import run_ranks

BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.kind != "no" and not b.problems]

# The guides whose key examples must stay runnable (a marker dropped by mistake fails here).
GUIDES = ["README.md", "docs/choosing.md", "docs/out_of_memory.md", "docs/training_loop.md", "docs/from_deepspeed.md",
           "docs/command_line.md"]


def _param(block):
    marks = [pytest.mark.multirank] if block.kind == "python" else []
    if block.slow:
        marks.append(pytest.mark.slow(reason="a whole zerofn train job or more"))
    missing = [m for m in block.needs if importlib.util.find_spec(m) is None]
    if missing:
        marks.append(pytest.mark.skip(reason=f"needs {', '.join(missing)} (set-up installs it "
                                             "with the tests' extras; offline it may not)"))
    return pytest.param(block, id=block.name, marks=marks)


def test_markers_are_well_formed():
    bad = [f"{b.name}: {p}" for b in BLOCKS for p in b.problems]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("guide", GUIDES)
def test_each_guide_has_runnable_examples(guide):
    assert any(b.path == guide for b in RUNNABLE), f"{guide} has no block marked runnable"


def test_blocks_that_cannot_run_here_still_parse():
    """`run: no` python blocks are compiled, so a typo still fails."""
    for b in BLOCKS:
        if b.kind == "no" and b.lang == "python":
            compile(b.code, b.name, "exec")


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_marked_block_runs_and_prints_what_the_text_quotes(block, tmp_path):
    for name, text in block.files.items():        # <!-- file: NAME --> blocks before it
        (tmp_path / name).write_text(text)
    if block.kind == "python":
        printed = run_ranks(block.ranks, run_python, block.code, block.name, str(tmp_path))[0]
    else:
        printed = run_shell(block.code, tmp_path, shims(tmp_path / ".bin"))
    if block.output is not None:
        why = differences(block.output, printed)
        assert why is None, f"{block.name}: {why}"


def test_the_comparison_allows_rounding_and_skips_but_not_other_numbers():
    assert differences("a\n...\nloss 0.539\n", "a\nb\nc\nloss 0.5391\n") is None
    assert differences("loss 0.539\n", "loss 0.612\n") is not None
    assert differences("14.00 GB\n", "14.00 GB\nmore\n") is not None     # the end is whole
    assert differences("...\n7 ranks\n", "x\n8 ranks\n") is not None      # integers exact
