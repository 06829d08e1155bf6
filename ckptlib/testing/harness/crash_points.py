"""Crash at every write boundary: find each storage write an operation performs, then for each
one run the operation again in a forked child that is killed there (SIGKILL, no cleanup) or
whose write fails there (the error the backend raises: ENOSPC on a local disk, an S3
`AccessDenied` client error), and hand the outcome to the operation's invariant checks.

The boundaries are observed below ckptlib, in the child only:

* local disk (`LocalProbe`): the os calls that change a file or a name under the watched
  directory: `open` for writing (create), the first two `write`s and the `close` of such a
  file, `sendfile` into it, `fsync` (files and directories), `rename`/`replace`, `link`,
  `symlink`, `unlink`, `mkdir`, `rmdir` and `shutil.rmtree`. Whatever in ckptlib writes
  there (its `LocalStorage`, the lock, the export writers that write files directly) is
  seen. Files torch writes from C++ (`torch.save` to a path) show only as the rename that
  publishes them. The writes and fsyncs of `async_save(async_mode="process")` happen in its
  writer process, which is not probed: that mode is not covered.
* object stores (`ObjectProbe`): every mutating request of ckptlib's S3 client (`S3Client` and
  `S3Upload`): put (plain, pointer, conditional), delete, multipart start, part, complete and
  abort. ckptlib never copies objects, so there is no copy boundary to cover.

Each case is a child forked (multiprocessing's "fork" context) from a parent that already
imported torch and ckptlib, so it costs milliseconds, and is bounded by a timeout: a child
that hangs is killed and reported (`Outcome.status == "hung"`). The operation must be
deterministic: a kill case checks that boundary k is the one the recording run saw at k.
See `ckptlib.testing.harness.crash_operations` for the operations and their invariants.
"""

from __future__ import annotations

import builtins
import dataclasses
import errno
import multiprocessing
import os
import re
import shutil
import signal
import threading
import traceback
from typing import Any, Callable

#: Temporary-name suffixes (uuid or pid based) replaced by `~` so runs compare equal.
_TEMP_RE = re.compile(r"(\.tmp-|\.deleting-|\.ckptlib-spill-)[0-9a-z_]+")


def normalize(path: str) -> str:
    """`path` with its random temporary suffixes replaced by '~' (comparable across runs)."""
    return _TEMP_RE.sub(lambda m: m.group(1) + "~", path)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One write boundary: its position in the operation, what it does, and to which path
    (relative to the watched directory or object prefix, temporary suffixes normalised)."""

    index: int
    backend: str  # "local" or "s3"
    kind: str
    path: str

    def label(self) -> str:
        return f"#{self.index} {self.kind} {self.path}"


@dataclasses.dataclass
class Outcome:
    """What a child did: "completed", "raised" (error fields set), "killed" (at `killed_at`),
    "hung" (killed after the timeout) or "crashed" (died otherwise)."""

    status: str
    boundaries: list[Boundary] = dataclasses.field(default_factory=list)
    killed_at: Boundary | None = None
    error_type: str | None = None
    error_mro: tuple[str, ...] = ()
    error_message: str | None = None
    error_path: str | None = None
    error_traceback: str | None = None
    exitcode: int | None = None
    result: Any = None


class Plan:
    """What the probes do at each boundary in one child: count it, and at boundary `at` kill the
    process ("kill") or make the call fail ("fail"); mode "record" only counts."""

    def __init__(self, mode: str, at: int | None, report: Callable[[Boundary], None]):
        self.mode = mode
        self.at = at
        self.seen: list[Boundary] = []
        self._report = report
        self._lock = threading.Lock()
        self._local = threading.local()

    def hit(self, backend: str, kind: str, path: str) -> bool:
        """Count a boundary; True when the caller must raise the backend's error instead."""
        if getattr(self._local, "depth", 0):
            return False  # inside another boundary (rmtree's own unlinks): part of that one
        with self._lock:
            boundary = Boundary(len(self.seen), backend, kind, normalize(path))
            self.seen.append(boundary)
            if boundary.index != self.at:
                return False
        if self.mode == "kill":
            self._report(boundary)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.mode == "fail"

    def nested(self):
        """A context in which calls are not boundaries of their own."""
        plan = self

        class _Nested:
            def __enter__(self):
                plan._local.depth = getattr(plan._local, "depth", 0) + 1

            def __exit__(self, *exc):
                plan._local.depth -= 1

        return _Nested()


# ---------------------------------------------------------------- local disk


def _enospc(path: str) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)", path)


#: Writes into one file that are boundaries: the first (an empty file becomes a torn one) and
#: the second (a torn file grows); the rest add no state a reader could tell apart (json.dump
#: alone writes each token separately).
WRITES_PER_FILE = 2


