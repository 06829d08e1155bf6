"""Find a checkpointer's write boundaries from inside its rank processes: the interposition of
the crash harness for any checkpointer (`crash_check`).

Installed in one rank for the save under test (`RankProbe.install`, undone by `uninstall`),
the probe makes every Python-level call that changes a file or a name below the root a
boundary, recorded in order in that rank's trace file (one JSON line each, written with the
real `os.write`, so a killed rank leaves its sequence behind):

* local disk: `builtins.open` / `io.open` (so `pathlib`, `shutil` and `os.fdopen` too) for
  writing (`open-write`), the first `WRITES_PER_FILE` writes of such a file (`write`), its first
  `flush` and its `close`; `os.open` with a write flag and `os.write` / `os.pwrite` /
  `os.close` on that descriptor; the first `os.sendfile` / `os.copy_file_range` into a file
  (`shutil.copyfile`'s kernel copy); `os.fsync` (files and directories), `os.rename` / `os.replace`,
  `os.link`, `os.symlink`, `os.unlink` / `os.remove`, `os.rmdir`, `os.mkdir` (`os.makedirs`; every
  call, also of a directory that exists: ranks racing to make one keep their sequences),
  `os.truncate` / `os.ftruncate` and `shutil.rmtree` (one boundary: its own unlinks are part of it);
* `torch.save(obj, path)`: its C++ zip writer opens the file itself, so the probe wraps
  torch.serialization's file-opening path (`torch-save-open`, `torch-save-close`);
* object stores: every mutating request ckptlib's storage layer (`ObjectStorage.call`) sends,
  for S3, GCS and Azure alike: put, conditional put, pointer put, multipart start, part and
  complete, delete.

What the probe cannot see: bytes written below Python (safetensors' Rust writer, a C++ or
native extension writing a path, a subprocess). `snapshot` before and after the save and
`unseen` name every file that appeared, changed or vanished below the root without a boundary
that names it, so such writes are reported as unseen, never silently missed.

At the planned boundary the probe SIGKILLs its own rank (victims "one") or every rank of the
job, its peers first (victims "all"), just before the call runs.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import threading
from typing import Any

from ckptlib.testing.harness.crash_points import WRITES_PER_FILE
from ckptlib.testing.harness.crash_points import normalize as _normalize_ckptlib

#: Temporary names made unique by a random or per-process part (tempfile's, uuid4's, a pid
#: suffix), replaced by `~` so a run's boundaries compare equal to the recording run's.
_RANDOM_RE = re.compile(
    r"tmp[a-z0-9_]{8}(?![a-z0-9_])"
    r"|[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}"
    r"|(?<=[._-])[0-9a-f]{16,}"
)
#: The kinds of boundary that put bytes or a name at their path (the destination of a rename).
WRITING = frozenset(
    {
        "open-write",
        "write",
        "flush",
        "close",
        "fsync",
        "truncate",
        "rename",
        "link",
        "symlink",
        "mkdir",
        "torch-save-open",
        "torch-save-close",
        "put",
        "conditional-put",
        "put-pointer",
        "multipart-start",
        "multipart-part",
        "multipart-complete",
    }
)
#: The kinds that remove the name at their path (or, for a rename, at its source).
REMOVING = frozenset({"unlink", "rmdir", "rmtree", "rename", "delete"})


def normalize(path: str) -> str:
    """`path` with its random parts replaced by '~' (comparable across runs)."""
    return _RANDOM_RE.sub("~", _normalize_ckptlib(path))


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One write boundary of one rank: its place in that rank's sequence, what it does and to
    which path (relative to the root; a rename's is 'source -> destination')."""

    rank: int
    index: int
    kind: str
    path: str

    def label(self) -> str:
        return f"rank {self.rank} #{self.index} {self.kind} {self.path}"

    @property
    def point(self) -> str:
        """How `crash_check(points=...)` names this boundary."""
        return f"{self.rank}#{self.index}"

    def targets(self) -> list[str]:
        """The paths it writes (a rename's destination) or removes (a rename's source)."""
        if " -> " in self.path:
            return self.path.split(" -> ", 1)
        return [self.path]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one rank's probe does: record every boundary, and at boundary `kill_at` (None:
    never) SIGKILL this rank (`victims` "one") or every rank in `pids` and then itself ("all")."""

    rank: int
    trace_path: str
    kill_at: int | None = None
    victims: str = "one"
    pids: tuple[int, ...] = ()


class RankProbe:
    """The interposition in one rank process, for the local directory `local` and/or the
    object-store prefix `objects` (a URI below which requests are boundaries)."""

    def __init__(self, plan: Plan, *, local: str | None = None, objects: str | None = None):
        self.plan = plan
        self.local = os.path.abspath(local) if local is not None else None
        self.objects = objects.rstrip("/") if objects is not None else None
        self.seen: list[Boundary] = []
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._fds: dict[int, list[Any]] = {}  # os.open descriptors below the root: [path, writes]
        self._undo: list[Any] = []
        self._write = os.write
        self._trace_fd: int | None = None

    # ------------------------------------------------------------ the record
    def hit(self, kind: str, path: str) -> None:
        """One boundary: record it (the trace file first), and die here if the plan says so."""
        if getattr(self._depth, "n", 0):
            return  # inside another boundary (rmtree's own unlinks): part of that one
        with self._lock:
            boundary = Boundary(self.plan.rank, len(self.seen), kind, normalize(path))
            self.seen.append(boundary)
            line = {"index": boundary.index, "kind": kind, "path": boundary.path}
            kill = boundary.index == self.plan.kill_at
            if kill:
                line["killed"] = self.plan.victims
            if self._trace_fd is not None:
                self._write(self._trace_fd, (json.dumps(line) + "\n").encode())
            if kill:
                if self.plan.victims == "all":
                    for pid in self.plan.pids:
                        if pid != os.getpid():
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                os.kill(os.getpid(), signal.SIGKILL)

    def nested(self):
        probe = self

        class _Nested:
            def __enter__(self):
                probe._depth.n = getattr(probe._depth, "n", 0) + 1

            def __exit__(self, *exc):
                probe._depth.n -= 1

        return _Nested()

    # ------------------------------------------------------------ paths
    def _full(self, path: Any) -> str | None:
        if isinstance(path, int) or self.local is None:
            return None
        try:
            return os.path.abspath(os.fsdecode(path))
        except TypeError:
            return None

    def watched(self, path: Any) -> bool:
        full = self._full(path)
        return full is not None and (full == self.local or full.startswith(self.local + os.sep))

    def rel(self, path: Any) -> str:
        return os.path.relpath(self._full(path), self.local).replace(os.sep, "/")

    def _fd_path(self, fd: Any) -> str | None:
        try:
            number = fd if isinstance(fd, int) else fd.fileno()
            return os.readlink(f"/proc/self/fd/{number}")
        except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
            return None

    def _boundary(self, kind: str, path: Any) -> None:
        if self.watched(path):
            self.hit(kind, self.rel(path))

    # ------------------------------------------------------------ install
    def install(self) -> None:
        """Interpose on the calls (this process only); the trace file is opened first."""
        self._trace_fd = os.open(self.plan.trace_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.local is not None:
            self._install_local()
            self._install_torch_save()
        if self.objects is not None:
            self._install_objects()

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self._trace_fd is not None:
            os.close(self._trace_fd)
            self._trace_fd = None

    def _patch(self, owner: Any, name: str, new: Any) -> Any:
        real = getattr(owner, name)
        setattr(owner, name, new)
        self._undo.append(lambda: setattr(owner, name, real))
        return real

    def _install_local(self) -> None:
        probe = self
        real_open = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            writing = any(c in mode for c in "wax+")
            if isinstance(file, int) and file in probe._fds and writing:
                return _WatchedFile(real_open(file, mode, *args, **kwargs), probe, probe._fds.pop(file)[0])
            if not writing or not probe.watched(file):
                return real_open(file, mode, *args, **kwargs)
            rel = probe.rel(file)
            probe.hit("open-write", rel)
            return _WatchedFile(real_open(file, mode, *args, **kwargs), probe, rel)

        self._patch(builtins, "open", open_)
        self._patch(io, "open", open_)
        real = {
            name: getattr(os, name)
            for name in ("open", "write", "pwrite", "close", "fsync", "mkdir", "truncate", "rename", "replace")
        }
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

        def os_open(path, flags, *args, **kwargs):
            watched = kwargs.get("dir_fd") is None and flags & write_flags and probe.watched(path)
            if watched:
                probe.hit("open-write", probe.rel(path))
            fd = real["open"](path, flags, *args, **kwargs)
            if watched:
                probe._fds[fd] = [probe.rel(path), 0]
            return fd

        def os_write(name: str):
            def call(fd, data, *args):
                entry = probe._fds.get(fd)
                if entry is not None:
                    entry[1] += 1
                    if entry[1] <= WRITES_PER_FILE:
                        probe.hit("write", entry[0])
                return real[name](fd, data, *args)

            return call

        def os_close(fd):
            entry = probe._fds.pop(fd, None)
            if entry is not None:
                probe.hit("close", entry[0])
            return real["close"](fd)

        copied: set[str] = set()

        def into_fd(name: str, out: int):  # a kernel copy into a file below the root: its first is a write
            fn = getattr(os, name)

            def call(*args, **kwargs):
                path = probe._fd_path(args[out]) if len(args) > out else None
                if path is not None and probe.watched(path) and path not in copied:
                    copied.add(path)
                    probe.hit("write", probe.rel(path))
                return fn(*args, **kwargs)

            return call

        def fsync(fd):
            path = probe._fd_path(fd)
            if path is not None:
                probe._boundary("fsync", path)
            return real["fsync"](fd)

        def mkdir(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None:  # also where it exists: ranks racing to make one
                probe._boundary("mkdir", path)  # directory see the same sequence every run
            return real["mkdir"](path, *args, **kwargs)

        def truncate(name: str):
            fn = getattr(os, name)

            def call(path, *args, **kwargs):
                probe._boundary("truncate", path if not isinstance(path, int) else probe._fd_path(path))
                return fn(path, *args, **kwargs)

            return call

        def two_paths(name: str, kind: str):
            fn = getattr(os, name)

            def call(src, dst, *args, **kwargs):
                if not args and not any(kwargs.get(k) is not None for k in ("src_dir_fd", "dst_dir_fd", "dir_fd")):
                    if probe.watched(src) or probe.watched(dst):
                        a = probe.rel(src) if probe.watched(src) else os.fsdecode(src)
                        b = probe.rel(dst) if probe.watched(dst) else os.fsdecode(dst)
                        probe.hit(kind, f"{a} -> {b}" if kind != "symlink" else b)
                return fn(src, dst, *args, **kwargs)

            return call

        def one_path(name: str, kind: str):
            fn = getattr(os, name)

            def call(path, *args, **kwargs):
                if kwargs.get("dir_fd") is None:
                    probe._boundary(kind, path)
                return fn(path, *args, **kwargs)

            return call

        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            probe._boundary("rmtree", path)
            with probe.nested():
                return real_rmtree(path, *args, **kwargs)

        rmtree.avoids_symlink_attacks = real_rmtree.avoids_symlink_attacks
        self._patch(os, "open", os_open)
        self._patch(os, "write", os_write("write"))
        self._patch(os, "pwrite", os_write("pwrite"))
        self._patch(os, "close", os_close)
        self._patch(os, "fsync", fsync)
        self._patch(os, "mkdir", mkdir)
        self._patch(os, "truncate", truncate("truncate"))
        self._patch(os, "ftruncate", truncate("ftruncate"))
        self._patch(os, "sendfile", into_fd("sendfile", 0))
        if hasattr(os, "copy_file_range"):
            self._patch(os, "copy_file_range", into_fd("copy_file_range", 1))
        for name in ("rename", "replace", "link"):
            self._patch(os, name, two_paths(name, "rename" if name != "link" else "link"))
        self._patch(os, "symlink", two_paths("symlink", "symlink"))
        for name, kind in (("unlink", "unlink"), ("remove", "unlink"), ("rmdir", "rmdir")):
            self._patch(os, name, one_path(name, kind))
        self._patch(shutil, "rmtree", rmtree)

    def _install_torch_save(self) -> None:
        from ckptlib._torch.serialization import watch_path_saves

        def before(what: str, path: str) -> None:
            self._boundary(f"torch-save-{what}", path)

        undo = watch_path_saves(before)
        if undo is not None:
            self._undo.append(undo)

    def _install_objects(self) -> None:
        from ckptlib.storage.objects import ObjectStorage

        probe = self
        base = self.objects
        kinds = {
            "put": "put",
            "conditional put": "conditional-put",
            "put pointer": "put-pointer",
            "start upload": "multipart-start",
            "complete multipart upload": "multipart-complete",
            "delete": "delete",
        }
        real_call = ObjectStorage.call

        def call(storage, op, where, fn, **kwargs):
            kind = "multipart-part" if op.startswith("upload part") else kinds.get(op)
            if kind is not None and (where == base or where.startswith(base + "/")):
                probe.hit(kind, where[len(base) + 1 :] or ".")
            return real_call(storage, op, where, fn, **kwargs)

        self._patch(ObjectStorage, "call", call)


class _WatchedFile:
    """A file opened for writing below the root: its first writes, first flush and its close
    are boundaries."""

    def __init__(self, f: Any, probe: RankProbe, rel: str):
        self._f = f
        self._probe = probe
        self._rel = rel
        self._writes = 0
        self._flushed = False

    def write(self, data):
        self._writes += 1
        if self._writes <= WRITES_PER_FILE:
            self._probe.hit("write", self._rel)
        return self._f.write(data)

    def flush(self):
        if not self._flushed and not self._f.closed:
            self._flushed = True
            self._probe.hit("flush", self._rel)
        return self._f.flush()

    def close(self):
        if not self._f.closed:
            self._probe.hit("close", self._rel)
        return self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def read_trace(path: str) -> tuple[list[Boundary], int | None, str | None]:
    """A rank's trace file: its boundaries, the index it was killed at (None) and how ("one",
    "all"). A line torn by the kill itself is dropped."""
    rank = int(os.path.basename(path).split(".")[0].removeprefix("rank"))
    boundaries, killed, victims = [], None, None
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return [], None, None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        boundaries.append(Boundary(rank, entry["index"], entry["kind"], entry["path"]))
        if "killed" in entry:
            killed, victims = entry["index"], entry["killed"]
    return boundaries, killed, victims


# ---------------------------------------------------------------- what interposition missed


def snapshot(root: str) -> dict[str, list]:
    """Every file below `root` (a path or an object-store URI) with what tells a rewrite
    apart: [size, mtime_ns, inode] on local disk, [size] in an object store."""
    from ckptlib.storage import is_remote, open_storage

    if is_remote(root):
        store = open_storage(root)
        return {name: [size] for name, size in store.list().items()} if store.exists() else {}
    out: dict[str, list] = {}
    top = os.path.abspath(root)
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            out[os.path.relpath(full, top).replace(os.sep, "/")] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def _covered(path: str, named: set[str]) -> bool:
    """`path` or a directory above it is among `named` (normalised)."""
    if "." in named:
        return True  # a request that named the root (an object store's batch delete)
    path = normalize(path)
    while True:
        if path in named:
            return True
        if "/" not in path:
            return False
        path = path.rsplit("/", 1)[0]


def unseen(before: dict[str, list], after: dict[str, list], boundaries: list[Boundary]) -> list[str]:
    """Files below the root that the save wrote, rewrote or removed where no boundary of any
    rank names them (a writer below Python): 'wrote PATH' / 'removed PATH', sorted."""
    written = {t for b in boundaries if b.kind in WRITING for t in b.targets()[-1:]}
    removed = {b.targets()[0] for b in boundaries if b.kind in REMOVING}
    removed |= {t for b in boundaries if b.kind == "delete" for t in b.targets()}
    out = []
    for path, meta in sorted(after.items()):
        if before.get(path) != meta and normalize(path) not in written:
            out.append(f"wrote {path}")
    for path in sorted(set(before) - set(after)):
        if not _covered(path, removed):
            out.append(f"removed {path}")
    return out


__all__ = ["Boundary", "Plan", "RankProbe", "WRITING", "normalize", "read_trace", "snapshot", "unseen"]
