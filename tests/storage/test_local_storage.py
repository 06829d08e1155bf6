"""LocalStorage behaviour the backend-neutral conformance suite cannot reach: OS errors mapped to
StorageError messages, descriptors closed on refusal, the create-exclusive fallback for file
systems without hard links, and delete_tree on names that are not directories."""

from __future__ import annotations

import errno
import os
import stat

import pytest

import ckptlib.storage.local as local
from ckptlib.errors import NotARegularFileError, StorageError
from ckptlib.format.native.deletion import is_own_file
from ckptlib.format.native.manifest import MANIFEST_NAME
from ckptlib.format.native.root import DELETING_RE, step_dir
from ckptlib.storage import LocalStorage


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize(
    "code, reason",
    [
        (errno.ENOSPC, f"no space left on device ([Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)})"),
        (errno.EDQUOT, f"no space left (disk quota exceeded) ([Errno {errno.EDQUOT}] {os.strerror(errno.EDQUOT)})"),
        (errno.EACCES, os.strerror(errno.EACCES)),
    ],
    ids=["disk-full", "quota", "permission"],
)
def test_write_error_names_path_and_reason(tmp_path, monkeypatch, code, reason):
    store = LocalStorage(str(tmp_path))

    def replace(src, dst):
        raise _os_error(code)

    monkeypatch.setattr(local.os, "replace", replace)
    with pytest.raises(StorageError) as caught:
        store.write("d/obj", b"abc")
    full = str(tmp_path / "d" / "obj")
    assert str(caught.value) == f"cannot write {full}: {reason}"
    assert caught.value.path == full
    assert os.listdir(tmp_path / "d") == []  # the temporary file is gone too


def test_directory_error_names_the_directory(tmp_path, monkeypatch):
    store = LocalStorage(str(tmp_path))

    def makedirs(path, exist_ok=False):
        raise _os_error(errno.EACCES)

    monkeypatch.setattr(local.os, "makedirs", makedirs)
    with pytest.raises(StorageError) as caught:
        store.write("d/obj", b"abc")
    assert str(caught.value) == f"cannot create directory {tmp_path / 'd'}: {os.strerror(errno.EACCES)}"


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_open_regular_closes_the_descriptor_when_the_open_file_is_not_regular(tmp_path, monkeypatch):
    """A FIFO swapped in between the stat and the open: refused, and the descriptor is closed."""
    path = tmp_path / "obj"
    path.write_bytes(b"abc")
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        return os.stat_result((stat.S_IFIFO | 0o644, *tuple(st)[1:]))

    monkeypatch.setattr(local.os, "fstat", fstat)
    before = _open_fds()
    with pytest.raises(NotARegularFileError) as caught:
        local.open_regular(str(path))
    monkeypatch.undo()
    assert _open_fds() == before
    assert str(caught.value) == (
        f"{path} is a FIFO (named pipe), not a regular file: ckptlib reads only regular files (or symlinks to them)"
    )


@pytest.mark.parametrize("kind", ["regular", "symlink-to-regular", "fifo", "directory"])
def test_check_regular(tmp_path, kind):
    path = tmp_path / "obj"
    if kind == "regular":
        path.write_bytes(b"abc")
    elif kind == "symlink-to-regular":
        (tmp_path / "target").write_bytes(b"abc")
        path.symlink_to("target")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    if kind in ("regular", "symlink-to-regular"):
        assert local.check_regular(str(path)) is None
        return
    described = {"fifo": "a FIFO (named pipe)", "directory": "a directory"}[kind]
    with pytest.raises(NotARegularFileError) as caught:
        local.check_regular(str(path))
    assert str(caught.value) == (
        f"{path} is {described}, not a regular file: ckptlib reads only regular files (or symlinks to them)"
    )


def test_create_exclusive_maps_other_link_errors(tmp_path, monkeypatch):
    store = LocalStorage(str(tmp_path))

    def link(src, dst):
        raise _os_error(errno.EIO)

    monkeypatch.setattr(local.os, "link", link)
    with pytest.raises(StorageError) as caught:
        store.create_exclusive("lock", b"token")
    assert str(caught.value) == f"cannot create {tmp_path / 'lock'}: {os.strerror(errno.EIO)}"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EPERM, errno.EXDEV], ids=["EPERM", "EXDEV"])
def test_create_exclusive_without_hard_links(tmp_path, monkeypatch, code):
    """A file system that refuses link(2) still gets one winner, through O_EXCL."""
    store = LocalStorage(str(tmp_path))

    def link(src, dst):
        raise _os_error(code)

    monkeypatch.setattr(local.os, "link", link)
    assert store.create_exclusive("lock", b"token-1") is True
    assert store.create_exclusive("lock", b"token-2") is False
    assert os.listdir(tmp_path) == ["lock"]
    assert (tmp_path / "lock").read_bytes() == b"token-1"


