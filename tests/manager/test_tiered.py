"""The cluster tier on one node: `CheckpointManager(local_root, keep_last=N, remote=RemoteTier(URI, ...))`.

Saves block only for the local write; the upload runs in the background and the remote
`latest` moves only after a verified copy. Each test runs against a local-directory remote
and an S3 remote (a moto server on 127.0.0.1), including a process killed mid-upload and an
injected storage fault, both followed by a resume. The regression cases of issue 24 (a
rollback, a damaged step never uploaded, a damaged local copy with an intact remote one, a
remote that is down or cannot be locked) are in test_tier_faults.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers.manager import step_state as _state

import ckptlib
import ckptlib.manager.cluster.remote_tier as remote_tier
from ckptlib import AsyncMode, Cluster, RemoteLag, RemoteTier, RemoteUnavailableWarning
from ckptlib.errors import StateError, StorageError
from ckptlib.format import MANIFEST_NAME, classify
from ckptlib.format.verify import verify
from ckptlib.manager.cluster.cluster_tier import ClusterTier
from ckptlib.manager.manager import CheckpointManager
from ckptlib.manager.policies import KeepLast
from ckptlib.manager.single_root import SingleRoot
from ckptlib.storage import open_storage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "remote")
    return request.getfixturevalue("s3_root")


def _children(uri: str) -> list[str]:
    return sorted(n for n in open_storage(uri).list_children() if n.startswith("step_"))


def _assert_state(state: dict, step: int) -> None:
    want = _state(step)
    assert state["step"] == step
    for key, value in want["model"].items():
        assert torch.equal(state["model"][key], value), key


def _fresh() -> dict:
    return {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(7)}, "step": -1}


def test_constructor_arguments(tmp_path):
    local, far = str(tmp_path / "l"), str(tmp_path / "r")
    mgr = CheckpointManager(local, keep_last=2, cluster=Cluster(remote=RemoteTier(far, keep_last=5)))
    assert type(mgr) is CheckpointManager and isinstance(mgr.tier, ClusterTier)
    assert mgr.retention == KeepLast(2) and mgr.remote.retention == KeepLast(5)
    assert repr(mgr) == f"CheckpointManager({local!r}, remote={far!r})"
    plain = CheckpointManager(local)
    assert isinstance(plain.tier, SingleRoot) and plain.remote is None
    assert CheckpointManager(local, cluster=Cluster(remote=far)).remote.retention == KeepLast(
        None
    )  # a URI keeps every step
    concurrent = CheckpointManager(local, cluster=Cluster(remote=RemoteTier(far, upload_concurrency=7)))
    assert concurrent.remote.upload_concurrency == 7
    with pytest.raises(StateError, match="overlap"):
        CheckpointManager(local, cluster=Cluster(remote=str(tmp_path / "l" / "remote")))
    with pytest.raises(StateError, match="replicas must be a non-negative int, got -1"):
        Cluster(replicas=-1)
    with pytest.raises(StateError, match="upload_concurrency must be a positive int, got 0"):
        RemoteTier(far, upload_concurrency=0)
    with pytest.raises(StateError, match="remote must be a URI or a RemoteTier, got int 3"):
        Cluster(remote=3)
    with pytest.raises(StateError, match="cluster must be a ckptlib.Cluster, got str"):
        CheckpointManager(local, cluster=far)
    # async_save combines with a remote
    assert CheckpointManager(local, async_save=True, cluster=Cluster(remote=far)).tier.settings.mode == AsyncMode()


@pytest.mark.parametrize("keep_local,keep_remote", [(1, 2), (2, None)], ids=["local1-remote2", "local2-remoteall"])
def test_save_uploads_verifies_and_applies_both_retentions(tmp_path, remote, keep_local, keep_remote):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(
        local, keep_last=keep_local, cluster=Cluster(remote=RemoteTier(remote, keep_last=keep_remote))
    )
    for step in (1, 2, 3, 4):
        result = mgr.save(step, _state(step))
        assert result.uri == f"{local}/step_{step:010d}"  # the blocking part: the local copy
    uploaded = mgr.wait()
    assert uploaded.step == 4 and uploaded.uri == f"{remote.rstrip('/')}/step_0000000004"
    assert mgr.wait() is None  # nothing in flight any more
    assert _children(local) == [f"step_{s:010d}" for s in (1, 2, 3, 4)[-keep_local:]]
    remote_steps = [1, 2, 3, 4] if keep_remote is None else [3, 4]
    assert _children(remote) == [f"step_{s:010d}" for s in remote_steps]
    assert mgr.steps() == remote_steps and mgr.latest() == 4 and mgr.local_steps() == [1, 2, 3, 4][-keep_local:]
    assert open_storage(remote).read_pointer("latest") == "step_0000000004"
    for step in remote_steps:
        copy = open_storage(remote).child(f"step_{step:010d}")
        assert [p for p in verify(copy) if p.is_error] == []
        state = _fresh()
        ckptlib.load(copy, state)
        _assert_state(state, step)
    local_manifest = open_storage(local).child("step_0000000004").read(MANIFEST_NAME)
    assert open_storage(remote).child("step_0000000004").read(MANIFEST_NAME) == local_manifest
    commit = json.loads(local_manifest)["commit"]
    assert commit["seq"] == 4 and commit["parent"] == 3 and commit["nodes"] == [[0]]
    mgr.close()


def test_load_prefers_the_local_copy_only_when_it_is_the_same(tmp_path, remote):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, keep_last=1, cluster=Cluster(remote=remote))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.wait()
    state = _fresh()
    assert mgr.load(state) == 2
    result = mgr.last_load
    assert result.uri == f"{local}/step_0000000002" and result.step == 2
    assert result.bytes_by_source["remote"] == 0 and result.bytes_by_source["local"] > 0
    _assert_state(state, 2)

    # Another checkpoint under the same step name locally (not this run's commit): the remote copy is read.
    ckptlib.save(f"{local}/step_0000000002", _state(99), step=2, overwrite=True)
    state = _fresh()
    assert mgr.load(state) == 2
    assert mgr.last_load.uri == f"{remote.rstrip('/')}/step_0000000002"
    assert mgr.last_load.bytes_by_source["local"] == 0 and mgr.last_load.bytes_by_source["remote"] > 0
    _assert_state(state, 2)

    # Step 1 exists only remotely (keep_last=1 locally): read from the remote root.
    state = _fresh()
    assert mgr.load(state, step=1) == 1 and mgr.last_load.uri == f"{remote.rstrip('/')}/step_0000000001"
    _assert_state(state, 1)
    mgr.close()

    # A fresh local disk (a new machine): everything comes from the remote root.
    other = CheckpointManager(str(tmp_path / "new-local"), cluster=Cluster(remote=remote))
    state = _fresh()
    assert other.load(state) == 2
    _assert_state(state, 2)


def test_an_upload_failure_leaves_the_remote_latest_and_a_load_resumes_it(tmp_path, remote, monkeypatch):
    local = str(tmp_path / "local")
    cluster = Cluster(remote=RemoteTier(remote, upload_concurrency=1), remote_lag=RemoteLag(retry_after=0))
    mgr = CheckpointManager(local, keep_last=1, cluster=cluster)
    mgr.save(1, _state(1))
    mgr.wait()
    real_copy = remote_tier.copy_file
    copied: list[str] = []

    def failing_copy(src, dst, name, size, crc):
        if name.startswith("__"):
            with dst.open_writer(name) as out:  # half the shard reaches the remote, then the link drops
                out.write(src.read(name, 0, size // 2))
                raise StorageError(f"{dst.uri}/{name}: injected: connection reset")
        copied.append(name)
        real_copy(src, dst, name, size, crc)

    monkeypatch.setattr(remote_tier, "copy_file", failing_copy)
    mgr.save(2, _state(2))  # the local save succeeds; the upload fails in the background
    where = f"{remote.rstrip('/')}/step_0000000002/__0_0.distcp"
    with pytest.warns(RemoteUnavailableWarning, match="step 2 could not be uploaded; it stays local and committed"):
        assert mgr.wait() is None
    assert re.match(rf"rank 0: {where}: upload failed: .*injected: connection reset", mgr.remote_lag.error)
    assert mgr.wait() is None  # given once
    assert open_storage(remote).read_pointer("latest") == "step_0000000001"
    assert classify(open_storage(remote).child("step_0000000002")) == "incomplete"
    state = _fresh()
    monkeypatch.setattr(remote_tier, "copy_file", lambda *a: (copied.append(a[2]), real_copy(*a))[1])
    copied.clear()
    assert mgr.load(state) == 2  # the local copy: the newest commit
    _assert_state(state, 2)
    assert mgr.wait().step == 2  # then the upload resumed in the background
    assert copied == ["__0_0.distcp"]  # .metadata was complete remotely: not sent again
    assert open_storage(remote).read_pointer("latest") == "step_0000000002"
    assert [p for p in verify(open_storage(remote).child("step_0000000002")) if p.is_error] == []
    mgr.close()


def test_a_damaged_local_copy_is_never_committed_remotely(tmp_path, remote):
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=remote))
    mgr.save(1, _state(1))
    mgr.wait()

    real_read = open_storage(local).__class__.read

    def flipping_read(self, path, offset=0, length=None):
        data = real_read(self, path, offset, length)
        if path.startswith("__") and "step_0000000002" in self.uri and offset == 0:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    import ckptlib.storage.local as local_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_mod.LocalStorage, "read", flipping_read)
        mgr.save(2, _state(2))
        with pytest.raises(ckptlib.CheckpointCorruptError, match="does not match its manifest"):
            mgr.wait()
    assert open_storage(remote).read_pointer("latest") == "step_0000000001"
    mgr.close()


_CRASHING_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, sys.argv[3])
    import ckptlib, ckptlib.manager.cluster.remote_tier as remote_tier
    from helpers.manager import step_state

    real_copy = remote_tier.copy_file

    def slow_copy(src, dst, name, size, crc):
        if name.startswith("__") and "step_0000000002" in src.uri:
            with dst.open_writer(name) as out:
                out.write(src.read(name, 0, size // 2))
                print("UPLOADING", flush=True)
                time.sleep(600)  # killed here, mid-file
        real_copy(src, dst, name, size, crc)

    remote_tier.copy_file = slow_copy
    far = ckptlib.RemoteTier(sys.argv[2], upload_concurrency=1)
    mgr = ckptlib.CheckpointManager(sys.argv[1], keep_last=1, cluster=ckptlib.Cluster(remote=far))
    mgr.save(1, step_state(1))
    mgr.wait()
    mgr.save(2, step_state(2))
    print("SAVED", flush=True)
    time.sleep(600)
    """
)


