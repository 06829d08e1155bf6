"""A failure inside DCP's save or load reaches the caller as a ckptlib error naming the rank
it happened on (DCP gathers it into a CheckpointException, ckptlib unwraps it): a ckptlib
error keeps its type and gets the rank, anything else becomes a CheckpointError with its type
in the message. One process, with a storage whose shard writes or reads fail; and two ranks,
where the coordinator's own step fails with an error that cannot be pickled."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointError, StorageError
from ckptlib._torch import dcp_shims
from ckptlib.format import MANIFEST_NAME
from ckptlib.format.write import transaction
from ckptlib.storage.local import LocalStorage


class _FailingShards(LocalStorage):
    """Local storage whose shard files (.distcp) cannot be written or read."""

    def __init__(self, root: str, error: BaseException):
        super().__init__(root)
        self.error = error

    def open_writer(self, path):
        if path.endswith(".distcp"):
            raise self.error
        return super().open_writer(path)

    def read(self, path, offset=0, length=None):
        if path.endswith(".distcp"):
            raise self.error
        return super().read(path, offset, length)


def test_a_ckptlib_error_in_a_shard_write_keeps_its_type_and_names_the_rank(tmp_path):
    storage = _FailingShards(str(tmp_path / "c"), StorageError("the disk is on fire", path="x"))
    with pytest.raises(StorageError) as caught:
        ckptlib.save(storage, {"w": torch.ones(4)})
    assert str(caught.value) == "rank 0: the disk is on fire"
    assert caught.value.args == ("rank 0: the disk is on fire",)
    assert caught.value.rank == 0 and caught.value.path == "x"
    target = tmp_path / "c"
    assert not target.exists() or os.listdir(target) == []  # nothing of the failed save is left


def test_any_other_error_in_a_shard_write_becomes_a_checkpoint_error_naming_rank_and_type(tmp_path):
    storage = _FailingShards(str(tmp_path / "c"), RuntimeError("boom"))
    with pytest.raises(CheckpointError) as caught:
        ckptlib.save(storage, {"w": torch.ones(4)})
    assert type(caught.value) is CheckpointError
    assert str(caught.value) == "rank 0: RuntimeError: boom"
    assert caught.value.rank == 0
    assert isinstance(caught.value.__cause__, dcp_shims.checkpoint_exception_cls())


def test_an_error_in_a_shard_read_names_the_rank(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(4)})
    storage = _FailingShards(str(tmp_path / "c"), RuntimeError("boom"))
    target = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointError) as caught:
        ckptlib.load(storage, target)
    assert type(caught.value) is CheckpointError
    assert str(caught.value) == "rank 0: RuntimeError: boom" and caught.value.rank == 0
    assert target["w"].tolist() == [0.0] * 4


def _save_with_a_commit_that_fails(uri: str):
    class LocalFailure(Exception):
        """Defined in a function: pickle cannot send it to the other ranks as it is."""

    def commit_manifest(*args, **kwargs):
        raise LocalFailure("the manifest write failed")

    transaction.commit_manifest = commit_manifest  # this rank's process only
    ckptlib.save(uri, {"w": torch.full((4,), float(dist.get_rank()))})


def test_a_coordinator_failure_of_any_type_reaches_every_rank(tmp_path, dist_run):
    """The coordinator turns its failure into a CheckpointError that DCP can send to every
    rank (`format.transaction._on_coordinator`); the raw error would break DCP's broadcast."""
    uri = str(tmp_path / "c")
    results = dist_run(2, _save_with_a_commit_that_fails, uri, return_exceptions=True, timeout=90)
    assert [type(r) for r in results] == [CheckpointError] * 2, results
    for r in results:
        assert str(r).startswith("rank 0: ") and str(r).endswith("LocalFailure: the manifest write failed"), str(r)
        assert r.rank == 0
    assert not os.path.exists(os.path.join(uri, MANIFEST_NAME))


def _save_with_failing_shard_writes(uri: str):
    rank = dist.get_rank()

    def open_writer(self, path):
        raise RuntimeError(f"boom on rank {rank}")

    LocalStorage.open_writer = open_writer  # this rank's process only
    ckptlib.save(uri, {"w": torch.full((4,), float(rank))})


def test_failures_on_several_ranks_name_them_all_and_the_first(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    results = dist_run(2, _save_with_failing_shard_writes, uri, return_exceptions=True, timeout=90)
    assert [type(r) for r in results] == [CheckpointError] * 2, results
    for r in results:
        assert str(r) == "rank 0: RuntimeError: boom on rank 0; rank 1: RuntimeError: boom on rank 1"
        assert r.rank == 0
