"""Two torchrun "nodes" on one machine (``--nnodes 2``, one c10d rendezvous on
127.0.0.1, one rank each) train the main job like one node of two ranks; when the rank
of one node raises, the other node's rank stops with a RankFailure naming it, and both
launchers end, leaving no process behind."""
from __future__ import annotations

import uuid

from tests.torchrun_jobs import finish, free_port, losses, survivors, torchrun, uninterrupted


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
