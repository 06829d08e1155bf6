"""The root lock of a checkpoint directory: one writer at a time.

Rank 0 creates `ckptlib.lock` atomically (through the storage's optional
`create_exclusive`) before a save or gc and removes it afterwards (or keeps it until the
manager's `close()` with `hold_lock=True`). A lock whose holder is gone (a dead pid on this
host, checked by pid and process start time) is removed with a StaleLockWarning, so a
crashed save never leaves the root locked for good. A holder on another host cannot be
checked that way; its lock carries a lease instead: while it holds the lock, the holder
rewrites `ckptlib.lock.lease-<token>` every quarter of the lease (`CKPTLIB_LOCK_LEASE_S`,
default 120 s), and a lock whose lease was not renewed for longer than that is stale whichever
host wrote it (a node killed mid-upload, the job restarted elsewhere): warned, then taken.
Hosts' clocks must agree to well within the lease. Locks written without a lease (before 0.2)
on another host are removed only explicitly (`break_lock()`, `ckpt unlock`).

Removing a stale lock is compare-and-delete by token: a writer first creates a claim
(`ckptlib.manager.lock.break-<digest of the stale token>`, through `create_exclusive`, so one writer at
a time holds it), then deletes the lock only if it still carries the stale token, then drops
the claim. Two writers that both judged one lock stale can therefore never both hold the
root: the second finds the claim taken, or finds the first one's fresh lock in its place. A
claim left by a writer that died holding it is stale in turn and removed the same way. Under
the claim the lock must also still be stale: a holder that renewed its lease meanwhile keeps it.

Every irreversible step a holder takes is fenced by its lease (`RootLock.fence`): writing a
step's manifest, removing an overwritten step's files, moving `latest`, each deletion of
retention or gc, releasing the lock. Just before it, the holder re-reads the lock file: a lock
that no longer carries its token (its lease ran out while the process was paused, SIGSTOP
stopping its renewer too, and another writer took the root) is LockedError naming the new
holder and the step, and the step is not taken; a release never deletes a lock file that is
not its own. A lease that ran more than half out (judged from the times the lock and its lease
file carry) is renewed first, then the lock is read again, so the holder acts with at least
half a lease left. Without conditional writes in the storage a window of two storage round
trips remains (a writer that judged the lease expired just before the renewal landed).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Any

from ckptlib.errors import CheckpointError, LockedError, NotARegularFileError, stacklevel_outside_ckptlib, warn_scrubbed
from ckptlib.storage.base import Storage, SupportsCreateExclusive

LOCK_NAME = "ckptlib.lock"
_CLAIM_PREFIX = LOCK_NAME + ".break-"  # + the digest of the token of the lock being removed
LEASE_PREFIX = LOCK_NAME + ".lease-"  # + the holder's token: the time of its last renewal
#: Seconds a lock stays valid without a renewal (the holder renews every quarter of it).
DEFAULT_LEASE_SECONDS = 120.0


def lease_seconds() -> float:
    """The lease of the locks this process takes (`CKPTLIB_LOCK_LEASE_S`, default 120 s)."""
    try:
        value = float(os.environ.get("CKPTLIB_LOCK_LEASE_S", DEFAULT_LEASE_SECONDS))
    except ValueError:
        return DEFAULT_LEASE_SECONDS
    return value if value > 0 else DEFAULT_LEASE_SECONDS


_CLAIM_DEPTH = 2  # claims on claims (their breakers died too) followed at most this deep


def _created(holder: LockHolder) -> float | None:
    """The time a lock was taken, as its lock file says (None when unreadable)."""
    try:
        return datetime.datetime.fromisoformat(str(holder.created)).timestamp()
    except (TypeError, ValueError):
        return None


class StaleLockWarning(UserWarning):
    """A lock left by a writer that no longer runs was removed."""


# Tokens of the locks this process holds or is acquiring now: a lock file naming this process
# with another token is a leftover (a release that failed), not a live holder.
_LIVE_TOKENS: set[str] = set()


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux), to tell a live holder from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None  # field 22, counted after "pid (comm)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, owned by someone else
        return True
    return True


@dataclasses.dataclass
class LockHolder:
    """Who holds a root's lock, as its lock file says (fields are None when unreadable)."""

    host: str | None = None
    pid: int | None = None
    start: str | None = None
    token: str | None = None
    created: str | None = None
    lease_s: float | None = None  # None: a lock without a lease (written before 0.2)

    @classmethod
    def parse(cls, data: bytes) -> "LockHolder":
        try:
            doc = json.loads(data.decode("utf-8"))
            pid = doc.get("pid")
            lease = doc.get("lease_s")
            return cls(
                host=str(doc["host"]),
                pid=pid if isinstance(pid, int) else None,
                start=doc.get("start"),
                token=str(doc["token"]),
                created=doc.get("created"),
                lease_s=float(lease) if isinstance(lease, (int, float)) and lease > 0 else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return cls()

    def describe(self) -> str:
        if self.token is None:
            return "an unknown holder (the lock file is unreadable)"
        me = " (this process)" if self.pid == os.getpid() and self.host == socket.gethostname() else ""
        return f"pid {self.pid} on host {self.host}{me}, since {self.created}"

    def is_mine(self) -> bool:
        """Whether this process holds (or is acquiring) this very lock."""
        return self.host == socket.gethostname() and self.pid == os.getpid() and self.token in _LIVE_TOKENS

    def is_stale(self) -> bool:
        """True when the holder certainly no longer runs: its pid on this host is gone, or was
        reused by a process that started later (see `RootLock` for the lease of a holder on
        another host)."""
        if self.host != socket.gethostname() or self.pid is None:
            return False
        if self.pid == os.getpid():
            return self.token not in _LIVE_TOKENS
        if not _pid_alive(self.pid):
            return True
        now = _process_start(self.pid)
        return self.start is not None and now is not None and now != self.start

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RootLock:
    """`ckptlib.lock` in a checkpoint root, through the Storage protocol: the one lock helper of
    every writer of a root (the manager's single root, each node's root, the remote).

    `hold=True`: once taken, the lock stays until `close()`; `done()` and `abandon()` (the ends
    of one save or gc) then keep it."""

    def __init__(self, storage: Storage, *, hold: bool = False):
        self.storage = storage
        self.hold = hold
        self.token: str | None = None
        self._owner_pid: int | None = None
        self._renewer: _Renewer | None = None
        self._lease_written = False  # whether a lease file may exist (then release removes it)
        self._last_renewal: float | None = None  # the time the last lease file written carries

    @property
    def where(self) -> str:
        return f"{self.storage.uri.rstrip('/')}/{LOCK_NAME}"

    def holder(self, name: str = LOCK_NAME) -> LockHolder | None:
        """Who the lock file (or a claim) `name` names, None when there is none. A read that
        fails (the storage unreachable: a StorageError naming the file) is raised, never taken
        for a holder: an unknown holder would turn an outage into a lock held for good."""
        try:
            return LockHolder.parse(self.storage.read(name))
        except FileNotFoundError:
            return None
        except NotARegularFileError:  # a FIFO, a directory: a holder nobody can name
            return LockHolder()

    def _create(self, data: bytes, name: str = LOCK_NAME) -> bool:
        if isinstance(self.storage, SupportsCreateExclusive):
            return bool(self.storage.create_exclusive(name, data))
        # Best effort for a backend without an atomic create: check, write, read back. Two
        # writers racing within one round trip can both win; see SupportsCreateExclusive.
        if self.holder(name) is not None:
            return False
        self.storage.write(name, data)
        try:
            return self.storage.read(name) == data
        except FileNotFoundError:
            return False

    def expired(self, holder: LockHolder) -> str | None:
        """Why `holder`'s lease has expired (its last renewal, or the lock's creation, is older
        than its lease), None while it holds: never for this process's own lock or a lock
        without a lease."""
        if holder.lease_s is None or holder.token is None or holder.is_mine():
            return None
        try:
            last = float(self.storage.read(LEASE_PREFIX + holder.token).decode("ascii"))
            what = "renewed"
        except (FileNotFoundError, ValueError, UnicodeDecodeError, CheckpointError):
            last = _created(holder)
            if last is None:
                return None
            what = "taken"
        idle = time.time() - last
        if idle <= holder.lease_s:
            return None
        return f"its {holder.lease_s:.0f} s lease expired: last {what} {idle:.0f} s ago"

    def _remove_stale(self, name: str, stale: LockHolder, data: bytes, depth: int = 0) -> None:
        """Delete lock file `name` only if it still names the `stale` holder (compare-and-delete
        by token), under a claim one writer at a time can hold; a claim left by a breaker that
        died is removed the same way. Without the claim (another writer is removing this very
        lock) nothing is deleted: the caller tries again."""
        claim = _CLAIM_PREFIX + hashlib.sha256(str(stale.token).encode()).hexdigest()[:32]
        if not self._create(data, claim):
            breaker = self.holder(claim)
            if depth >= _CLAIM_DEPTH or breaker is None or not breaker.is_stale():
                return
            self._remove_stale(claim, breaker, data, depth + 1)
            if not self._create(data, claim):
                return
        try:
            current = self.holder(name)
            if current is not None and current.token == stale.token and self._still_stale(name, current):
                self.storage.delete([name])
                if name == LOCK_NAME and stale.token is not None:
                    self.storage.delete([LEASE_PREFIX + stale.token])
        finally:
            self.storage.delete([claim])

    def _still_stale(self, name: str, current: LockHolder) -> bool:
        """Under the claim, whether lock file `name` is still stale: its holder may have renewed
        the lease since it was judged (a paused holder that came back)."""
        if name != LOCK_NAME or current.is_stale():
            return True
        return self.expired(current) is not None

    def acquire(self) -> None:
        """Take the lock or raise LockedError naming the root and the holder."""
        root = self.storage.uri
        token = uuid.uuid4().hex
        pid = os.getpid()
        lease = lease_seconds()
        data = json.dumps(
            {
                "format": "ckptlib-lock",
                "host": socket.gethostname(),
                "pid": pid,
                "start": _process_start(pid),
                "token": token,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "lease_s": lease,
            }
        ).encode()
        holder = None
        _LIVE_TOKENS.add(token)  # this process is alive and acquiring: its claims are not stale
        try:
            for _ in range(3):
                if self._create(data):
                    self.token, self._owner_pid = token, pid
                    self._lease_written, self._last_renewal = False, None
                    atexit.register(self._release_at_exit)
                    self._renewer = _Renewer(self, token, lease)
                    return
                holder = self.holder()
                if holder is None:
                    continue  # released between our attempt and the read: try again
                why = "that process no longer runs" if holder.is_stale() else self.expired(holder)
                if why is not None:
                    warnings.warn(
                        f"{root}: removing a stale lock left by {holder.describe()} ({why})",
                        StaleLockWarning,
                        stacklevel=stacklevel_outside_ckptlib(),
                    )
                    self._remove_stale(LOCK_NAME, holder, data)
                    continue
                break
        finally:
            if self.token != token:
                _LIVE_TOKENS.discard(token)
        raise self.locked_error(holder)

    def locked_error(self, holder: LockHolder | None) -> LockedError:
        """The LockedError `acquire` raises while `holder` holds the root."""
        root = self.storage.uri
        described = holder.describe() if holder is not None else "writers that keep taking it"
        err = LockedError(
            f"{root} is locked by another writer: {described} (lock file {self.where}). Two managers must not "
            f"write one root at once. If that writer is gone, remove the lock with "
            f"CheckpointManager({root!r}).break_lock() or `ckpt unlock {root}`.",
            path=root,
        )
        err.holder = holder.to_json() if holder is not None else None
        return err

    def check(self) -> None:
        """Raise the LockedError `take` would raise now, without taking the lock (a dry run):
        a live holder other than this object. A free lock, this object's own, or a stale one
        (which `take` removes) passes."""
        holder = self.holder()
        if holder is None or (self.token is not None and holder.token == self.token):
            return
        if holder.is_stale() or self.expired(holder) is not None:
            return
        raise self.locked_error(holder)

    def take(self) -> None:
        """Take the lock, or confirm that the lock this object holds is still its own:
        LockedError when it was removed meanwhile (another writer may have written the root)."""
        if self.token is None:
            self.acquire()
            return
        self.fence("continue")

    def fence(self, what: str) -> None:
        """Before an irreversible step (`what`: "commit step 300"): confirm that the lock file
        still carries this object's token, renewing first a lease that ran more than half out.
        A lock lost meanwhile (the lease ran out and another writer took the root, or the lock
        was broken) is LockedError naming the root, the holder now and `what`; this object then
        stops counting as the holder, and the step must not be taken."""
        token = self.token
        holder = self.holder()
        if token is not None and holder is not None and holder.token == token and self._running_out(holder):
            self._write_lease(token)
            holder = self.holder()
        if token is None or holder is None or holder.token != token:
            self.forget()
            err = LockedError(
                f"{self.storage.uri}: this manager's lock ({self.where}) was removed while it held it"
                + (f"; {holder.describe()} holds it now" if holder is not None else "")
                + f". Another writer may have written this root; refusing to {what}.",
                path=self.storage.uri,
            )
            err.holder = holder.to_json() if holder is not None else None
            raise err

    def _running_out(self, holder: LockHolder) -> bool:
        """Whether more than half of this holder's lease has passed since its last renewal (or
        the lock's creation), by the times the lease file and the lock file carry: what another
        writer judges the lease by."""
        if holder.lease_s is None:
            return False
        times = [t for t in (self._last_renewal, _created(holder)) if t is not None]
        return not times or time.time() - max(times) > holder.lease_s / 2

    def done(self) -> None:
        """The end of a successful save or gc: release unless held; a failure to remove the lock
        file only warns (what it guarded is committed, and this process's leftover lock counts
        as stale)."""
        if self.hold:
            return
        try:
            self.release()
        except Exception as exc:  # noqa: BLE001 - reported, never fatal
            warn_scrubbed(f"{self.where}: could not remove the lock ({exc})", StaleLockWarning)

    def abandon(self) -> None:
        """The end of a failed save or gc: release unless held, never raising (the failure
        being raised is the one to see; a leftover lock of this process counts as stale)."""
        if not self.hold:
            with contextlib.suppress(Exception):
                self.release()

    def close(self) -> None:
        """Release whether held or not (the owner is done with the root): never raising, except
        LockedError when the lock was lost while held (another writer may have written the root)."""
        try:
            self.release()
        except LockedError:
            raise
        except Exception:  # noqa: BLE001 - a leftover lock of this process counts as stale
            pass

    def held(self) -> bool:
        """Whether this object holds the lock and the lock file still says so."""
        if self.token is None:
            return False
        holder = self.holder()
        return holder is not None and holder.token == self.token

    def release(self) -> None:
        """Remove the lock file, fenced like every irreversible step: a lock no longer this
        object's is LockedError, and the lock file (the new holder's) stays."""
        if self.token is None:
            return
        token = self.token
        try:
            self._stop_renewing()
            try:
                self.fence("release the lock")
            except LockedError:
                self._drop_lease(token, quietly=True)
                raise
            self.storage.delete([LOCK_NAME])
            self._drop_lease(token)
        finally:
            self.forget()

    def _drop_lease(self, token: str, *, quietly: bool = False) -> None:
        """Remove this object's own lease file (named by its token: never another holder's),
        if one was written."""
        if not self._lease_written:
            return
        self._lease_written = False
        try:
            self.storage.delete([LEASE_PREFIX + token])
        except Exception:  # noqa: BLE001 - `quietly`: the error being raised is the one to see
            if not quietly:
                raise

    def forget(self) -> None:
        """Stop counting as the holder (without touching the lock file)."""
        self._stop_renewing()
        if self.token is not None:
            _LIVE_TOKENS.discard(self.token)
            self.token = None
            atexit.unregister(self._release_at_exit)

    def renew(self) -> bool:
        """Write the lease's renewal (now) while this object holds the lock; False once it
        does not (the renewer then stops)."""
        token = self.token
        if token is None or not self.held():
            return False
        self._write_lease(token)
        return True

    def _write_lease(self, token: str) -> None:
        self._lease_written = True  # set first: a write that fails half-way may have left it
        now = time.time()
        self.storage.write(LEASE_PREFIX + token, repr(now).encode("ascii"), durable=False)
        if self.token == token:
            self._last_renewal = now

    def _stop_renewing(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    def _release_at_exit(self) -> None:
        if self._owner_pid == os.getpid():  # never from a forked child
            with contextlib.suppress(Exception):
                self.release()

    def break_(self) -> LockHolder | None:
        holder = self.holder()
        self.storage.delete([LOCK_NAME])
        if holder is not None and holder.token is not None:
            self.storage.delete([LEASE_PREFIX + holder.token])
        return holder


class _Renewer:
    """A daemon thread renewing a held lock's lease every quarter of it, until stopped or the
    lock is no longer its holder's (a failed renewal is retried at the next tick)."""

    def __init__(self, lock: RootLock, token: str, lease: float):
        self.lock = lock
        self.token = token
        self.interval = lease / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckptlib-lock-lease {lock.where}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.lock.token != self.token:
                return
            try:
                if not self.lock.renew():
                    return
            except Exception:  # noqa: BLE001 - a storage hiccup: the next tick tries again
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "LEASE_PREFIX",
    "LOCK_NAME",
    "LockHolder",
    "RootLock",
    "StaleLockWarning",
    "lease_seconds",
]
