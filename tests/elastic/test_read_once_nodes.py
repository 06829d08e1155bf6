"""Read once across nodes, with real torchrun launches: two launchers (`--nnodes 2 --node-rank K`,
2 ranks each, static rendezvous on 127.0.0.1), each node with its own local directory holding
only its ranks' shard files (as a cluster's node-local roots). Every rank loads the replicated
state bit-exactly; each stored item is read from storage once, by a rank on the node that holds
it, and reaches the other node over the process group; no rank touches the other node's
directory. Judged by per-rank result files (gloo may abort at teardown, GUIDE.md)."""

from __future__ import annotations

import json
import os

import pytest
from helpers.copies import node_dirs, shard_files
from helpers.read_once_node import state
from helpers.torchrun import LAUNCH_TIMEOUT, TESTS, Nodes

import ckptlib

pytestmark = pytest.mark.elastic

WORKER = str(TESTS / "helpers" / "read_once_node.py")


def _save(path: str) -> None:
    ckptlib.save(path, state(0.0))


def _torchrun_two_nodes(base: str, out: str, *extra: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    with Nodes.start([WORKER, base, out, *extra], [2, 2], os.path.join(out, "logs")) as nodes:
        nodes.wait()
    reports = []
    for rank in range(4):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no result:\n{nodes.tails()}"
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    return reports


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 300)  # two launches, each bounded by Nodes.wait
def test_two_torchrun_nodes_read_each_item_once(tmp_path, dist_run):
    saved, base = str(tmp_path / "saved"), str(tmp_path / "nodes")
    dist_run(4, _save, saved, timeout=120)
    node_dirs(saved, base, [[0, 1], [2, 3]])
    for node in ("node0", "node1"):
        assert shard_files(os.path.join(base, node)), f"{node} must hold items for the test to cross nodes"

    once = _torchrun_two_nodes(base, str(tmp_path / "once"))
    assert [(r["rank"], r["node"]) for r in once] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    for r in once:
        assert r["exact"], r
        assert r["outside_own_node"] == [], r  # a node-local root is read only on its node
    needed, by_rank = once[0]["needed"], once[0]["by_rank"]
    assert all(r["by_rank"] == by_rank and r["needed"] == needed for r in once)
    assert needed <= sum(by_rank) <= 1.1 * needed, (by_rank, needed)
    assert all(r["by_source"] == {"local": sum(by_rank)} for r in once)
    for r in once:  # what a rank did not read itself came over the process group
        assert r["received"] == sum(by_rank) - r["read"] > 0

    # Without read-once each node reads its own files on both of its ranks (items of the other
    # node's files still come over the process group: this node has no copy of them).
    every = _torchrun_two_nodes(base, str(tmp_path / "every"), "--no-read-once")
    assert all(r["exact"] and r["outside_own_node"] == [] for r in every)
    assert sum(every[0]["by_rank"]) >= 1.9 * needed
