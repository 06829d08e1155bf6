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
- a remote that cannot be locked is an UploadError, not a plain StorageError;
- the irreversible steps under a fault (round five): a network cut before every change of an
  upload that replaces the step the remote `latest` names (a directory remote; byte counts on
  S3 behind the fault proxy), and of a plain upload with the remote's retention, left cut
  through close(): every `latest` names a committed step that loads bit-exact, no committed
  step is lost, close() uploads the step or raises RemoteLagError naming it; a node root's
  `latest` through a failed replacement of the step it names.
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
    RemoteLagError,
    RemoteTier,
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
        with pytest.raises(RemoteLagError, match=r": step 2 is committed locally only: its upload at close\(\) failed"):
            mgr.close()  # no later save will upload 2: said, not promised
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
    with pytest.raises(RemoteLagError) as info:
        mgr.close()  # the remote still down: step 2 stays local, and close() says so
    assert str(info.value).startswith(
        f"{uri}: step 2 is committed locally only: its upload at close() failed and no later save will try "
        f"again (1 step(s) not uploaded: 2; last failure: {uri}: cannot lock the remote root: "
    ), str(info.value)
    assert str(info.value).endswith("; a job that resumes from the local roots uploads it")
    assert info.value.path == uri

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


# -- a cut at every point of an upload that replaces a committed remote step ------------------


def _resaved(step: int) -> dict:
    """Another version of `step` (a rollback's re-save): other values, the same step."""
    state = _state(step + 1000)
    state["step"] = step
    return state


def _remote_version(uri: str, step: int) -> str | None:
    """Which version of `step` the remote holds committed: "old", "new" (`_resaved`), None when
    it holds none; a committed copy that loads as neither fails the test."""
    from ckptlib.loading.loading import load

    store = open_storage(uri)
    if classify(store.child(f"step_{step:010d}")) != "committed":
        return None
    got = _fresh()
    load(f"{uri.rstrip('/')}/step_{step:010d}", got)
    for name, want in (("old", _state(step)), ("new", _resaved(step))):
        if got["step"] == step and all(torch.equal(got["model"][k], v) for k, v in want["model"].items()):
            return name
    raise AssertionError(f"{uri}: step {step} holds neither version")


def _assert_remote_invariants(uri: str, kept: dict[int, set]) -> str | None:
    """The remote `latest` names a committed step whose files load bit-exact; every step in
    `kept` is committed there in one of the versions given (None: may be absent). Returns the
    version of step 30 the remote holds."""
    store = open_storage(uri)
    pointed = store.read_pointer("latest")
    assert pointed is not None
    step = int(pointed.split("_")[1])
    assert _remote_version(uri, step) is not None, f"the remote latest names {pointed}, not committed"
    versions = {s: _remote_version(uri, s) for s in kept}
    for s, allowed in kept.items():
        assert versions[s] in allowed, (s, versions[s], allowed)
    return versions[30]


def _rollback_resave_with_cut(tmp_path, uri: str, cut, restore) -> str | None:
    """Save 10, 20, 30 (all uploaded), roll back to 20 and save 30 again with the network cut by
    `cut()`; check the remote, bring it back and close: the new 30 reaches the remote."""
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=uri, remote_lag=RemoteLag(retry_after=0)))
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    assert mgr.wait().step == 30
    state = _fresh()
    assert mgr.load(state, step=20) == 20
    cut()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # StalePointerWarning (30 is replaced), RemoteUnavailableWarning
        mgr.save(30, _resaved(30))
        mgr.wait()
    restore()
    # never further back than the newest other committed step
    assert open_storage(uri).read_pointer("latest") in ("step_0000000020", "step_0000000030")
    held = _assert_remote_invariants(uri, {10: {"old"}, 20: {"old"}, 30: {None, "old", "new"}})
    mgr.close()  # uploads the new 30 if the cut left the remote without it
    assert open_storage(uri).read_pointer("latest") == "step_0000000030"
    assert _assert_remote_invariants(uri, {10: {"old"}, 20: {"old"}, 30: {"new"}}) == "new"
    restarted = CheckpointManager(local, cluster=Cluster(remote=uri))
    state = _fresh()
    assert restarted.load(state) == 30
    want = _resaved(30)
    assert all(torch.equal(state["model"][k], v) for k, v in want["model"].items())
    restarted.close()
    return held


def test_a_cut_anywhere_in_replacing_the_remote_latest_leaves_it_committed_on_a_directory(tmp_path, monkeypatch):
    from helpers.storage import LocalCut

    uri = str(tmp_path / "remote")
    cut = LocalCut(monkeypatch, uri)
    # how many changes the replacing upload makes: the cut falls before each of them in turn
    probe = tmp_path / "probe"
    probe.mkdir()
    counted: list[int] = []
    _rollback_resave_with_cut(probe, uri, lambda: counted.append(cut.changes), lambda: counted.append(cut.changes))
    total = counted[1] - counted[0]
    assert total >= 6, counted  # the lock, the pending marker, 2 files, the manifest, latest, ...
    seen = set()
    for n in range(total + 1):
        case = tmp_path / f"cut{n}"
        case.mkdir()
        open_storage(uri).delete_tree()
        seen.add(_rollback_resave_with_cut(case, uri, lambda n=n: cut.cut_after(n), cut.restore))
    assert seen >= {"old", "new"}, seen  # the sweep reached both ends of the upload


