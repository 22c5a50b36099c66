"""Two torchrun "nodes" on one machine (``--nnodes 2``, one c10d rendezvous on
127.0.0.1, one rank each) train the main job like one node of two ranks; when the rank
of one node raises, the other node's rank stops with a RankFailure naming it, and both
launchers end, leaving no process behind."""
from __future__ import annotations

import os
import uuid

import pytest

import zerofn as zf
from support.errors import error_of
from support.jobs import finish, free_port, losses, survivors, torchrun, uninterrupted
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank


def _two_nodes(flags: list[str], fault: str | None = None):
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    nodes = [torchrun(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", run_id], flags, fault) for n in range(2)]
    return [finish(p) for p in nodes]


def test_two_nodes_train_like_one(tmp_path):
    save_dir = str(tmp_path / "two-nodes")
    results = _two_nodes(["--save-dir", save_dir])
    for code, out, _ in results:
        assert code == 0, out
    got = losses(results[0][1]) or losses(results[1][1])   # the node of rank 0 prints
    want = uninterrupted(str(tmp_path.parent))
    print(f"\none node, two ranks: {want}\ntwo nodes:           {got}")
    assert got == want
    assert not survivors(save_dir)


@pytest.mark.slow(reason="test_failures.py covers RankFailure in zerofn train on one node")
def test_a_raise_on_one_node_stops_the_other(tmp_path):
    save_dir = str(tmp_path / "raise")
    results = _two_nodes(["--save-dir", save_dir, "--timeout", "30"], "raise:step:3:1")
    text = "\n".join(out for _, out, _ in results)
    assert all(code != 0 for code, _, _ in results), text
    print("\n" + "\n".join(f"node {n}: exit {code} after {s:.1f} s"
                           for n, (code, _, s) in enumerate(results)))
    assert "rank 1 raised this in step of step 3" in text
    assert "rank 0 stopped in the gap between steps 3 and 4" in text and \
        "rank 1 raised RuntimeError: injected failure in step in step of step 3" in text, text
    assert not survivors(save_dir)


def _save_to_local_dirs(rank, world, root):
    """Each rank saves to its own "node-local" directory."""
    import torch
    from support.models import make_models

    _, model = make_models()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zf.shard_optimizer()(model, opt)
    return error_of(zf.save_checkpoint, os.path.join(root, f"node{rank}"), model, opt, step=1)


def test_a_checkpoint_root_not_shared_is_an_error_on_every_rank(tmp_path):
    errors = run_ranks(2, _save_to_local_dirs, str(tmp_path))
    print(f"\n{errors[0]}")
    assert errors[0] == errors[1] and "rank 1 on" in errors[0] and \
        "cannot see the directory rank 0" in errors[0]
    assert not os.path.exists(tmp_path / "node0" / "latest")
