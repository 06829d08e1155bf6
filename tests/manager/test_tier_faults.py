"""Issue 24's regression cases for the cluster tier, each against a local-directory remote and an
S3 remote (moto on 127.0.0.1):

- after a rollback (save 10, 20, 30; load 20; save 25) a restarted job resumes 25, the newest
  commit, never 30, the highest step, and never moves the remote `latest` back to 30;
- a committed step never uploaded and later damaged is skipped with a warning and blocks
  nothing: `load()`, `load(step=1)` and `save()` all work;
- a damaged local copy falls back to the intact remote copy of the same step;
- a remote that is down never blocks loading an intact local step, and an upload to it leaves
  the step local (a RemoteUnavailableWarning; with `RemoteLag(steps=0)` an UploadError) with
  the remote `latest` unchanged;
- a remote that cannot be locked is an UploadError, not a plain StorageError.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from helpers.manager import step_state as _state
from helpers.storage import remote_that_goes_down

import ckptlib.manager.cluster.remote_tier as remote_tier
from ckptlib import (
    Cluster,
    CopyFallbackWarning,
    RemoteLag,
    RemoteUnavailableWarning,
    SkippedDamagedStepWarning,
    StorageError,
    UploadError,
)
from ckptlib.format import MANIFEST_NAME, classify
from ckptlib.manager.manager import CheckpointManager
from ckptlib.storage import open_storage


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "remote")
    return request.getfixturevalue("s3_root")


def _fresh() -> dict:
    return {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(7)}, "step": -1}


def _assert_state(state: dict, step: int) -> None:
    want = _state(step)
    assert state["step"] == step
    for key, value in want["model"].items():
        assert torch.equal(state["model"][key], value), key


def _fail_uploads_of(monkeypatch, step: int) -> None:
    real = remote_tier.copy_file

    def copy(src, dst, name, size, crc):
        if f"step_{step:010d}" in dst.uri:
            raise StorageError(f"{dst.uri}/{name}: injected: the network is down")
        real(src, dst, name, size, crc)

    monkeypatch.setattr(remote_tier, "copy_file", copy)


def _shard(local: str, step: int) -> str:
    return os.path.join(local, f"step_{step:010d}", "__0_0.distcp")


#: A failed upload is an error at once (the default keeps the step local and warns: test_remote_lag).
STRICT = RemoteLag(steps=0)


def test_a_rollback_resumes_the_newest_commit_never_the_highest_step(tmp_path, remote, monkeypatch):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=remote, remote_lag=STRICT))
    for step in (10, 20):
        mgr.save(step, _state(step))
    mgr.wait()
    with monkeypatch.context() as patch:
        _fail_uploads_of(patch, 30)
        mgr.save(30, _state(30))
        with pytest.raises(UploadError):
            mgr.wait()
    state = _fresh()
    assert mgr.load(state, step=20) == 20  # the rollback
    _assert_state(state, 20)
    assert mgr.wait() is None  # 20 is on the remote: nothing to upload
    mgr.save(25, _state(25))
    assert mgr.wait().step == 25
    mgr.close()
    store = open_storage(remote)
    assert store.read_pointer("latest") == "step_0000000025"

    restarted = CheckpointManager(local, cluster=Cluster(remote=remote))
    assert restarted.latest() == 25
    state = _fresh()
    assert restarted.load(state) == 25  # not 30: 25 was committed after it
    _assert_state(state, 25)
    assert restarted.wait() is None  # and 30 is not uploaded over the remote latest
    assert store.read_pointer("latest") == "step_0000000025"
    assert classify(store.child("step_0000000030")) != "committed"
    commit = json.loads(store.child("step_0000000025").read(MANIFEST_NAME))["commit"]
    assert commit["parent"] == 20 and commit["seq"] == 4
    restarted.save(26, _state(26))
    assert restarted.wait().step == 26
    restarted.close()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_step_never_uploaded_is_skipped_and_blocks_nothing(tmp_path, remote, monkeypatch, damage):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=remote, remote_lag=STRICT))
    mgr.save(1, _state(1))
    mgr.wait()
    with monkeypatch.context() as patch:
        _fail_uploads_of(patch, 2)
        mgr.save(2, _state(2))
        with pytest.raises(UploadError, match="injected: the network is down"):
            mgr.wait()
    mgr.close()
    path = _shard(local, 2)
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.path.getsize(path) // 2)
        else:
            f.seek(os.path.getsize(path) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    restarted = CheckpointManager(local, cluster=Cluster(remote=remote))
    state = _fresh()
    with pytest.warns(SkippedDamagedStepWarning, match="step 2"):
        assert restarted.load(state) == 1
    _assert_state(state, 1)
    state = _fresh()
    assert restarted.load(state, step=1) == 1
    _assert_state(state, 1)
    restarted.save(3, _state(3))
    assert restarted.wait().step == 3
    assert open_storage(remote).read_pointer("latest") == "step_0000000003"
    state = _fresh()
    assert restarted.load(state) == 3
    _assert_state(state, 3)
    restarted.close()


def test_a_damaged_local_copy_falls_back_to_the_intact_remote_one(tmp_path, remote):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=remote))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.wait()
    mgr.close()
    path = _shard(local, 2)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    restarted = CheckpointManager(local, cluster=Cluster(remote=remote))
    state = _fresh()
    with pytest.warns(CopyFallbackWarning):
        assert restarted.load(state) == 2
    _assert_state(state, 2)
    assert restarted.last_load.bytes_by_source["remote"] > 0
    restarted.close()


@pytest.fixture
def remote_down(request, tmp_path, monkeypatch):
    """(remote URI, take_down(), bring_up()): an S3 remote behind a fault proxy, or a
    directory remote whose storage calls fail."""
    return remote_that_goes_down(request, tmp_path, monkeypatch, request.param)


@pytest.mark.parametrize("remote_down", ["local", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_a_remote_that_is_down_never_blocks_an_intact_local_step(tmp_path, remote_down):
    uri, take_down, bring_up = remote_down
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=uri))
    mgr.save(1, _state(1))
    mgr.wait()
    take_down()
    mgr.save(2, _state(2))  # the local save does not need the remote
    with pytest.warns(RemoteUnavailableWarning, match=f"{re.escape(uri)}: cannot lock the remote root"):
        assert mgr.wait() is None  # the step stays local: nothing raised
    assert mgr.remote_lag.steps == (2,)
    mgr.close()

    restarted = CheckpointManager(local, cluster=Cluster(remote=uri))
    state = _fresh()
    with pytest.warns(RemoteUnavailableWarning, match="cannot read the remote root"):
        assert restarted.load(state) == 2
    _assert_state(state, 2)
    assert restarted.wait() is None  # no upload attempted against a remote known to be down
    bring_up()
    assert open_storage(uri).read_pointer("latest") == "step_0000000001"
    restarted.save(3, _state(3))
    assert restarted.wait().step == 3
    assert open_storage(uri).read_pointer("latest") == "step_0000000003"
    restarted.close()


def test_a_remote_that_cannot_be_locked_is_an_upload_error(tmp_path, remote):
    local = str(tmp_path / "local")
    store = open_storage(remote)
    lock = {"format": "ckptlib-lock", "host": "another-host", "pid": 4242, "token": "t", "created": "2026-01-01"}
    store.write("ckptlib.lock", json.dumps(lock).encode())
    mgr = CheckpointManager(local, cluster=Cluster(remote=remote))
    mgr.save(1, _state(1))
    with pytest.raises(UploadError, match=r"cannot lock the remote root: LockedError: .* another-host") as info:
        mgr.wait()
    assert type(info.value) is UploadError
    assert store.read_pointer("latest") is None
    store.delete(["ckptlib.lock"])
    mgr.save(2, _state(2))
    assert mgr.wait().step == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr.close()
