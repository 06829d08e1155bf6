"""The root lock is never held twice, whatever the interleaving of two writers that both find
a stale lock (its holder died): the second writer is run, to completion, before each storage
operation of the first in turn (every interleaving of "one whole acquire inside the other"),
and in every one exactly one of them holds the root and the lock file names it.

Before: removing a stale lock was check-then-delete, so a writer that had judged the lock
stale deleted the lock the other writer had just created in its place, and both held the root.
Now a stale lock is removed by compare-and-delete under a claim that one writer at a time can
create (`create_exclusive`), and only while the lock still carries the stale holder's token.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
import warnings

import pytest
from helpers.interleave import Interleaved, InterleavedProxy

from ckptlib.errors import LockedError
from ckptlib.manager.lock import LEASE_PREFIX, LOCK_NAME, RootLock, StaleLockWarning
from ckptlib.storage import LocalStorage, is_remote, open_storage


def _stale_lock(root: str, kind: str = "dead-pid") -> str:
    """A lock left by a holder that no longer runs: this pid with a token no live lock has
    ("dead-pid"), or a holder on another host whose lease expired an hour ago ("lease")."""
    token = uuid.uuid4().hex
    doc = {"format": "ckptlib-lock", "host": socket.gethostname(), "pid": os.getpid(), "token": token, "start": None}
    if kind == "lease":
        doc.update(host="a-host-gone-for-good", pid=4242, created="2026-01-01T00:00:00+00:00", lease_s=60.0)
        open_storage(root).write(LEASE_PREFIX + token, repr(time.time() - 3600).encode())
    open_storage(root).write(LOCK_NAME, json.dumps(doc).encode())
    return token


def _lock_token(root: str) -> str | None:
    try:
        return json.loads(bytes(open_storage(root).read(LOCK_NAME)))["token"]
    except FileNotFoundError:
        return None


def _race(root: str, at: int | None) -> tuple[list, list]:
    """Writer B acquires with writer A's whole acquire run just before B's `at`-th storage
    operation; returns (outcomes, B's operations), each outcome the lock or the LockedError."""
    a = RootLock(open_storage(root))
    outcome: dict[str, object] = {}

    def run_a() -> None:
        try:
            a.acquire()
            outcome["a"] = a
        except LockedError as exc:
            outcome["a"] = exc

    local = not is_remote(root)
    storage = Interleaved(root, at, run_a) if local else InterleavedProxy(open_storage(root), at, run_a)
    b = RootLock(storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleLockWarning)
        try:
            b.acquire()
            outcome["b"] = b
        except LockedError as exc:
            outcome["b"] = exc
    ops = list(storage.ops)
    if "a" not in outcome and at is not None:  # after B's last operation
        run_a()
    return [outcome.get("a"), outcome["b"]], ops


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def base(request, tmp_path) -> str:
    """Where each interleaving gets a root of its own: a local directory, or an S3 prefix."""
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3_root")


@pytest.mark.parametrize("kind", ["dead-pid", "lease"])
def test_every_interleaving_of_two_writers_breaking_one_stale_lock(base, kind):
    root = f"{base}/first"
    _stale_lock(root, kind)
    _, ops = _race(root, None)  # B alone: how many storage operations it takes
    assert len(ops) >= 3, ops
    RootLock(open_storage(root)).break_()
    for at in range(len(ops) + 1):
        root = f"{base}/at{at}"
        stale = _stale_lock(root, kind)
        (a, b), _ = _race(root, at)
        holders = [w for w in (a, b) if isinstance(w, RootLock)]
        try:
            assert len(holders) == 1, (at, ops[at] if at < len(ops) else "end", a, b)
            (holder,) = holders
            assert holder.held() and _lock_token(root) == holder.token != stale
            loser = b if holder is a else a
            assert isinstance(loser, LockedError), (at, loser)
        finally:
            for w in holders:
                w.release()
        assert _lock_token(root) is None
        assert open_storage(root).list() == {}, (at, open_storage(root).list())  # no claim left behind


def test_a_claim_left_by_a_dead_breaker_does_not_block_for_good(tmp_path):
    """A writer that died while it held the claim to remove a stale lock: its claim is itself
    stale, so the next writer removes both and takes the root."""
    root = str(tmp_path)
    stale = _stale_lock(root)
    dead_breaker = RootLock(Interleaved(root, None, lambda: None))

    class Died(Exception):
        pass

    def die() -> None:
        raise Died

    # The breaker dies right after it created its claim (its first create_exclusive that succeeds
    # is the claim: the lock's own create failed because the stale lock is there).
    storage = dead_breaker.storage
    real_create = storage.create_exclusive

    def create_then_die(path, data):
        made = real_create(path, data)
        if made and path != LOCK_NAME:
            die()
        return made

    storage.create_exclusive = create_then_die
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleLockWarning)
        with pytest.raises(Died):
            dead_breaker.acquire()
        dead_breaker.forget()
        leftovers = sorted(os.listdir(root))
        assert LOCK_NAME in leftovers and len(leftovers) == 2, leftovers  # the stale lock and the claim
        assert _lock_token(root) == stale
        writer = RootLock(LocalStorage(root))
        writer.acquire()
    try:
        assert _lock_token(root) == writer.token
        assert sorted(os.listdir(root)) == [LOCK_NAME]
    finally:
        writer.release()


def test_a_holder_that_renews_while_a_breaker_holds_the_claim_keeps_its_lock(tmp_path):
    """A holder whose lease ran out (paused) comes back and renews it after another writer
    judged the lock stale and took the claim to remove it: under the claim the breaker reads
    the lease again and leaves the lock alone (LockedError), so the holder's fenced steps stay
    its own. Before, the breaker deleted the lock on the token alone and both held the root."""
    dry = str(tmp_path / "dry")
    _stale_lock(dry, "lease")
    _, ops = _race(dry, None)  # B alone: where it creates its claim
    claim_at = next(i for i, (op, _, name) in enumerate(ops) if op == "create_exclusive" and ".break-" in str(name))
    root = str(tmp_path / "root")
    stale = _stale_lock(root, "lease")

    def holder_renews() -> None:  # the paused holder is back and renews its lease
        open_storage(root).write(LEASE_PREFIX + stale, repr(time.time()).encode())

    breaker = RootLock(Interleaved(root, claim_at + 1, holder_renews))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleLockWarning)
        with pytest.raises(LockedError) as info:
            breaker.acquire()
    assert breaker.storage.interrupted
    assert str(info.value).startswith(f"{root} is locked by another writer: pid 4242 on host a-host-gone-for-good")
    assert _lock_token(root) == stale
    assert sorted(os.listdir(root)) == [LOCK_NAME, LEASE_PREFIX + stale]  # the claim is gone
