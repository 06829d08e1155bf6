"""`ckptlib.dcp.writer` / `reader` under a user's own `dcp.save` / `dcp.load` on S3, GCS and
Azure (moto, fake-gcs-server and Azurite on 127.0.0.1): committed with a manifest, resharded
on load, and `checkpoint_id=` naming the bucket path through `reset`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptlib
import ckptlib.dcp
from ckptlib.format import MANIFEST_NAME
from ckptlib.storage import open_storage

CLOUDS = [
    pytest.param("s3_root", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs_root", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure_root", id="azure", marks=pytest.mark.azure),
]


def _full(seed: int) -> torch.Tensor:
    return torch.randn(11, 6, generator=torch.Generator().manual_seed(seed))


def _sharded(full: torch.Tensor, dim: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(dim)])


def _save(uri: str) -> None:
    state = {"w": _sharded(_full(0), 0), "meta": {"step": 7}}
    dcp.save(state, storage_writer=ckptlib.dcp.writer(), checkpoint_id=uri)


def _load(uri: str) -> list:
    state = {"w": _sharded(torch.zeros(11, 6), 1), "meta": {"step": 0}}
    dcp.load(state, storage_reader=ckptlib.dcp.reader(uri))
    return [torch.equal(state["w"].full_tensor(), _full(0)), state["meta"]["step"]]


@pytest.mark.parametrize("root_fixture", CLOUDS)
def test_dcp_save_and_load_through_ckptlib_storage(request, dist_run, root_fixture):
    uri = request.getfixturevalue(root_fixture) + "/step-7"
    assert ckptlib.dcp.Writer.validate_checkpoint_id(uri)
    dist_run(2, _save, uri)
    assert {MANIFEST_NAME, ".metadata", "__0_0.distcp", "__1_0.distcp"} == set(open_storage(uri).list())
    assert ckptlib.format.verify(uri) == []
    assert dist_run(3, _load, uri) == [[True, 7]] * 3
