"""Every copy the cluster tier reads is a verified one (issue 33, item 2), on simulated nodes
(`dist_run(nodes=2)`, each node its own local root, `replicas=1`).

- a load that reads past node 0's damaged copy of a file (to node 1's replica) reports it in
  `LoadResult.unusable_copies`, sets it aside (`<file>.damaged`), and the upload of the
  resumed step the remote lacks reads node 1's intact copy: the remote commits the step
  bit-exactly and the next save succeeds (before: the upload re-read the damaged copy, failed,
  and every later save raised);
- a copy damaged after the save wrote it (found only by the upload) is set aside and its file
  uploaded from the partner's replica; without a replica it is a DamagedCopyError on every
  rank naming the rank and file, and the remote `latest` stays where it was.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckptlib import Cluster

NODES = 2
STEP2 = "step_0000000002"


def _state(step: int, empty: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(step)
    full = torch.zeros(64, 32) if empty else torch.randn(64, 32, generator=gen)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": -1 if empty else step}


def _root(base: str) -> str:
    return os.path.join(base, f"node{os.environ['GROUP_RANK']}")


def _flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def _remote_copy_is_exact(remote: str, step: int) -> bool:
    """The remote's committed step, loaded from the remote alone, equals what was saved."""
    import ckptlib

    state = _state(step, empty=True)
    ckptlib.load(os.path.join(remote, f"step_{step:010d}"), state)
    return torch.equal(state["w"].full_tensor(), _state(step)["w"].full_tensor()) and state["step"] == step


def _save_nodes_only(base: str) -> None:
    import ckptlib

    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=1))
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.wait()
    mgr.close()


def _resume_then_save(base: str, remote: str) -> dict:
    import torch.distributed as dist

    import ckptlib

    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=1, remote=remote))
    state = _state(0, empty=True)
    step = mgr.load(state)
    exact = torch.equal(state["w"].full_tensor(), _state(step)["w"].full_tensor()) and state["step"] == step
    unusable = [(c.key.split(":")[0], c.file, c.label, c.problem) for c in mgr.last_load.unusable_copies]
    mgr.wait()  # the resumed upload of step 2
    latest_after_upload = ckptlib.storage.open_storage(remote).read_pointer("latest")
    mgr.save(3, _state(3))
    mgr.wait()
    mgr.close()
    dist.barrier()
    return {
        "step": step,
        "exact": exact,
        "unusable": unusable,
        "latest_after_upload": latest_after_upload,
        "latest": ckptlib.storage.open_storage(remote).read_pointer("latest"),
        "remote_exact": [_remote_copy_is_exact(remote, s) for s in (2, 3)],
        "listing": sorted(os.listdir(os.path.join(_root(base), STEP2))),
    }


def test_a_copy_the_load_found_damaged_is_set_aside_and_the_upload_reads_the_intact_one(tmp_path, dist_run):
    base, remote = str(tmp_path), str(tmp_path / "remote")
    dist_run(4, _save_nodes_only, base, nodes=NODES)  # the remote never saw step 2
    _flip(str(tmp_path / "node0" / STEP2 / "__0_0.distcp"))

    results = dist_run(4, _resume_then_save, base, remote, nodes=NODES)
    for res in results:
        assert res["step"] == 2 and res["exact"], res
        assert res["unusable"] == [("node0", "__0_0.distcp", "local", res["unusable"][0][3])], res
        assert "checksum mismatch" in res["unusable"][0][3], res
        assert res["latest_after_upload"] == STEP2 and res["latest"] == "step_0000000003", res
        assert res["remote_exact"] == [True, True], res
    shards = [f"__{r}_0.distcp" for r in range(4)]
    assert results[0]["listing"] == sorted([".metadata", "__0_0.distcp.damaged", *shards[1:], "ckptlib.json"])
    assert results[2]["listing"] == sorted([".metadata", *shards, "ckptlib.json"])  # node 1's copy untouched


def _save_damaged_before_upload(base: str, remote: str, replicas: int) -> dict:
    """Rank 0's own file of step 1 is damaged after the save wrote (and replicated) it, just
    before the upload reads it."""
    import torch.distributed as dist

    import ckptlib
    import ckptlib.manager.cluster.remote_tier as remote_tier

    if dist.get_rank() == 0:
        real_copy = remote_tier.copy_file

        def copy_file(src, dst, name, size, crc):
            if name == "__0_0.distcp" and src.uri.endswith("node0/step_0000000001"):
                _flip(os.path.join(src.uri, name))
                remote_tier.copy_file = real_copy
            return real_copy(src, dst, name, size, crc)

        remote_tier.copy_file = copy_file
    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=replicas, remote=remote))
    mgr.save(1, _state(1))
    out: dict = {"error": None}
    try:
        mgr.wait()
    except ckptlib.CheckpointError as exc:
        out["error"] = (type(exc).__name__, exc.file, exc.rank, str(exc)) if hasattr(exc, "file") else repr(exc)
    mgr.close()
    dist.barrier()
    out["latest"] = ckptlib.storage.open_storage(remote).read_pointer("latest")
    out["remote_exact"] = _remote_copy_is_exact(remote, 1) if out["latest"] else None
    out["listing"] = sorted(os.listdir(os.path.join(_root(base), "step_0000000001")))
    return out


@pytest.mark.parametrize("replicas", [1, 0], ids=["replicas1", "replicas0"])
def test_a_copy_damaged_before_its_upload_is_uploaded_from_the_replica(tmp_path, dist_run, replicas):
    base, remote = str(tmp_path), str(tmp_path / "remote")
    results = dist_run(4, _save_damaged_before_upload, base, remote, replicas, nodes=NODES)
    own = {0: [0, 1], 2: [2, 3]}
    if replicas:
        for res in results:
            assert res["error"] is None and res["latest"] == "step_0000000001" and res["remote_exact"], res
        others = [f"__{r}_0.distcp" for r in range(1, 4)]
        assert results[0]["listing"] == sorted([".metadata", "__0_0.distcp.damaged", *others, "ckptlib.json"])
        assert results[2]["listing"] == sorted([".metadata", "__0_0.distcp", *others, "ckptlib.json"])
        return
    where = f"{tmp_path}/node0/step_0000000001/__0_0.distcp"
    for res in results:
        kind, file, rank, message = res["error"]
        assert (kind, file, rank) == ("DamagedCopyError", "__0_0.distcp", 0), res
        assert message.startswith(f"rank 0: {where}: the local copy does not match its manifest"), message
        assert res["latest"] is None, res  # nothing committed remotely
    for first, ranks in own.items():
        expected = [".metadata", *[f"__{r}_0.distcp" for r in ranks], "ckptlib.json"]
        if first == 0:
            expected = [".metadata", "__0_0.distcp.damaged", "__1_0.distcp", "ckptlib.json"]
        assert results[first]["listing"] == sorted(expected), results[first]