@pytest.mark.s3
@pytest.mark.parametrize("nbytes", [0, 700, 3000, 9000, 20000, 40000], ids=lambda n: f"cut{n}")
def test_a_cut_anywhere_in_replacing_the_remote_latest_leaves_it_committed_on_s3(
    tmp_path, monkeypatch, fault_proxy, s3_server, s3_root, nbytes
):
    proxy = fault_proxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    monkeypatch.setenv("CKPTLIB_S3_MAX_ATTEMPTS", "1")
    _rollback_resave_with_cut(tmp_path, s3_root, lambda: proxy.cut_after(nbytes), proxy.restore)


# -- a node root's `latest` through a failed replacement ------------------------------------------


@pytest.mark.parametrize("fail_at", ["shard", "manifest"])
def test_a_failed_resave_of_the_step_a_node_root_latest_names_leaves_it_on_a_committed_step(
    tmp_path, monkeypatch, fail_at
):
    from ckptlib.storage.local import LocalStorage

    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=str(tmp_path / "remote")))
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    mgr.wait()
    assert mgr.load(_fresh(), step=20) == 20  # the rollback; the root's latest still names 30
    store = open_storage(local)
    assert store.read_pointer("latest") == "step_0000000030"
    target = os.path.join(local, "step_0000000030")
    name = "__0_0.distcp" if fail_at == "shard" else MANIFEST_NAME
    real_open, real_write = LocalStorage.open_writer, LocalStorage.write

    def refuse(storage, path):
        if storage.uri.rstrip("/") == target and path == name:
            raise StorageError(f"{target}/{path}: injected: no space left on device")

    monkeypatch.setattr(LocalStorage, "open_writer", lambda s, p: refuse(s, p) or real_open(s, p))
    monkeypatch.setattr(LocalStorage, "write", lambda s, p, d, **k: refuse(s, p) or real_write(s, p, d, **k))
    with pytest.raises(StorageError, match="injected: no space left on device"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # StalePointerWarning: 30 is replaced
            mgr.save(30, _resaved(30))
    monkeypatch.undo()
    assert store.read_pointer("latest") == "step_0000000020"  # never a step without its manifest
    assert classify(store.child("step_0000000020")) == "committed"
    assert classify(store.child("step_0000000030")) != "committed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain reader of the root agrees, without a stale pointer
        assert CheckpointManager(local).latest() == 20
    state = _fresh()
    assert mgr.load(state) == 30  # the old 30, still committed on the remote: nothing committed is lost
    _assert_state(state, 30)
    assert mgr.last_load.bytes_by_source["remote"] > 0
    mgr.close()


def test_a_cut_anywhere_in_an_upload_and_its_retention_then_close_keeps_every_invariant(tmp_path, monkeypatch):
    """A new step's upload with the remote's retention (keep_last=1), cut before each of its
    changes in turn and left cut through close(): the remote `latest` names a committed step
    that loads bit-exact, the step it named before is gone only once the new one is committed
    and named, close() raises RemoteLagError naming the step the remote lacks, and a resumed
    job uploads it."""
    from helpers.storage import LocalCut

    uri = str(tmp_path / "remote")
    cut = LocalCut(monkeypatch, uri)

    def run(case, n):
        local = str(case / "local")
        remote = RemoteTier(uri, keep_last=1)
        mgr = CheckpointManager(local, cluster=Cluster(remote=remote, remote_lag=RemoteLag(retry_after=0)))
        for step in (1, 2):
            mgr.save(step, _state(step))
        assert mgr.wait().step == 2
        before = cut.changes
        if n is not None:
            cut.cut_after(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RemoteUnavailableWarning
            mgr.save(3, _state(3))
            mgr.wait()
            if n is None:
                mgr.close()
                return cut.changes - before
            held = _remote_version(uri, 3) if not cut.down else None
            if mgr.remote_lag.steps:
                with pytest.raises(RemoteLagError, match=r": step 3 is committed locally only: its upload at close"):
                    mgr.close()
            else:
                mgr.close()
        cut.restore()
        store = open_storage(uri)
        pointed = store.read_pointer("latest")
        assert pointed in ("step_0000000002", "step_0000000003"), (n, pointed)
        named = int(pointed[5:])
        assert _remote_version(uri, named) == "old", (n, pointed)
        if named == 2:
            assert _remote_version(uri, 3) in (None, "old") and held in (None, "old"), n
        restarted = CheckpointManager(local, cluster=Cluster(remote=uri))
        state = _fresh()
        assert restarted.load(state) == 3
        _assert_state(state, 3)
        restarted.wait()
        restarted.close()
        assert store.read_pointer("latest") == "step_0000000003" and _remote_version(uri, 3) == "old", n
        return named

    (tmp_path / "probe").mkdir()
    total = run(tmp_path / "probe", None)
    assert total >= 6, total
    named = set()
    for n in range(total + 1):
        open_storage(uri).delete_tree()
        (tmp_path / f"cut{n}").mkdir()
        named.add(run(tmp_path / f"cut{n}", n))
    assert named == {2, 3}, named  # the sweep reached both sides of the commit