def test_killed_mid_upload_then_the_next_start_resumes(tmp_path, remote):
    local = str(tmp_path / "local")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_CHILD, local, remote, os.path.join(REPO, "tests")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])),
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if "UPLOADING" in lines and "SAVED" in lines:
                break
        assert "UPLOADING" in lines and "SAVED" in lines, proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    store = open_storage(remote)
    assert store.read_pointer("latest") == "step_0000000001"  # the crash left the remote latest intact
    assert classify(store.child("step_0000000002")) != "committed"
    assert classify(open_storage(local).child("step_0000000002")) == "committed"
    # The crashed writer's locks (a dead pid on this host) are removed as stale by the next
    # start: the remote's by the upload it resumes, the local root's by its first save.
    with pytest.warns(ckptlib.StaleLockWarning) as caught:
        mgr = CheckpointManager(local, keep_last=1, cluster=Cluster(remote=RemoteTier(remote, keep_last=1)))
        state = _fresh()
        assert mgr.load(state) == 2
        _assert_state(state, 2)
        assert mgr.wait().step == 2
        assert store.read_pointer("latest") == "step_0000000002"
        assert _children(remote) == ["step_0000000002"]  # keep_last=1 and the debris is gone
        assert [p for p in verify(store.child("step_0000000002")) if p.is_error] == []
        mgr.save(3, _state(3))
    stale = sorted(str(w.message).split(": removing")[0] for w in caught if w.category is ckptlib.StaleLockWarning)
    assert stale == sorted([local, remote])
    mgr.close()
    assert store.read_pointer("latest") == "step_0000000003"