class _WatchedFile:
    """A file opened for writing under the watched directory: its first writes and its close
    are boundaries."""

    def __init__(self, f, probe: "LocalProbe", path: str):
        self._f = f
        self._probe = probe
        self._path = path
        self._writes = 0

    def write(self, data):
        self._writes += 1
        if self._writes <= WRITES_PER_FILE and self._probe.plan.hit("local", "write", self._probe.rel(self._path)):
            raise _enospc(self._path)
        return self._f.write(data)

    def close(self):
        if self._f.closed:
            return None
        if self._probe.plan.hit("local", "close", self._probe.rel(self._path)):
            self._f.close()
            raise _enospc(self._path)
        return self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


class LocalProbe:
    """Makes the os calls that write below `root` boundaries (installed in a child only)."""

    def __init__(self, root: str, plan: Plan):
        self.root = os.path.abspath(root)
        self.plan = plan

    def rel(self, path) -> str:
        return os.path.relpath(os.path.abspath(os.fsdecode(path)), self.root)

    def watched(self, path) -> bool:
        if isinstance(path, int):
            return False
        full = os.path.abspath(os.fsdecode(path))
        return full == self.root or full.startswith(self.root + os.sep)

    def _boundary(self, kind: str, path) -> None:
        if self.watched(path) and self.plan.hit("local", kind, self.rel(path)):
            raise _enospc(os.fsdecode(path))

    def install(self) -> None:
        real_open = builtins.open
        names = ("fsync", "sendfile", "replace", "rename", "link", "symlink", "mkdir")
        real = {name: getattr(os, name) for name in names}
        real.update(unlink=os.unlink, remove=os.remove, rmdir=os.rmdir)
        real_rmtree = shutil.rmtree
        probe = self

        def open_(file, mode="r", *args, **kwargs):
            writing = any(c in mode for c in "wax+")
            if not writing or not probe.watched(file):
                return real_open(file, mode, *args, **kwargs)
            probe._boundary("create", file)
            return _WatchedFile(real_open(file, mode, *args, **kwargs), probe, os.fsdecode(file))

        def sendfile(out_fd, in_fd, offset, count):  # a kernel copy into a watched file: a write
            try:
                path = os.readlink(f"/proc/self/fd/{out_fd}")
            except OSError:
                path = None
            if path is not None:
                probe._boundary("write", path)
            return real["sendfile"](out_fd, in_fd, offset, count)

        def fsync(fd):
            try:
                path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            except OSError:
                path = None
            if path is not None:
                probe._boundary("fsync", path)
            return real["fsync"](fd)

        def two_paths(name: str, kind: str, which: int):
            def call(*args, **kwargs):
                if not kwargs:
                    probe._boundary(kind, args[which])
                return real[name](*args, **kwargs)

            return call

        def one_path(name: str, kind: str):
            def call(path, *args, **kwargs):
                if kwargs.get("dir_fd") is None:
                    probe._boundary(kind, path)
                return real[name](path, *args, **kwargs)

            return call

        def mkdir(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None and not os.path.lexists(path):
                probe._boundary("mkdir", path)
            return real["mkdir"](path, *args, **kwargs)

        def rmtree(path, ignore_errors=False, *args, **kwargs):
            if probe.watched(path) and probe.plan.hit("local", "rmtree", probe.rel(path)):
                if ignore_errors:
                    return None  # the failure rmtree was told to ignore: nothing removed
                raise _enospc(os.fsdecode(path))
            with probe.plan.nested():
                return real_rmtree(path, ignore_errors, *args, **kwargs)

        rmtree.avoids_symlink_attacks = real_rmtree.avoids_symlink_attacks
        builtins.open = open_
        os.fsync = fsync
        os.sendfile = sendfile
        os.replace = two_paths("replace", "rename", 1)
        os.rename = two_paths("rename", "rename", 1)
        os.link = two_paths("link", "link", 1)
        os.symlink = two_paths("symlink", "symlink", 1)
        os.unlink = one_path("unlink", "delete")
        os.remove = one_path("remove", "delete")
        os.rmdir = one_path("rmdir", "rmdir")
        os.mkdir = mkdir
        shutil.rmtree = rmtree


# ---------------------------------------------------------------- object stores


def _client_error(operation: str):
    from botocore.exceptions import ClientError

    return ClientError(
        {
            "Error": {"Code": "AccessDenied", "Message": "Access Denied (injected)"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        operation,
    )


class ObjectProbe:
    """Makes ckptlib's S3 requests that change objects below `bucket/prefix` boundaries."""

    def __init__(self, bucket: str, prefix: str, plan: Plan):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.plan = plan

    def _hit(self, client, kind: str, key: str, operation: str) -> None:
        if client.bucket != self.bucket or not key.startswith(self.prefix):
            return
        if self.plan.hit("s3", kind, key[len(self.prefix) :]):
            raise _client_error(operation)

    def install(self) -> None:
        from ckptlib.storage.s3_client import S3Client, S3Upload

        probe = self
        put, delete, start = S3Client.put, S3Client.delete, S3Client.start_upload
        put_part, complete, abort = S3Upload.put_part, S3Upload.complete, S3Upload.abort

        def put_(self, key, data, *, if_absent=False, content_type=None):
            kind = "put-if-absent" if if_absent else "put-pointer" if content_type else "put"
            probe._hit(self, kind, key, "PutObject")
            return put(self, key, data, if_absent=if_absent, content_type=content_type)

        def delete_(self, keys):
            for key in keys[:1]:  # one request, named by its first key
                probe._hit(self, "delete" if len(keys) == 1 else f"delete-{len(keys)}", key, "DeleteObjects")
            return delete(self, keys)

        def start_(self, key):
            probe._hit(self, "multipart-start", key, "CreateMultipartUpload")
            return start(self, key)

        def put_part_(self, number, data):
            probe._hit(self._c, f"multipart-part-{number}", self._key, "UploadPart")
            return put_part(self, number, data)

        def complete_(self, parts):
            probe._hit(self._c, "multipart-complete", self._key, "CompleteMultipartUpload")
            return complete(self, parts)

        def abort_(self):
            probe._hit(self._c, "multipart-abort", self._key, "AbortMultipartUpload")
            return abort(self)

        S3Client.put, S3Client.delete, S3Client.start_upload = put_, delete_, start_
        S3Upload.put_part, S3Upload.complete, S3Upload.abort = put_part_, complete_, abort_


# ---------------------------------------------------------------- running one case


@dataclasses.dataclass(frozen=True)
class Watch:
    """Where a case's writes are boundaries: a local directory and/or an S3 bucket prefix."""

    local: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = ""
    env: tuple[tuple[str, str], ...] = ()  # set in the child before the operation runs


def _error_fields(exc: BaseException) -> dict[str, Any]:
    return {
        "error_type": type(exc).__name__,
        "error_mro": tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__),
        "error_message": str(exc),
        "error_path": getattr(exc, "path", None),
        "error_traceback": "".join(traceback.format_exception(exc))[-4000:],
    }


def _child(conn, action: Callable[[], Any], watch: Watch, mode: str, at: int | None) -> None:
    try:
        os.environ.update(dict(watch.env))
        plan = Plan(mode, at, lambda b: conn.send(("killed", b, list(plan.seen))))
        if watch.local is not None:
            LocalProbe(watch.local, plan).install()
        if watch.s3_bucket is not None:
            ObjectProbe(watch.s3_bucket, watch.s3_prefix, plan).install()
        try:
            result = action()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which judges it
            conn.send(("raised", _error_fields(exc), list(plan.seen)))
        else:
            conn.send(("completed", result if isinstance(result, (int, str, type(None))) else None, list(plan.seen)))
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers, no cleanup: the parent's state stays the parent's


def run_case(action: Callable[[], Any], watch: Watch, mode: str = "record", at: int | None = None, *, timeout=60.0):
    """Run `action` in a forked child with the probes of `watch` installed; `mode` "record",
    "kill" or "fail" at boundary `at`. Returns the `Outcome` (never raises for the child's sake)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, action, watch, mode, at), daemon=True)
    proc.start()
    child.close()
    message = None
    try:
        if parent.poll(timeout):
            try:
                message = parent.recv()
            except EOFError:
                message = None
    finally:
        proc.join(timeout if message is None else 10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
            hung = True
        else:
            hung = False
        parent.close()
    if message is None:
        return Outcome("hung" if hung else "crashed", exitcode=proc.exitcode)
    status, payload, seen = message
    if status == "killed":
        # The child reported the boundary, then SIGKILLed itself: the exit code must say so.
        killed = proc.exitcode == -signal.SIGKILL
        return Outcome("killed" if killed else "crashed", seen, killed_at=payload, exitcode=proc.exitcode)
    if status == "raised":
        return Outcome("raised", seen, exitcode=proc.exitcode, **payload)
    return Outcome("completed", seen, exitcode=proc.exitcode, result=payload)


__all__ = ["Boundary", "LocalProbe", "ObjectProbe", "Outcome", "Plan", "Watch", "normalize", "run_case"]
