"""`.metadata` stays byte for byte what ckptlib wrote before the coordinator's memory work and
the plan cache (issues 25.2, 25.5): the same pickle (objects, their order and which of them
are shared) for a single process and for 2 ranks with every kind of entry, and plain
`dcp.load` reads it. The goldens in metadata_golden/ were written by the code before those
changes (`CKPTLIB_WRITE_GOLDEN=1` rewrites them, for a deliberate format change only), with
a fixed checkpoint path in place of the real one."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlib
from ckptlib.format.write.dcp_writer import CkptWriter

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metadata_golden")


@contextlib.contextmanager
def fixed_checkpoint_id():
    """`.metadata` names the checkpoint's path (`storage_meta.checkpoint_id`): a fixed one
    instead, so files saved anywhere compare byte for byte. (Comparing files pickled again
    after loading them would not do: unpickling interns attribute names, so two files whose
    records differ only in which strings they share would compare equal.)"""
    original = CkptWriter.storage_meta

    def fixed(self):
        meta = original(self)
        meta.checkpoint_id = "<checkpoint>"
        return meta

    CkptWriter.storage_meta = fixed
    try:
        yield
    finally:
        CkptWriter.storage_meta = original


def _read(path: str) -> bytes:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return f.read()


def _single_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g)
    return {
        "model": {"w": w, "b": torch.zeros(6, requires_grad=True), "half": torch.ones(3, 2, dtype=torch.bfloat16)},
        "optim": {
            "state": {"0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 6, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "extra": {"epoch": 3, "name": "run", "seen": [1, 2, 3]},
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "view": torch.arange(20.0).reshape(4, 5)[:, 1:3],
    }


def save_single(path: str) -> bytes:
    with fixed_checkpoint_id():
        ckptlib.save(path, _single_state())
    return _read(path)


def _dtensor_state(world: int, rank: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    from ckptlib._torch import parallel

    mesh = parallel.init_device_mesh_fn()("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    full = {
        "rows": torch.randn(8, 6, generator=g),
        "cols": torch.randn(4, 8, generator=g),
        "rep": torch.randn(5, generator=g),
        "uneven": torch.randn(5, 3, generator=g),
    }
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "rep": [Replicate()], "uneven": [Shard(0)]}
    model = {k: parallel.distribute_locally(t, mesh, placements[k]) for k, t in full.items()}
    return {
        "model": model,
        "plain": torch.arange(6.0),  # the same on every rank: written once (dedup)
        "per_rank": {"layers": [torch.full((2,), float(rank)), torch.ones(3)]},
        "extra": {"step": 7, "tags": ["a", "b"]},
    }


def rank_save_two(path: str) -> bytes:
    import torch.distributed as dist

    with fixed_checkpoint_id():
        ckptlib.save(path, _dtensor_state(dist.get_world_size(), dist.get_rank()))
    return _read(path)


def _check(name: str, blob: bytes) -> None:
    golden = os.path.join(GOLDEN, name)
    if os.environ.get("CKPTLIB_WRITE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(golden, "wb") as f:
            f.write(blob)
    with open(golden, "rb") as f:
        assert blob == f.read(), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_metadata_bytes_are_unchanged(tmp_path):
    path = str(tmp_path / "ckpt")
    _check("single.pkl", save_single(path))
    loaded = {"model": {"w": torch.zeros(4, 6), "half": torch.zeros(3, 2, dtype=torch.bfloat16)}}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)  # plain DCP reads it
    assert torch.equal(loaded["model"]["w"], _single_state()["model"]["w"])


@pytest.mark.parametrize("world", [2], ids=lambda w: f"ranks{w}")
def test_multi_rank_metadata_bytes_are_unchanged(world, tmp_path, dist_run):
    path = str(tmp_path / "ckpt")
    blobs = dist_run(world, rank_save_two, path)
    assert blobs[0] == blobs[1]
    _check(f"ranks{world}.pkl", blobs[0])