def _ranks_save(local: str, remote: str) -> list:
    mgr = CheckpointManager(
        local, keep_last=1, async_save=True, cluster=Cluster(remote=RemoteTier(remote, keep_last=2))
    )
    for step in (1, 2, 3):
        state = {"w": torch.full((5,), float(step * 10)), "step": step}
        handle = mgr.save(step, state)
        assert isinstance(handle, ckptlib.AsyncSave)
    uploaded = mgr.wait()
    loaded = {"w": torch.zeros(5), "step": -1}
    mgr.load(loaded)
    where = mgr.last_load.uri
    mgr.close()
    return [uploaded.step, where, loaded["step"], loaded["w"].tolist()]


def test_multi_rank_async_upload_and_load(tmp_path, remote, dist_run):
    local = str(tmp_path / "local")
    results = dist_run(2, _ranks_save, local, remote)
    for uploaded, where, step, values in results:
        assert uploaded == 3 and where == f"{local}/step_0000000003" and step == 3 and values == [30.0] * 5
    assert _children(remote) == ["step_0000000002", "step_0000000003"]
    manifest = json.loads(open_storage(remote).child("step_0000000003").read(MANIFEST_NAME))
    assert manifest["world_size"] == 2 and manifest["commit"]["nodes"] == [[0, 1]]
    assert _children(local) == ["step_0000000003"]


def test_async_save_blocks_only_for_staging_and_the_next_save_waits_for_the_upload(tmp_path, monkeypatch):
    import threading

    remote = str(tmp_path / "remote")
    gate = threading.Event()
    real_copy = remote_tier.copy_file

    def gated_copy(*args):
        gate.wait(30)
        real_copy(*args)

    monkeypatch.setattr(remote_tier, "copy_file", gated_copy)
    mgr = CheckpointManager(str(tmp_path / "local"), async_save=True, cluster=Cluster(remote=remote))
    handle = mgr.save(1, _state(1))
    assert handle.wait().uri.endswith("local/step_0000000001")  # the local write commits at once
    assert not mgr.tier._job.done()  # the upload waits at the gate
    threading.Timer(0.5, gate.set).start()
    mgr.save(2, _state(2))  # waits for upload 1 first
    assert open_storage(remote).read_pointer("latest") == "step_0000000001"
    assert mgr.wait().step == 2
    mgr.close()


def test_overwrite_replaces_the_remote_latest_too(tmp_path, remote):
    mgr = CheckpointManager(str(tmp_path / "local"), keep_last=2, cluster=Cluster(remote=remote))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.wait()
    with pytest.raises(ckptlib.CheckpointExistsError, match="step 2 is the newest committed checkpoint"):
        mgr.save(2, _state(5))
    mgr.save(2, _state(5), overwrite=True)
    assert mgr.wait().step == 2
    state = _fresh()
    ckptlib.load(f"{remote.rstrip('/')}/step_0000000002", state)
    _assert_state(state, 5)
    assert open_storage(remote).read_pointer("latest") == "step_0000000002"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr.close()