@pytest.mark.parametrize("kind", ["file", "symlink-to-directory", "dangling-symlink"])
def test_delete_tree_of_a_name_that_is_not_a_directory(tmp_path, kind):
    """Only the name goes: no renamed leftover, and a linked directory keeps its contents."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_bytes(b"k")
    root = tmp_path / "root"
    root.mkdir()
    name = root / "step_1"
    if kind == "file":
        name.write_bytes(b"x")
    elif kind == "symlink-to-directory":
        name.symlink_to(tmp_path / "elsewhere")
    else:
        name.symlink_to(tmp_path / "absent")
    LocalStorage(str(root)).delete_tree("step_1")
    assert os.listdir(root) == []
    assert os.listdir(tmp_path / "elsewhere") == ["keep"]


def test_interrupted_write_leaves_a_temporary_name_ckptlib_recognises(tmp_path, monkeypatch):
    """A write interrupted before its rename leaves `<name>.tmp-<8 hex>`: the name format that
    the deletion code knows as ckptlib's own (so the directory can still be replaced)."""

    def replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(local.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        LocalStorage(str(tmp_path)).write(MANIFEST_NAME, b"{}")
    monkeypatch.undo()
    [leftover] = os.listdir(tmp_path)
    assert leftover.startswith(f"{MANIFEST_NAME}.tmp-")
    assert is_own_file(leftover)


def test_interrupted_delete_tree_leaves_a_name_the_manager_cleans_up(tmp_path, monkeypatch):
    (tmp_path / step_dir(7)).mkdir()
    (tmp_path / step_dir(7) / "x").write_bytes(b"x")

    def rmtree(path, ignore_errors=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(local.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        LocalStorage(str(tmp_path)).delete_tree(step_dir(7))
    monkeypatch.undo()
    [leftover] = os.listdir(tmp_path)
    assert leftover.startswith(f"{step_dir(7)}.deleting-")
    assert DELETING_RE.match(leftover)


def test_delete_tree_that_cannot_finish_still_removes_the_name(tmp_path, monkeypatch):
    """A directory rmtree cannot empty (EBUSY here) is no error: its name is gone, and the
    renamed leftover is what the manager's cleanup removes later."""
    (tmp_path / step_dir(7) / "sub").mkdir(parents=True)
    real_rmdir = os.rmdir

    def rmdir(path, *args, **kwargs):
        if path == "sub":
            raise _os_error(errno.EBUSY)
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir)
    LocalStorage(str(tmp_path)).delete_tree(step_dir(7))
    monkeypatch.undo()
    [leftover] = os.listdir(tmp_path)
    assert DELETING_RE.match(leftover)


def test_create_exclusive_makes_the_object_durable(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        real_fsync(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    assert LocalStorage(str(tmp_path)).create_exclusive("lock", b"token") is True
    monkeypatch.undo()
    assert [name.split(".tmp-")[0] for name in synced] == ["lock", "."]


@pytest.mark.parametrize("size", [len("step_0000000003\n"), 4096], ids=["name", "at-limit"])
def test_pointer_file_is_read_as_text(tmp_path, size):
    """A `latest` that is a regular file (no symlinks there) holds the name, whitespace-padded."""
    (tmp_path / "latest").write_bytes(b"step_0000000003".ljust(size - 1) + b"\n")
    assert LocalStorage(str(tmp_path)).read_pointer("latest") == "step_0000000003"


def test_pointer_file_over_the_limit_is_refused(tmp_path):
    (tmp_path / "latest").write_bytes(b"step_0000000003".ljust(4097))
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).read_pointer("latest")
    assert str(caught.value) == f"{tmp_path / 'latest'}: 4097 bytes is not a pointer (a step directory's name)"


def test_sync_error_names_the_file(tmp_path, monkeypatch):
    store = LocalStorage(str(tmp_path))
    store.write("obj", b"abc", durable=False)

    def fsync(fd):
        raise _os_error(errno.EIO)

    monkeypatch.setattr(local.os, "fsync", fsync)
    with pytest.raises(StorageError) as caught:
        store.sync(["obj"])
    assert str(caught.value) == f"cannot sync {tmp_path / 'obj'}: {os.strerror(errno.EIO)}"


def test_directory_that_cannot_be_opened_for_fsync_is_no_error(tmp_path, monkeypatch):
    """Some file systems refuse to open a directory: the write still succeeds."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise _os_error(errno.EACCES)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local.os, "open", open_)
    LocalStorage(str(tmp_path)).write("obj", b"abc")
    monkeypatch.undo()
    assert (tmp_path / "obj").read_bytes() == b"abc"


def test_directory_fsync_refused_by_the_file_system_is_no_error(tmp_path, monkeypatch):
    """EINVAL from fsync on a directory (some file systems): the write still succeeds."""
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise _os_error(errno.EINVAL)
        real_fsync(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    LocalStorage(str(tmp_path)).write("obj", b"abc")
    monkeypatch.undo()
    assert (tmp_path / "obj").read_bytes() == b"abc"


def test_open_regular_descriptor_is_nonblocking_and_close_on_exec(tmp_path):
    import fcntl

    (tmp_path / "obj").write_bytes(b"abc")
    fd, size = local.open_regular(str(tmp_path / "obj"))
    try:
        assert size == 3
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)


def test_sync_of_a_missing_object_names_it(tmp_path):
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).sync(["absent"])
    assert str(caught.value) == f"cannot sync {tmp_path / 'absent'}: {os.strerror(errno.ENOENT)}"


def test_create_exclusive_without_hard_links_makes_a_0644_file(tmp_path, monkeypatch):
    def link(src, dst):
        raise _os_error(errno.EPERM)

    monkeypatch.setattr(local.os, "link", link)
    old = os.umask(0o022)
    try:
        assert LocalStorage(str(tmp_path)).create_exclusive("lock", b"token") is True
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "lock").st_mode) == 0o644


def test_open_writer_error_names_the_path(tmp_path, monkeypatch):
    def open_(path, mode="r"):
        raise _os_error(errno.EACCES)

    monkeypatch.setattr(local, "open", open_, raising=False)
    with pytest.raises(StorageError) as caught:
        with LocalStorage(str(tmp_path)).open_writer("obj"):
            pass
    assert str(caught.value) == f"cannot write {tmp_path / 'obj'}: {os.strerror(errno.EACCES)}"


def test_direct_reads_only_while_read_is_the_plain_one(tmp_path):
    class Counting(LocalStorage):
        def read(self, path, offset=0, length=None):
            return super().read(path, offset, length)

    assert LocalStorage(str(tmp_path)).direct_read_path("a/b") == str(tmp_path / "a" / "b")
    assert Counting(str(tmp_path)).direct_read_path("a/b") is None


def test_read_past_the_end_without_a_length_is_empty(tmp_path):
    (tmp_path / "obj").write_bytes(b"abc")
    assert LocalStorage(str(tmp_path)).read("obj", offset=6) == b""


def test_short_reads_are_continued(tmp_path, monkeypatch):
    """pread may return fewer bytes than asked before the end of the file: read on."""
    data = bytes(range(200))
    (tmp_path / "obj").write_bytes(data)
    real_pread = os.pread
    monkeypatch.setattr(local.os, "pread", lambda fd, n, offset: real_pread(fd, max(1, n // 2), offset))
    store = LocalStorage(str(tmp_path))
    assert store.read("obj", 10, 100) == data[10:110]
    assert store.read("obj") == data


def test_read_past_the_end_with_a_length_says_what_the_file_holds(tmp_path):
    (tmp_path / "obj").write_bytes(b"x" * 50)
    with pytest.raises(EOFError) as caught:
        LocalStorage(str(tmp_path)).read("obj", 10, 100)
    assert str(caught.value) == f"{tmp_path / 'obj'}: wanted 100 bytes at offset 10, file holds 50"


def test_list_children_leaves_out_symlinked_directories(tmp_path):
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_2").symlink_to(tmp_path / "step_1")
    (tmp_path / "file").write_bytes(b"")
    assert LocalStorage(str(tmp_path)).list_children() == ["step_1"]


def test_delete_tree_error_names_the_directory(tmp_path, monkeypatch):
    (tmp_path / "step_1").mkdir()

    def rename(src, dst):
        raise _os_error(errno.EBUSY)

    monkeypatch.setattr(local.os, "rename", rename)
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).delete_tree("step_1")
    assert str(caught.value) == f"cannot delete {tmp_path / 'step_1'}: {os.strerror(errno.EBUSY)}"


@pytest.mark.parametrize("operation", ["set_pointer", "delete_tree"])
def test_pointer_and_delete_make_the_root_durable(tmp_path, monkeypatch, operation):
    (tmp_path / "step_1").mkdir()
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        real_fsync(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    store = LocalStorage(str(tmp_path))
    if operation == "set_pointer":
        store.set_pointer("latest", "step_1")
    else:
        store.delete_tree("step_1")
    monkeypatch.undo()
    assert synced == ["."]


def test_set_pointer_error_names_the_pointer(tmp_path, monkeypatch):
    def symlink(target, path):
        raise _os_error(errno.EPERM)

    monkeypatch.setattr(local.os, "symlink", symlink)
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).set_pointer("latest", "step_1")
    assert str(caught.value) == f"cannot update pointer {tmp_path / 'latest'}: {os.strerror(errno.EPERM)}"
    assert os.listdir(tmp_path) == []


def test_unreadable_pointer_names_it(tmp_path, monkeypatch):
    def readlink(path):
        raise _os_error(errno.EACCES)

    monkeypatch.setattr(local.os, "readlink", readlink)
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).read_pointer("latest")
    assert str(caught.value) == f"cannot read pointer {tmp_path / 'latest'}: {os.strerror(errno.EACCES)}"


def test_pointer_file_that_is_not_text_is_refused(tmp_path):
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(StorageError) as caught:
        LocalStorage(str(tmp_path)).read_pointer("latest")
    assert str(caught.value) == f"{tmp_path / 'latest'}: pointer file is not UTF-8 text"
