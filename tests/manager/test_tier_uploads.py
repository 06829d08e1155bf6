"""Per-rank uploads of the cluster tier on simulated nodes (`dist_run(nodes=2)`: torchrun's
GROUP_RANK per rank, each node its own local root):

- every rank uploads exactly its own shard file (rank 0 also `.metadata`), never another's;
- one rank's upload failing (the remote down for it alone) is the same UploadError on every
  rank, naming that rank and the object; the remote `latest` stays where it was, the step
  stays committed in every node's root, and the next save uploads and moves `latest`.
"""

from __future__ import annotations

import os

import torch

NODES = 2


def _state(step: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(48, 16, generator=torch.Generator().manual_seed(step))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def _one_rank_cannot_upload(base: str, remote: str) -> dict:
    import torch.distributed as dist

    import ckptlib
    import ckptlib.remote_tier as remote_tier
    from ckptlib.format import classify
    from ckptlib.storage import open_storage

    rank = dist.get_rank()
    root = os.path.join(base, f"node{os.environ['GROUP_RANK']}")
    copied: dict[str, list[str]] = {}
    down: list[int] = []
    real = remote_tier.copy_file

    def copy(src, dst, name, size, crc):
        if down and rank == 3:
            raise ckptlib.StorageError(f"{dst.uri}/{name}: injected: connection reset by peer")
        real(src, dst, name, size, crc)
        copied.setdefault(os.path.basename(dst.uri.rstrip("/")), []).append(name)

    remote_tier.copy_file = copy
    mgr = ckptlib.CheckpointManager(root, remote=remote)
    mgr.save(1, _state(1))
    out: dict = {"first": mgr.wait().step}
    down.append(1)
    mgr.save(2, _state(2))  # the local save does not need the remote
    try:
        mgr.wait()
    except ckptlib.CheckpointError as exc:
        out["error"] = {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc), "rank": exc.rank}
    out["latest_after_failure"] = open_storage(remote).read_pointer("latest")
    out["step2_here"] = classify(mgr.storage.child("step_0000000002"))
    down.clear()
    mgr.save(3, _state(3))
    out["third"] = mgr.wait().step
    out["latest"] = open_storage(remote).read_pointer("latest")
    out["copied"] = copied
    mgr.close()
    return out


def test_one_rank_failing_to_upload_is_an_upload_error_naming_it_on_every_rank(tmp_path, dist_run):
    remote = str(tmp_path / "remote")
    results = dist_run(4, _one_rank_cannot_upload, str(tmp_path), remote, nodes=NODES)
    where = f"{remote}/step_0000000002/__3_0.distcp"
    for rank, res in enumerate(results):
        assert res["first"] == 1 and res["third"] == 3, res
        error = res["error"]
        assert error["types"][:3] == ["UploadError", "StorageError", "CheckpointError"], error
        assert error["message"].startswith(f"rank 3: {where}: upload failed: StorageError: "), error
        assert error["message"].endswith("injected: connection reset by peer"), error
        assert error["rank"] == 3, error
        assert res["latest_after_failure"] == "step_0000000001", res
        assert res["step2_here"] == "committed", res  # nothing committed is lost
        assert res["latest"] == "step_0000000003", res
        own = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        uploaded = {"step_0000000001": own, "step_0000000003": own}
        if rank != 3:
            uploaded["step_0000000002"] = own
        assert {step: sorted(names) for step, names in res["copied"].items()} == {
            step: sorted(names) for step, names in uploaded.items()
        }, f"rank {rank} uploads exactly its own files"
