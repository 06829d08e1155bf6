"""A rank lost while the cluster tier takes its inventory — the topology, each node's listing,
the manifest's broadcast — is a RankLostError naming that rank on every survivor (issue 33),
never a raw gloo RuntimeError; what is committed stays loadable."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import Cluster
from ckptlib.testing import RankExited

NODES = 2
VICTIM = 2  # node 1's leader: it lists its root and sends its copies
EXIT_CODE = 29


def _root(base: str) -> str:
    return os.path.join(base, f"node{int(os.environ['GROUP_RANK'])}")


def _state(step: int) -> dict:
    return {"w": torch.full((8, 4), float(step)), "step": step}


def _save(base: str) -> None:
    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=1))
    mgr.save(1, _state(1))
    mgr.wait()
    mgr.close()


def _load_and_lose(base: str, phase: str) -> dict:
    from ckptlib.manager.cluster import cluster_tier, resume

    if dist.get_rank() == VICTIM:

        def dies(*args, **kwargs):
            os._exit(EXIT_CODE)

        target = {"topology": (cluster_tier, "detect"), "listing": (resume, "node_copies"),
                  "manifest": (cluster_tier, "fetch_files")}[phase]  # fmt: skip
        setattr(*target, dies)
    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=1))
    try:
        mgr.load(_state(0))
    except ckptlib.CheckpointError as exc:
        return {"types": [c.__name__ for c in type(exc).__mro__], "ranks": list(exc.ranks), "message": str(exc)}
    return {"types": None}


@pytest.mark.parametrize("phase", ["topology", "listing", "manifest"])
def test_a_rank_lost_during_the_inventory_is_a_rank_lost_error_on_every_survivor(tmp_path, dist_run, phase):
    base = str(tmp_path)
    dist_run(4, _save, base, nodes=NODES)
    results = dist_run(4, _load_and_lose, base, phase, nodes=NODES, return_exceptions=True, timeout=180)
    assert isinstance(results[VICTIM], RankExited) and results[VICTIM].exitcode == EXIT_CODE, results[VICTIM]
    for rank in (0, 1, 3):
        res = results[rank]
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res["types"] is not None and "RankLostError" in res["types"], (rank, res)
        assert res["ranks"] == [VICTIM], (rank, res)
        assert res["message"].startswith(
            f"the cluster tier's inventory failed on rank {rank}: rank {VICTIM} disappeared"
        )
    state = _state(0)  # nothing committed was lost: a single process reads node 0's copy
    assert ckptlib.load(os.path.join(base, "node0", "step_0000000001"), state).step == 1
    assert torch.equal(state["w"], _state(1)["w"])
