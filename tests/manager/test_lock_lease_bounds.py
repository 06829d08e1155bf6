"""The lease of a root lock at its bounds, on a wall clock the test fixes: a lease idle exactly
its length still holds and one a second past it has expired (judged on the wall clock, the
one hosts share), the expiry message gives the idle time, this process's own lock is never
judged by its lease, `CKPTLIB_LOCK_LEASE_S` and a lock file's `lease_s` accept only positive
numbers, the holder renews every quarter of the lease, and removing a lock (stale or broken
explicitly) removes its lease file with it."""

from __future__ import annotations

import json
import os
import types
import uuid

import pytest

from ckptlib.manager import lock as lock_module
from ckptlib.manager.lock import DEFAULT_LEASE_SECONDS, LEASE_PREFIX, LOCK_NAME, LockHolder, RootLock, lease_seconds
from ckptlib.storage import open_storage

NOW = 1_800_000_000.0


@pytest.fixture
def wall(monkeypatch):
    """lock.py's clock fixed at NOW (only its wall clock: a lease is never judged on another)."""
    monkeypatch.setattr(lock_module, "time", types.SimpleNamespace(time=lambda: NOW))


def _foreign(root: str, lease_s, renewed_at: float | None) -> LockHolder:
    token = uuid.uuid4().hex
    doc = {"format": "ckptlib-lock", "host": "another-host", "pid": 4242, "token": token, "start": None}
    doc["created"] = "2026-01-01T00:00:00+00:00"
    if lease_s is not None:
        doc["lease_s"] = lease_s
    store = open_storage(root)
    store.write(LOCK_NAME, json.dumps(doc).encode())
    if renewed_at is not None:
        store.write(LEASE_PREFIX + token, repr(renewed_at).encode())
    return LockHolder.parse(store.read(LOCK_NAME))


@pytest.mark.parametrize(
    ("idle", "why"),
    [
        (0.0, None),
        (59.5, None),
        (60.0, None),  # exactly the lease: still held
        (61.0, "its 60 s lease expired: last renewed 61 s ago"),
        (3600.0, "its 60 s lease expired: last renewed 3600 s ago"),
    ],
    ids=["now", "within", "exactly", "one-past", "an-hour"],
)
def test_a_lease_expires_only_past_its_length(tmp_path, wall, idle, why):
    holder = _foreign(str(tmp_path), 60.0, NOW - idle)
    assert RootLock(open_storage(str(tmp_path))).expired(holder) == why


def test_this_process_s_own_lock_is_never_judged_by_its_lease(tmp_path):
    lock = RootLock(open_storage(str(tmp_path)))
    lock.acquire()
    try:
        (tmp_path / (LEASE_PREFIX + lock.token)).write_text(repr(0.0))  # renewed in 1970, says the file
        assert lock.expired(lock.holder()) is None
    finally:
        lock.release()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("30", 30.0),
        ("0.5", 0.5),
        ("0", DEFAULT_LEASE_SECONDS),
        ("-5", DEFAULT_LEASE_SECONDS),
        ("soon", DEFAULT_LEASE_SECONDS),
    ],
)
def test_the_lease_comes_from_the_environment(monkeypatch, text, value):
    monkeypatch.setenv("CKPTLIB_LOCK_LEASE_S", text)
    assert lease_seconds() == value
    monkeypatch.delenv("CKPTLIB_LOCK_LEASE_S")
    assert lease_seconds() == DEFAULT_LEASE_SECONDS == 120.0


@pytest.mark.parametrize(("lease", "parsed"), [(60, 60.0), (0.5, 0.5), (0, None), (-3, None), ("60", None)])
def test_a_lock_file_s_lease_must_be_a_positive_number(tmp_path, wall, lease, parsed):
    holder = _foreign(str(tmp_path), lease, NOW - 1e6)
    assert holder.lease_s == parsed
    expired = RootLock(open_storage(str(tmp_path))).expired(holder)
    assert (expired is None) is (parsed is None)  # a lock without a valid lease is never taken by lease


def test_the_holder_renews_every_quarter_of_its_lease(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTLIB_LOCK_LEASE_S", "20")
    lock = RootLock(open_storage(str(tmp_path)))
    lock.acquire()
    try:
        assert lock._renewer is not None and lock._renewer.interval == 5.0
        saved = json.loads((tmp_path / LOCK_NAME).read_text())
        assert saved["lease_s"] == 20.0
    finally:
        lock.release()


def test_breaking_a_lock_removes_its_lease_file(tmp_path):
    holder = _foreign(str(tmp_path), 60.0, NOW)
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, LEASE_PREFIX + holder.token])
    broken = RootLock(open_storage(str(tmp_path))).break_()
    assert broken is not None and broken.token == holder.token
    assert os.listdir(tmp_path) == []
