"""A root lock carries a lease its holder renews while it works (issue 33): a lock whose lease
was not renewed for longer than the lease is stale whichever host wrote it (warned, then
taken), so a node killed mid-upload never leaves the remote root locked for good when the job
restarts on another host; a holder that renews is never taken over; a lock without a lease
(before 0.2) on another host is still removed only explicitly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import warnings

import pytest
import torch

from ckptlib import CheckpointManager, Cluster
from ckptlib.errors import LockedError
from ckptlib.manager.lock import LEASE_PREFIX, LOCK_NAME, RootLock, StaleLockWarning
from ckptlib.storage import open_storage


def _foreign_lock(root: str, *, lease_s: float | None, renewed_ago: float | None, created: str | None = None) -> str:
    """A lock of pid 4242 on another host; its lease renewed `renewed_ago` seconds ago (None:
    never renewed)."""
    token = uuid.uuid4().hex
    doc = {"format": "ckptlib-lock", "host": "another-host", "pid": 4242, "token": token, "start": None}
    doc["created"] = created or "2026-01-01T00:00:00+00:00"
    if lease_s is not None:
        doc["lease_s"] = lease_s
    store = open_storage(root)
    store.write(LOCK_NAME, json.dumps(doc).encode())
    if renewed_ago is not None:
        store.write(LEASE_PREFIX + token, repr(time.time() - renewed_ago).encode())
    return token


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_expired_lease_of_another_host_is_stale(tmp_path):
    root = str(tmp_path)
    stale = _foreign_lock(root, lease_s=60.0, renewed_ago=3600.0)
    lock = RootLock(open_storage(root))
    with pytest.warns(StaleLockWarning) as record:
        lock.acquire()
    message = str(record[0].message)
    assert message.startswith(f"{root}: removing a stale lock left by pid 4242 on host another-host, since 2026-01-01")
    assert "(its 60 s lease expired: last renewed 36" in message
    assert lock.held() and lock.token != stale
    assert sorted(os.listdir(root)) == [LOCK_NAME]  # the stale holder's lease went with its lock
    lock.release()
    assert os.listdir(root) == []


def test_a_lease_never_renewed_expires_from_the_lock_s_creation(tmp_path):
    root = str(tmp_path)
    _foreign_lock(root, lease_s=30.0, renewed_ago=None)
    lock = RootLock(open_storage(root))
    with pytest.warns(StaleLockWarning, match=r"its 30 s lease expired: last taken \d+ s ago"):
        lock.acquire()
    lock.release()


@pytest.mark.parametrize("lease", ["renewed-now", "no-lease"])
def test_a_live_lease_or_a_lock_without_one_is_not_taken(tmp_path, lease):
    root = str(tmp_path)
    if lease == "renewed-now":
        _foreign_lock(root, lease_s=60.0, renewed_ago=0.0)
    else:  # a 0.1 lock: its host is not this one, and nothing says when it stopped
        _foreign_lock(root, lease_s=None, renewed_ago=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleLockWarning)
        with pytest.raises(LockedError, match="is locked by another writer: pid 4242 on host another-host"):
            RootLock(open_storage(root)).acquire()


WRITER = r"""
import sys, warnings
from ckptlib.errors import LockedError
from ckptlib.manager.lock import RootLock
from ckptlib.storage import open_storage
warnings.simplefilter("error")
try:
    RootLock(open_storage(sys.argv[1])).acquire()
    print("took it")
except LockedError as exc:
    print("locked:", type(exc).__name__)
"""


def test_the_holder_renews_its_lease_and_another_process_cannot_take_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTLIB_LOCK_LEASE_S", "20")  # renewed every 5 s
    root = str(tmp_path)
    lock = RootLock(open_storage(root))
    lock.acquire()
    lease_file = tmp_path / (LEASE_PREFIX + lock.token)
    _wait_for(lease_file.exists, "the first renewal")
    first = float(lease_file.read_text())
    _wait_for(lambda: float(lease_file.read_text()) > first, "the second renewal")
    done = subprocess.run([sys.executable, "-c", WRITER, root], capture_output=True, text=True, timeout=240)
    assert done.stdout.strip() == "locked: LockedError", done.stderr
    lock.release()
    assert os.listdir(root) == []  # the lock and its lease
    done = subprocess.run([sys.executable, "-c", WRITER, root], capture_output=True, text=True, timeout=240)
    assert done.stdout.strip() == "took it", done.stderr


def test_an_upload_takes_over_the_remote_lock_of_a_node_killed_on_another_host(tmp_path):
    remote = str(tmp_path / "remote")
    os.makedirs(remote)
    _foreign_lock(remote, lease_s=60.0, renewed_ago=600.0)  # killed mid-upload 10 minutes ago
    mgr = CheckpointManager(str(tmp_path / "node"), cluster=Cluster(remote=remote))
    with pytest.warns(StaleLockWarning, match=r"another-host, .*\(its 60 s lease expired: last renewed 6\d\d s ago\)"):
        mgr.save(1, {"w": torch.ones(8), "step": 1})  # the upload runs in the background
        assert mgr.wait().step == 1
    assert open_storage(remote).read_pointer("latest") == "step_0000000001"
    mgr.close()
    assert not os.path.exists(os.path.join(remote, LOCK_NAME))


@pytest.mark.parametrize("path", ["acquire", "lock_holder", "take-while-held"])
def test_a_lock_file_that_cannot_be_read_is_a_storage_error_not_a_holder(tmp_path, monkeypatch, path):
    """A failed read of the lock file (the storage unreachable) is a StorageError naming the
    lock file on every path that reads it, never an unknown holder: not a LockedError from
    acquire(), not LockHolder() from lock_holder(), not "removed while it held it" from take()."""
    import ckptlib.storage.local as local_storage
    from ckptlib.errors import StorageError

    root = str(tmp_path)
    mgr = CheckpointManager(root, hold_lock=True)
    if path == "take-while-held":
        mgr.save(1, {"w": torch.ones(4), "step": 1})  # takes the lock and keeps it
    else:
        _foreign_lock(root, lease_s=60.0, renewed_ago=0.0)
    real = local_storage.LocalStorage.read

    def read(self, name, *args, **kwargs):
        if name == LOCK_NAME:
            raise StorageError(f"{self.uri}/{name}: injected: connection reset", path=f"{self.uri}/{name}")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(local_storage.LocalStorage, "read", read)
    with pytest.raises(StorageError, match="injected: connection reset") as caught:
        if path == "acquire":
            RootLock(open_storage(root)).acquire()
        elif path == "lock_holder":
            mgr.lock_holder()
        else:
            mgr.save(2, {"w": torch.ones(4), "step": 2})
    assert caught.value.path == os.path.join(root, LOCK_NAME)
    monkeypatch.setattr(local_storage.LocalStorage, "read", real)
    mgr.close()
