"""The remote tier of a cluster checkpoint: every rank uploads its own files, one commit.

    RemoteTier("s3://bucket/run", keep_last=10, upload_concurrency=4)

An upload is collective. Rank 0 locks the remote root (a root it cannot lock is an
UploadError) and marks the step pending; every rank then streams the files assigned to it
(normally its own shard; rank 0 also `.metadata`) from its node's local root,
`upload_concurrency` at a time, each checked against the manifest's CRC-32 on the way (to a
directory remote: each 1 MiB piece checksummed, then copied in the kernel; a local copy that
does not match is a CheckpointCorruptError). The ranks agree on the
outcome once; only when every rank succeeded does rank 0 check the remote sizes, write the
manifest (the local bytes), move the remote `latest` (only forward in commit order: an
abandoned branch never takes it back) and apply the remote retention; each of those steps
(and uncommitting an older copy) is fenced by the remote lock's lease (`RootLock.fence`): a
lock lost meanwhile is LockedError and the step is not taken. Any failure on any
rank leaves the remote `latest` as it was, on every rank, as an UploadError naming the rank
and the object (UploadRankLostError when a rank disappeared, e.g. a node killed
mid-upload); the partial step is debris the next upload or gc removes. An upload replacing
another committed copy of its step moves the remote `latest` off that step before it
uncommits it (`pointers`), so a cut anywhere leaves `latest` on a committed step. Upload time
grows with the per-rank shard size, not the checkpoint size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import mmap
import os
import time
from typing import Any, Iterator

from ckptlib._runtime import agree as _dist
from ckptlib._runtime.observe import log_operation
from ckptlib.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DamagedCopyError,
    LockedError,
    RankLostError,
    StateError,
    StorageError,
    UploadError,
    UploadRankLostError,
)
from ckptlib.format.items.checksum import crc32
from ckptlib.format.native.manifest import MANIFEST_NAME, PENDING_NAME, Manifest
from ckptlib.format.native.root import LATEST, committed_steps, parse_step, step_dir
from ckptlib.manager.cleanup import collect
from ckptlib.manager.cluster.pointers import move_latest_off
from ckptlib.manager.lock import RootLock
from ckptlib.manager.policies import KeepLast, RetentionPolicy
from ckptlib.saving.saving import SaveResult
from ckptlib.storage import open_storage
from ckptlib.storage.base import Storage, SupportsDirectReads
from ckptlib.storage.local import open_regular

COPY_CHUNK = 8 << 20  # bytes read from the local file and handed to the remote writer at a time
PIECE = 1 << 20  # bytes of a local file checksummed, then copied by the kernel, at a time (stays in L2)
WINDOW = 64 << 20  # bytes of a local file mapped at a time (a multiple of mmap.ALLOCATIONGRANULARITY)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault a window in at once (Linux)


def _kernel_copy(src_path: str, out: Any, size: int) -> tuple[int, int] | None:
    """(CRC-32, bytes) of up to `size` bytes of `src_path` copied into the open file `out`
    inside the kernel, one PIECE at a time (sendfile: here several times faster than a write()
    of the same bytes from user space), each piece checksummed from a mapping of the source
    just before the kernel copies it, so the copy reads it from the CPU's cache and the remote
    copy is not read back (docs/benchmarks.md, "The cluster tier against a directory remote").
    None when `out` has no descriptor or the file system cannot (nothing written). The mapping
    is never longer than the file, and ckptlib never truncates a committed step's file."""
    try:
        out_fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # an object stream (io.UnsupportedOperation)
        return None
    out.flush()
    fd, file_size = open_regular(src_path)
    try:
        length = min(size, file_size)
        if length == 0:
            return 0, 0
        crc = sent = 0
        for start in range(0, length, WINDOW):  # mapped a window at a time: a shard may exceed memory
            size_here = min(WINDOW, length - start)
            flags = mmap.MAP_SHARED | _MAP_POPULATE
            with mmap.mmap(fd, size_here, flags=flags, prot=mmap.PROT_READ, offset=start) as mapped:
                with memoryview(mapped) as view:
                    while sent < start + size_here:
                        end = min(sent + PIECE, start + size_here)
                        with view[sent - start : end - start] as part:
                            crc = crc32(part, crc)
                        while sent < end:
                            try:
                                n = os.sendfile(out_fd, fd, sent, end - sent)
                            except OSError as exc:
                                if sent == 0 and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                                    return None
                                raise
                            if not n:
                                return crc, sent
                            sent += n
        return crc, sent
    finally:
        os.close(fd)


