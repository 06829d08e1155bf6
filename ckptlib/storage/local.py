"""Local filesystem storage: fsynced files, atomic renames, a relative `latest` symlink."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from typing import BinaryIO, Iterable, Iterator

from ckptlib.errors import NotARegularFileError, StorageError
from ckptlib.storage.base import check_list_prefix, check_relative


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            # A StorageError naming the directory, never the bare OSError (the crash harness's
            # fail cases at a directory fsync, docs/crash-boundaries.md).
            raise StorageError(f"cannot sync directory {path}: {exc.strerror or exc}", path=path) from exc
    finally:
        os.close(fd)


def os_error(exc: OSError, what: str, path: str) -> StorageError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device" if exc.errno == errno.ENOSPC else "no space left (disk quota exceeded)"
        return StorageError(f"{what} {path}: {reason} ([Errno {exc.errno}] {exc.strerror})", path=path)
    return StorageError(f"{what} {path}: {exc.strerror or exc}", path=path)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# The `latest` pointer is a step directory's name; a pointer file larger than this is not one.
_MAX_POINTER_BYTES = 4096


def _not_regular(mode: int, full: str) -> NotARegularFileError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return NotARegularFileError(
        f"{full} is {kind}, not a regular file: ckptlib reads only regular files (or symlinks to them)",
        path=full,
    )


def open_regular(full: str) -> tuple[int, int]:
    """(fd, size) of the regular file at `full`, symlinks followed; NotARegularFileError for a
    FIFO, device, socket or directory. Checked with stat before opening (opening a device can
    have effects) and again on the open descriptor, which is opened with O_NONBLOCK so a FIFO
    swapped in between cannot block. FileNotFoundError propagates."""
    mode = os.stat(full).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(mode, full)
    fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode, full)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def check_regular(full: str) -> None:
    """NotARegularFileError unless `full` is a regular file (symlinks followed)."""
    mode = os.stat(full).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(mode, full)


class LocalStorage:
    """A directory on a local (or network-mounted POSIX) filesystem."""

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.uri = self.root
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def _path(self, path: str) -> str:
        return os.path.join(self.root, *check_relative(path, self.uri).split("/"))

    def child(self, name: str) -> "LocalStorage":
        return LocalStorage(self._path(name), fsync=self.fsync)

    def local_path(self, path: str = "") -> str:
        return self._path(path) if path else self.root

    def exists(self) -> bool:
        return os.path.isdir(self.root)

    def is_file(self) -> bool:
        return os.path.isfile(self.root)

    def _ensure_parent(self, full: str) -> None:
        parent = os.path.dirname(full)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, "cannot create directory", parent) from exc

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        full = self._path(path)
        self._ensure_parent(full)
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._write_file(open(tmp, "wb"), data, fsync=durable)
            os.replace(tmp, full)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise os_error(exc, "cannot write", full) from exc
        if self.fsync and durable:
            _fsync_dir(os.path.dirname(full))

    def sync(self, paths: Iterable[str], names_only: Iterable[str] = ()) -> None:
        if not self.fsync:
            return
        directories = {os.path.dirname(self._path(path)) for path in names_only}
        for path in paths:
            full = self._path(path)
            try:
                fd = os.open(full, os.O_RDONLY)
            except OSError as exc:
                raise os_error(exc, "cannot sync", full) from exc
            try:
                os.fsync(fd)
            except OSError as exc:
                raise os_error(exc, "cannot sync", full) from exc
            finally:
                os.close(fd)
            directories.add(os.path.dirname(full))
        # Not re-fsyncing files that are already durable matters: on ext4 even the fsync of
        # a clean file can wait for a device cache flush.
        for directory in sorted(directories):
            _fsync_dir(directory)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` only if nothing is there (see base.SupportsCreateExclusive).

        The bytes go to a temporary file first and are published with link(2), which fails if
        the name exists, so a reader never sees a half-written object.
        """
        full = self._path(path)
        self._ensure_parent(full)
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._write_file(open(tmp, "wb"), data)
            try:
                os.link(tmp, full)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                return self._create_exclusive_plain(full, data)  # a filesystem without hard links
        except OSError as exc:
            raise os_error(exc, "cannot create", full) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if self.fsync:
            _fsync_dir(os.path.dirname(full))
        return True

    def _create_exclusive_plain(self, full: str, data: bytes) -> bool:
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        self._write_file(os.fdopen(fd, "wb"), data)
        return True

    def _write_file(self, f: BinaryIO, data: bytes, *, fsync: bool = True) -> None:
        """Write `data` to the open file `f`, fsync it (unless fsync is off), close it."""
        with f:
            f.write(data)
            f.flush()
            if self.fsync and fsync:
                os.fsync(f.fileno())

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[BinaryIO]:
        full = self._path(path)
        self._ensure_parent(full)
        try:
            f = open(full, "wb")
        except OSError as exc:
            raise os_error(exc, "cannot write", full) from exc
        try:
            with f:
                yield f
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())  # the name: when a commit syncs it (`sync`)
        except OSError as exc:  # ENOSPC and friends, from a write, the flush, fsync or close
            with contextlib.suppress(OSError):
                os.unlink(full)  # a partial file is never left behind to fill the disk
            raise os_error(exc, "cannot write", full) from exc
        except BaseException:
            with contextlib.suppress(OSError):  # like an aborted upload: no partial object is left
                os.unlink(full)
            raise

    def direct_read_path(self, path: str) -> str | None:
        """`SupportsDirectReads`: the file's path, unless `read` was replaced (by a subclass or a
        patch), whose readers must then see every read."""
        if type(self).read is not _PLAIN_READ:
            return None
        return self.local_path(path)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Regular files only (NotARegularFileError otherwise), and never more than the file
        system says the file holds (length=None: up to its size when opened)."""
        full = self._path(path)
        fd, size = open_regular(full)  # FileNotFoundError propagates: callers map it
        try:
            want = max(0, size - offset) if length is None else length
            data = os.pread(fd, want, offset)
            if len(data) < want:  # a short read before the end of the file: read on
                parts = [data]
                got = len(data)
                while got < want:
                    more = os.pread(fd, want - got, offset + got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
        finally:
            os.close(fd)
        if length is not None and len(data) != length:
            raise EOFError(f"{full}: wanted {length} bytes at offset {offset}, file holds {offset + len(data)}")
        return data

    def list(self, prefix: str = "") -> dict[str, int]:
        check_list_prefix(prefix, self.uri)
        out: dict[str, int] = {}
        if not os.path.isdir(self.root):
            return out
        for dirpath, _dirnames, filenames in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if rel.startswith(prefix):
                    full = os.path.join(dirpath, name)
                    # stat, not lstat: a symlinked file (the Hugging Face cache layout) has its
                    # target's size. A dangling link is left out (absent, as its target is).
                    with contextlib.suppress(FileNotFoundError):
                        out[rel] = os.stat(full).st_size
        return out

    def list_top(self) -> dict[str, int]:
        """`SupportsShallowList`: the files directly in the root (what `list` shows of it), one scandir."""
        out: dict[str, int] = {}
        if not os.path.isdir(self.root):
            return out
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_dir():  # as os.walk sorts them: a symlink to a directory is a directory
                    continue
                with contextlib.suppress(FileNotFoundError):  # a dangling link: absent, as in `list`
                    out[entry.name] = os.stat(entry.path).st_size
        return out

    def list_children(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))

    def delete(self, paths: Iterable[str]) -> None:
        for full in [self._path(path) for path in paths]:  # every path checked before anything is deleted
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
            except OSError as exc:  # named, never the bare OSError (the crash harness's fail cases)
                raise StorageError(f"cannot delete {full}: {exc.strerror or exc}", path=full) from exc

    def delete_tree(self, name: str = "") -> None:
        target = self._path(name) if name else self.root
        if os.path.islink(target) or os.path.isfile(target):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            return
        # Rename first so a crash mid-delete never leaves a half-deleted directory under
        # its original (possibly committed-looking) name.
        doomed = f"{target}.deleting-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, doomed)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, "cannot delete", target) from exc
        shutil.rmtree(doomed, ignore_errors=True)
        if self.fsync:
            _fsync_dir(os.path.dirname(target))

    def set_pointer(self, name: str, target: str) -> None:
        link = self._path(name)
        check_relative(target, self.uri)
        self._ensure_parent(link)
        tmp = f"{link}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            os.symlink(target, tmp)  # relative: the root can be moved or mounted elsewhere
            os.replace(tmp, link)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise os_error(exc, "cannot update pointer", link) from exc
        if self.fsync:
            _fsync_dir(os.path.dirname(link))

    def read_pointer(self, name: str) -> str | None:
        link = self._path(name)
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: not a symlink; a regular file is read as text
                raise os_error(exc, "cannot read pointer", link) from exc
            fd, size = open_regular(link)
            try:
                if size > _MAX_POINTER_BYTES:
                    raise StorageError(f"{link}: {size} bytes is not a pointer (a step directory's name)", path=link)
                data = os.pread(fd, size, 0)
            finally:
                os.close(fd)
            try:
                target = data.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise StorageError(f"{link}: pointer file is not UTF-8 text", path=link) from exc
        target = target.rstrip("/")
        if os.path.isabs(target):
            rel = os.path.relpath(target, os.path.dirname(link))
            target = rel
        return target


_PLAIN_READ = LocalStorage.read  # as defined, before anything could patch it
