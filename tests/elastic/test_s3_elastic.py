"""Elastic round trips over S3: save at N ranks, load at M, through a moto server on 127.0.0.1.

Every rank is a separate process, so the server is reached over loopback with the endpoint and
fake credentials passed as environment variables (an in-process mock_aws would not cross the
process boundary). Each case checks the loaded state bit-exactly and one training step after
the load against a run that never saw a checkpoint (ckptlib.testing.matrices.matrix.load_side).
"""

from __future__ import annotations

import pytest

from ckptlib._torch import parallel
from ckptlib.testing.fakes.s3_server import s3_client, s3_env
from ckptlib.testing.matrices import matrix as mx

pytestmark = [pytest.mark.s3, pytest.mark.elastic]


def _skip_without_fsdp2() -> None:
    if parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())


def _load_counting_gets(uri: str, wrap: str, optim: str, expected: dict, manager: bool = False) -> dict:
    """A rank: load (and train a step) like matrix.load_side, recording which objects this
    rank fetched from S3 and how many bytes."""
    from ckptlib.storage.s3 import default_client

    gets: list[tuple[str, int]] = []

    def record(http_response, parsed, model, **kwargs):
        if model.name == "GetObject" and http_response.status_code in (200, 206):
            url = http_response.url if hasattr(http_response, "url") else ""
            gets.append((url.rsplit("/", 1)[-1], int(parsed.get("ContentLength") or 0)))

    client = default_client()  # the client open_storage(uri) uses in this rank
    client.meta.events.register("after-call.s3.GetObject", record, unique_id="count-gets")
    try:
        problems = mx.load_side(uri, wrap, optim, expected, manager=manager)
    finally:
        client.meta.events.unregister("after-call.s3.GetObject", unique_id="count-gets")
    return {"problems": problems, "gets": gets}


def _keys(endpoint: str, bucket: str) -> set[str]:
    out = set()
    for page in s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update(o["Key"] for o in page.get("Contents") or ())
    return out


def test_fsdp2_adamw_save2_load3(moto_server, s3_root, dist_run):
    _skip_without_fsdp2()
    env = s3_env(moto_server)
    expected = dist_run(2, mx.save_side, s3_root, "fsdp2", "adamw", env=env)[0]
    bucket = s3_root.split("/")[2]
    assert _keys(moto_server, bucket) == {"run/ckptlib.json", "run/.metadata", "run/__0_0.distcp", "run/__1_0.distcp"}

    results = dist_run(3, _load_counting_gets, s3_root, "fsdp2", "adamw", expected, env=env)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"
    # Only rank 0 reads the manifest and .metadata (then broadcasts them): no rank-many
    # downloads of shared files (pytorch/pytorch#118327). Every rank reads only shard files.
    for rank, result in enumerate(results):
        names = {name for name, _ in result["gets"]}
        shared = names & {"ckptlib.json", ".metadata"}
        assert shared == ({"ckptlib.json", ".metadata"} if rank == 0 else set()), (rank, result["gets"])
        assert names - shared <= {"__0_0.distcp", "__1_0.distcp"}, (rank, result["gets"])


def test_manager_fsdp2_sgd_save3_load2(moto_server, s3_root, dist_run):
    _skip_without_fsdp2()
    env = s3_env(moto_server)
    expected = dist_run(3, mx.save_side, s3_root, "fsdp2", "sgd", manager=True, env=env)[0]
    bucket = s3_root.split("/")[2]
    step = "run/step_0000000002"
    assert _keys(moto_server, bucket) == {
        "run/latest",
        f"{step}/ckptlib.json",
        f"{step}/.metadata",
        f"{step}/__0_0.distcp",
        f"{step}/__1_0.distcp",
        f"{step}/__2_0.distcp",
    }
    results = dist_run(2, _load_counting_gets, s3_root, "fsdp2", "sgd", expected, manager=True, env=env)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"


def _manager_save(root: str, step: int, kill_rank: int | None = None):
    """A rank: save `step` through a CheckpointManager; `kill_rank` SIGKILLs itself while its
    shard upload is in flight (after the first bytes went to S3)."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    import ckptlib
    from ckptlib.storage import s3 as s3mod

    rank = dist.get_rank()
    if rank == kill_rank:
        original = s3mod.S3Storage.open_writer

        def dying_writer(self, path):
            ctx = original(self, path)
            stream = ctx.__enter__()
            stream.write(b"x" * 1024)
            os.kill(os.getpid(), signal.SIGKILL)
            return ctx  # not reached

        s3mod.S3Storage.open_writer = dying_writer
    ckptlib.CheckpointManager(root).save(
        step, {"w": torch.full((8, 4), float(step)), "r": torch.full((2,), float(rank))}
    )
    return step


def _manager_load(root: str):
    import torch

    import ckptlib

    state = {"w": torch.zeros(8, 4)}
    step = ckptlib.CheckpointManager(root).load(state)
    return step, state["w"].tolist()


def test_rank_killed_mid_upload_keeps_latest_and_next_save_cleans(moto_server, s3_root, dist_run):
    """A rank dies while uploading its shard: `latest` still names the previous step, which
    loads; the next save removes the debris (exact key set)."""
    from ckptlib.testing import RankError

    env = s3_env(moto_server)
    bucket, prefix = s3_root.split("/")[2], "/".join(s3_root.split("/")[3:])
    dist_run(2, _manager_save, s3_root, 1, env=env)
    with pytest.raises(RankError, match="rank 1"):
        dist_run(2, _manager_save, s3_root, 2, 1, env=env, grace=2.0)
    pointer = s3_client(moto_server).get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read().decode()
    assert pointer.strip() == "step_0000000001"
    assert dist_run(2, _manager_load, s3_root, env=env) == [(1, [[1.0] * 4] * 8)] * 2
    dist_run(2, _manager_save, s3_root, 3, env=env)
    step_keys = {k for k in _keys(moto_server, bucket) if "step_0000000002" in k}
    assert step_keys == set()
    assert {k.split("/")[-2] for k in _keys(moto_server, bucket) if "/step_" in k} == {
        "step_0000000001",
        "step_0000000003",
    }
    assert dist_run(2, _manager_load, s3_root, env=env)[0][0] == 3