def copy_file(src: Storage, dst: Storage, name: str, size: int, expected_crc: int) -> None:
    """Copy `name` from `src` to `dst`, checking the bytes against the manifest's CRC on the
    way: file to file, copied in the kernel (`_kernel_copy`); else streamed in chunks."""
    path = src.direct_read_path(name) if isinstance(src, SupportsDirectReads) else None
    with dst.open_writer(name) as out:
        target = getattr(out, "name", None)
        copied = _kernel_copy(path, out, size) if path is not None and isinstance(target, str) else None
        if copied is not None:
            crc, sent = copied
        else:
            crc = sent = 0
            while sent < size:
                data = src.read(name, sent, min(COPY_CHUNK, size - sent))
                if not data:
                    break
                crc = crc32(data, crc)
                out.write(data)
                sent += len(data)
        if sent != size or crc != expected_crc:
            where = f"{src.uri.rstrip('/')}/{name}"
            raise CheckpointCorruptError(
                f"{where}: the local copy does not match its manifest ({sent} bytes, crc32 {crc:08x}; the manifest "
                f"says {size} bytes, crc32 {expected_crc:08x}); not uploading it",
                path=where,
            )


def remote_matches(dst: Storage, name: str, size: int, expected_crc: int) -> bool:
    """Whether `dst` already holds `name` complete (a resumed upload): its size and CRC."""
    crc = 0
    pos = 0
    try:
        while pos < size:
            data = dst.read(name, pos, min(COPY_CHUNK, size - pos))
            if not data:
                return False
            crc = crc32(data, crc)
            pos += len(data)
    except (FileNotFoundError, EOFError, CheckpointError):
        return False
    return pos == size and crc == expected_crc


@contextlib.contextmanager
def _uploading(what: str, group, step: int, path: str) -> Iterator[None]:
    """A rank lost during an upload is an UploadRankLostError (an UploadError and a RankLostError)."""
    try:
        with _dist.peer_loss_as_error(what, group, step=step, path=path):
            yield
    except RankLostError as exc:
        if isinstance(exc, UploadError):
            raise
        raise UploadRankLostError(exc.message, ranks=exc.ranks, step=exc.step, path=exc.path, rank=exc.rank) from exc


class RemoteTier:
    """A remote root (object store or shared directory) the cluster tier uploads to; see the
    module docstring. `keep_last` / `retention`: this root's retention, as on any manager."""

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        keep_last: int | None = None,
        retention: RetentionPolicy | None = None,
        upload_concurrency: int = 4,
    ):
        if keep_last is not None and retention is not None:
            raise StateError("pass keep_last or retention, not both (combine policies with |)")
        if retention is not None and not callable(getattr(retention, "keep", None)):
            raise StateError(f"retention must have keep(records), got {retention!r}")
        self.upload_concurrency = _positive_concurrency(upload_concurrency)
        self.uri = os.fspath(uri)
        self.storage: Storage = open_storage(self.uri)
        self.retention = retention if retention is not None else KeepLast(keep_last)
        # Rank 0: the committed remote steps as last seen (the inventory, then each upload's
        # commit and retention), so a save never waits for the remote to ask it.
        self.known_steps: set[int] = set()
        self.lock = RootLock(self.storage)  # its `hold` is the manager's hold_lock

    def __repr__(self) -> str:
        return f"RemoteTier({self.uri!r})"

    def path(self, step: int) -> str:
        return f"{self.uri.rstrip('/')}/{step_dir(step)}"

    # -- the root -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        return committed_steps(self.storage)

    def versions(self) -> list[tuple[int, bytes]]:
        """(step, manifest bytes) of every committed remote step, oldest first (rank 0, for
        the inventory)."""
        found = [(step, self.storage.child(step_dir(step)).read(MANIFEST_NAME)) for step in self.steps()]
        self.known_steps = {step for step, _ in found}
        return found

    def latest_order(self) -> tuple | None:
        """The commit order of the checkpoint the remote `latest` names (None: none)."""
        step = parse_step(self.storage.read_pointer(LATEST) or "")
        if step is None:
            return None
        try:
            return _read_manifest(self.storage.child(step_dir(step))).commit_order(named_by_latest=True)
        except (FileNotFoundError, CheckpointError):
            return None

    def take_lock(self) -> None:
        """Rank 0: take the remote root's lock (or confirm a held one); UploadError if it cannot."""
        try:
            self.lock.take()
        except (LockedError, CheckpointError, OSError) as exc:
            err = UploadError(f"{self.uri}: cannot lock the remote root: {type(exc).__name__}: {exc}", path=self.uri)
            raise (err if isinstance(exc, LockedError) else unreachable(err)) from exc

    def close(self) -> None:
        self.lock.close()

    def gc(self, *, dry_run: bool = False, on_removed=None, protect: set[int] = frozenset()) -> list[str]:
        """Rank 0: the remote retention and debris removal, under the remote lock (not for a dry run)."""
        if dry_run:
            return collect(self.storage, self.uri, self.retention, protect=set(protect), dry_run=True)
        self.take_lock()
        try:
            removed = collect(
                self.storage,
                self.uri,
                self.retention,
                protect=set(protect),
                on_removed=on_removed,
                fence=self.lock.fence,
            )
        finally:
            self.lock.abandon()
        self.known_steps -= {parse_step(name) for name in removed}
        return removed

    # -- an upload ----------------------------------------------------------------------
    def upload(
        self,
        step: int,
        manifest_bytes: bytes,
        local: Storage,
        files: list[str],
        group=None,
        *,
        resumed: bool = False,
    ) -> SaveResult:
        """Collective: upload `step` (this rank: `files` from `local`, its node's step
        directory) and commit it remotely; see the module docstring."""
        started = time.perf_counter()
        name = step_dir(step)
        remote = self.storage.child(name)
        where = f"{self.uri.rstrip('/')}/{name}"
        manifest = Manifest.from_bytes(manifest_bytes, f"{local.uri}/{MANIFEST_NAME}")
        rank = _dist.get_rank(group)
        with _uploading(f"upload of step {step} to {self.uri}", group, step, where):
            present = _dist.decide_on_rank0(lambda: self._begin(step, remote, where, manifest, manifest_bytes), group)
            try:
                if present is not None:
                    _dist.agree(
                        lambda: self._send(local, remote, where, manifest, files, present, rank, resumed),
                        group,
                        every_pair=True,
                    )
                moved = _dist.decide_on_rank0(
                    lambda: self._commit(step, remote, where, manifest, manifest_bytes), group
                )
            except BaseException:
                if rank == 0:
                    self.lock.abandon()
                raise
        seconds = time.perf_counter() - started
        log_operation(
            "upload",
            uri=remote.uri,
            step=step,
            nbytes=manifest.total_bytes,
            seconds=seconds,
            world_size=manifest.world_size,
            resumed=resumed,
            latest_moved=moved,
            rank=rank,
        )
        return SaveResult(
            uri=remote.uri, step=step, world_size=manifest.world_size, total_bytes=manifest.total_bytes, seconds=seconds
        )

    def _begin(
        self, step: int, remote: Storage, where: str, manifest: Manifest, manifest_bytes: bytes
    ) -> dict[str, int] | None:
        """Rank 0: lock, and make the step ready for the files: None when the same checkpoint is
        committed there already, else what the step holds (a resumed upload skips complete files)."""
        self.take_lock()
        try:
            present = remote.list() if remote.exists() else {}
            if MANIFEST_NAME in present:
                existing = remote.read(MANIFEST_NAME)
                if existing == manifest_bytes:
                    return None
                try:
                    newer = _read_manifest(remote).commit_order() >= manifest.commit_order()
                except CheckpointError:
                    newer = False  # a damaged remote manifest: replace it
                if newer:
                    raise UploadError(
                        f"{where} holds a checkpoint committed after this one (by commit order); refusing to "
                        "replace it",
                        path=where,
                    )
                # The older copy is uncommitted before its files are replaced: first the remote
                # `latest` leaves it, so a cut from here until the commit never leaves `latest`
                # naming a step without its manifest (the step stays committed locally and a
                # later upload, wait() or close() brings the new copy).
                self.lock.fence(f"replace step {manifest.step}")
                move_latest_off(self.storage, step, whole=True)
                remote.delete([MANIFEST_NAME])
                present.pop(MANIFEST_NAME)
            remote.write(PENDING_NAME, b'{"upload": "in progress"}', durable=False)
            return present
        except BaseException as exc:
            self.lock.abandon()
            own = isinstance(exc, CheckpointError) and not isinstance(exc, StorageError)
            kept = own or isinstance(exc, UploadError)
            if kept or not isinstance(exc, Exception):
                raise
            raise unreachable(UploadError(f"{where}: upload failed: {type(exc).__name__}: {exc}", path=where)) from exc

    def _send(
        self,
        local: Storage,
        remote: Storage,
        where: str,
        manifest: Manifest,
        files: list[str],
        present: dict[str, int],
        rank: int,
        resumed: bool,
    ) -> None:
        """This rank's files, `upload_concurrency` at a time; a failure names the rank and object."""

        def one(fname: str) -> None:
            record = manifest.files[fname]
            if resumed and present.get(fname) == record.size:
                if remote_matches(remote, fname, record.size, record.crc32):
                    return
            try:
                copy_file(local, remote, fname, record.size, record.crc32)
            except Exception as exc:  # noqa: BLE001 - one error naming this rank and the object
                source = f"{local.uri.rstrip('/')}/{fname}"
                if isinstance(exc, CheckpointCorruptError) or (
                    isinstance(exc, (CheckpointNotFoundError, FileNotFoundError)) and not _present(local, fname)
                ):
                    problem = exc.message if isinstance(exc, CheckpointError) else f"{source}: missing"
                    raise DamagedCopyError(f"rank {rank}: {problem}", file=fname, path=source, rank=rank) from exc
                raise unreachable(
                    UploadError(
                        f"rank {rank}: {where}/{fname}: upload failed: {type(exc).__name__}: {exc}",
                        path=f"{where}/{fname}",
                        rank=rank,
                    )
                ) from exc

        todo = sorted(set(files))
        if not todo:
            return
        with concurrent.futures.ThreadPoolExecutor(min(self.upload_concurrency, len(todo)), "ckptlib-upload") as pool:
            for future in [pool.submit(one, f) for f in todo]:
                future.result()

    def _commit(self, step: int, remote: Storage, where: str, manifest: Manifest, manifest_bytes: bytes) -> bool:
        """Rank 0, after every rank uploaded: verify the sizes, write the manifest, move `latest`
        if this commit is the newest, apply retention, unlock. Returns whether `latest` moved."""
        try:
            self.lock.fence(f"commit step {step}")
            if MANIFEST_NAME not in remote.list(MANIFEST_NAME):
                listing = remote.list()
                wrong = [
                    f"{f} ({listing.get(f, 'missing')} bytes, expected {r.size})"
                    for f, r in sorted(manifest.files.items())
                    if listing.get(f) != r.size
                ]
                if wrong:
                    raise UploadError(f"{where}: the uploaded copy is incomplete: {', '.join(wrong)}", path=where)
                remote.write(MANIFEST_NAME, manifest_bytes)
                remote.delete([PENDING_NAME])
            current = self.latest_order()
            moved = current is None or current <= manifest.commit_order()
            if moved:
                self.lock.fence(f"move latest to step {step}")
                self.storage.set_pointer(LATEST, step_dir(step))
            removed = collect(self.storage, self.uri, self.retention, protect={step}, fence=self.lock.fence)
            self.known_steps = (self.known_steps | {step}) - {parse_step(name) for name in removed}
        except BaseException as exc:
            self.lock.abandon()
            if isinstance(exc, (UploadError, LockedError)) or not isinstance(exc, Exception):
                raise
            raise unreachable(UploadError(f"{where}: upload failed: {type(exc).__name__}: {exc}", path=where)) from exc
        self.lock.abandon()
        return moved


def unreachable(err: UploadError) -> UploadError:
    """`err`, marked as the remote's being unreachable (`remote_lag.tolerated`): the step stays
    local and a later save tries again. The mark travels with the error to every rank."""
    err.unreachable = True
    return err


def _present(local: Storage, name: str) -> bool:
    try:
        return name in local.list(name)
    except (OSError, CheckpointError):
        return False


def _positive_concurrency(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise StateError(f"upload_concurrency must be a positive int, got {value!r}")
    return value


def _read_manifest(storage: Storage) -> Manifest:
    return Manifest.from_bytes(storage.read(MANIFEST_NAME), f"{storage.uri}/{MANIFEST_NAME}")


def as_remote(remote: Any) -> RemoteTier | None:
    """`remote=` of the manager: a RemoteTier, a URI (keeping every step), or None."""
    if remote is None or isinstance(remote, RemoteTier):
        return remote
    if isinstance(remote, (str, os.PathLike)):
        return RemoteTier(remote)
    raise StateError(f"remote must be a URI or a RemoteTier, got {type(remote).__name__} {remote!r}")


__all__ = ["RemoteTier", "as_remote", "copy_file", "remote_matches"]
