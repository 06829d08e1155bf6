"""A local fast tier in front of a remote root: save to local disk, upload in the background.

    manager = ckptlib.CheckpointManager("/nvme/run1", remote_root="s3://bucket/run1", keep_local=1, keep_last=5)

`save()` blocks the training loop only for the local write (a normal committed checkpoint
under the local root). Rank 0 then copies the step to the remote root in a background
thread: every file is streamed with its CRC-32 checked against the manifest on the way, the
remote sizes are checked after, and only then are the manifest (the local one, byte for
byte) and the remote `latest` written, and the remote retention applied, under the remote
root's lock. The remote `latest` therefore only ever names a complete, verified copy.

The local root must hold every rank's files where rank 0 can read them (one node, or a
shared filesystem): rank 0 uploads. `keep_local` steps stay on local disk; `keep_last` /
`retention` apply to the remote root.

A crash during an upload leaves the remote `latest` as it was (the partial step is debris
that remote retention removes). The next `load()` or first `save()` finds the local step
newer than the remote `latest` and uploads it again, skipping files already complete
remotely (same size and CRC), before anything else. `load()` reads the local copy when its
manifest is identical to the remote one of the step to load, else reads the remote copy.

Uploads run one at a time: the next `save()` (and `wait()`, `gc()`, `close()`) first waits
for the upload in flight and raises its failure on every rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from typing import Any, Mapping

from . import _dist
from .checkpoint import LoadResult, SaveResult, load
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    LockedError,
    StateError,
    StorageError,
    UploadError,
)
from .format import MANIFEST_NAME, PENDING_NAME, Manifest, classify
from .format.checksum import crc32
from .manager import LATEST, CheckpointManager, KeepLast, remote_root_manager, step_dir
from .observe import log_operation
from .steps import check_step
from .storage import Storage

COPY_CHUNK = 8 << 20  # bytes read from the local file and handed to the remote writer at a time


def _copy_file(src: Storage, dst: Storage, name: str, size: int, expected_crc: int) -> None:
    """Stream `name` from `src` to `dst`, checking the bytes sent against the manifest's CRC."""
    crc = 0
    sent = 0
    with dst.open_writer(name) as out:
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


def _remote_matches(dst: Storage, name: str, size: int, expected_crc: int) -> bool:
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


class _Upload:
    """One step's upload, on rank 0, in a background thread (or in the foreground)."""

    def __init__(
        self, manager: "TieredCheckpointManager", step: int, *, resumed: bool = False, overwrite: bool = False
    ):
        self.manager = manager
        self.step = step
        self.resumed = resumed
        self.overwrite = overwrite
        self.error: BaseException | None = None
        self.result: SaveResult | None = None
        self.thread = threading.Thread(target=self.run, name=f"ckptlib-upload-{step}")

    def run(self) -> None:
        try:
            self.result = self.manager._upload(self.step, resumed=self.resumed, overwrite=self.overwrite)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() on every rank
            self.error = exc


@remote_root_manager
class TieredCheckpointManager(CheckpointManager):
    """CheckpointManager(local_root, remote_root=URI, keep_local=1, ...): see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        remote_root: str | os.PathLike,
        keep_local: int = 1,
        keep_last: int | None = None,
        retention=None,
        upload_concurrency: int = 4,
        process_group=None,
        hold_lock: bool = False,
        async_save: bool = False,
        **kwargs: Any,
    ):
        """`keep_local`: committed steps kept under the local `root` (at least 1). `keep_last`
        / `retention`: the remote root's retention policy. `upload_concurrency`: files uploaded
        at once. The other arguments are CheckpointManager's (async_save is not supported:
        the local write is the only blocking part already)."""
        if async_save:
            raise StateError(
                "async_save=True does not combine with remote_root: the upload already runs in the background"
            )
        if not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1:
            raise StateError(f"keep_local must be a positive int, got {keep_local!r}")
        if not isinstance(upload_concurrency, int) or upload_concurrency < 1:
            raise StateError(f"upload_concurrency must be a positive int, got {upload_concurrency!r}")
        super().__init__(
            root, retention=KeepLast(keep_local), process_group=process_group, hold_lock=hold_lock, **kwargs
        )
        self.remote = CheckpointManager(
            remote_root, keep_last=keep_last, retention=retention, process_group=process_group, hold_lock=hold_lock
        )
        self.remote_root_uri = self.remote.root_uri
        local_path, remote_path = self.storage.local_path(), self.remote.storage.local_path()
        if local_path is not None and remote_path is not None:
            a, b = os.path.realpath(local_path), os.path.realpath(remote_path)
            if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
                raise StateError(f"remote_root {self.remote_root_uri!r} and the local root {self.root_uri!r} overlap")
        self.keep_local = keep_local
        self.upload_concurrency = upload_concurrency
        self._upload_in_flight: _Upload | None = None  # rank 0 only
        self._resume_checked = False
        self._closing = False

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root_uri!r}, remote_root={self.remote_root_uri!r})"

    # -- the upload ---------------------------------------------------------------------
    def _upload(self, step: int, *, resumed: bool = False, overwrite: bool = False) -> SaveResult:
        """Rank 0: copy local `step` to the remote root, verify it, commit it, move the remote
        `latest` and apply remote retention, under the remote root's lock."""
        started = time.perf_counter()
        name = step_dir(step)
        local = self.storage.child(name)
        remote = self.remote.storage.child(name)
        where = f"{self.remote_root_uri.rstrip('/')}/{name}"
        manifest_bytes = local.read(MANIFEST_NAME)
        manifest = Manifest.from_bytes(manifest_bytes, f"{local.uri}/{MANIFEST_NAME}")
        self.remote._take_lock()
        try:
            present = remote.list() if remote.exists() else {}
            committed_same = MANIFEST_NAME in present and remote.read(MANIFEST_NAME) == manifest_bytes
            if not committed_same:
                if MANIFEST_NAME in present:
                    if self.remote.storage.read_pointer(LATEST) == name and not overwrite:
                        raise UploadError(
                            f"{where} is the remote latest and holds a different checkpoint than {local.uri}; "
                            "refusing to replace it",
                            path=where,
                        )
                    remote.delete([MANIFEST_NAME])  # uncommit a stale copy before replacing its files
                remote.write(PENDING_NAME, b'{"upload": "in progress"}', durable=False)
                todo = []
                for fname, record in sorted(manifest.files.items()):
                    if (
                        resumed
                        and present.get(fname) == record.size
                        and _remote_matches(remote, fname, record.size, record.crc32)
                    ):
                        continue
                    todo.append((fname, record))
                with concurrent.futures.ThreadPoolExecutor(self.upload_concurrency, "ckptlib-upload-file") as pool:
                    futures = [pool.submit(_copy_file, local, remote, f, r.size, r.crc32) for f, r in todo]
                    for future in futures:
                        future.result()
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
            self.remote.storage.set_pointer(LATEST, name)
            self.remote._collect(protect={step})
        except (UploadError, CheckpointCorruptError, LockedError):
            self._release_remote_lock()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure becomes one error naming the remote step
            self._release_remote_lock()
            raise UploadError(f"{where}: upload failed: {type(exc).__name__}: {exc}", path=where) from exc
        self.remote._drop_lock()
        seconds = time.perf_counter() - started
        result = SaveResult(
            uri=remote.uri, step=step, world_size=manifest.world_size, total_bytes=manifest.total_bytes, seconds=seconds
        )
        log_operation(
            "upload",
            uri=remote.uri,
            step=step,
            nbytes=manifest.total_bytes,
            seconds=seconds,
            world_size=manifest.world_size,
            resumed=resumed,
        )
        return result

    def _release_remote_lock(self) -> None:
        if not self.remote.hold_lock:
            with contextlib.suppress(Exception):
                self.remote._lock.release()

    def _pending_upload(self) -> int | None:
        """Rank 0: the newest local committed step that the remote `latest` does not cover
        (an upload a crash or a failure interrupted), or None."""
        local = [s.step for s in self._scan() if s.state == "committed"]
        if not local:
            return None
        newest = local[-1]
        remote_latest, _ = self.remote._resolve_latest()
        if remote_latest is not None and remote_latest >= newest:
            return None
        return newest

    def resume_upload(self) -> SaveResult | None:
        """Upload (in the foreground) the newest local step the remote `latest` does not
        cover yet, if any; collective. `load()` and the first `save()` call it."""
        self.wait()

        def rank0() -> SaveResult | None:
            step = self._pending_upload()
            return None if step is None else self._upload(step, resumed=True)

        result = _dist.decide_on_rank0(rank0, self.process_group)
        self._resume_checked = True
        return result

    def _finish_upload(self, timeout: float | None = None) -> SaveResult | None:
        """This rank: wait for its upload in flight (rank 0 has one), raise its failure once."""
        upload = self._upload_in_flight
        if upload is None:
            return None
        upload.thread.join(timeout)
        if upload.thread.is_alive():
            raise StorageError(
                f"upload of step {upload.step} to {self.remote_root_uri} still running after {timeout} s"
            )
        self._upload_in_flight = None
        if upload.error is not None:
            raise upload.error
        return upload.result

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the upload in flight: its SaveResult (the remote copy), None when none was
        in flight; its failure is raised on every rank (once). Collective (except in close())."""
        if self._closing:
            return self._finish_upload(timeout)
        return _dist.decide_on_rank0(lambda: self._finish_upload(timeout), self.process_group)

    def close(self) -> None:
        """Rank 0 waits for the upload in flight (raising its failure there), then both roots'
        locks are released. No collective, like CheckpointManager.close()."""
        self._closing = True
        try:
            self._finish_upload()
        finally:
            try:
                with contextlib.suppress(Exception):
                    super().close()
                self.remote.close()
            finally:
                self._closing = False

    # -- saving -------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save `step` to the local root (the only part that blocks), then upload it in the
        background; the returned SaveResult describes the local copy. Waits for the previous
        upload first (and raises its failure). `overwrite=True` also replaces the step the
        remote `latest` names (CheckpointManager.save's rules, on both roots)."""
        step = check_step(step)
        self.wait()
        if not self._resume_checked:
            self.resume_upload()
        result = super().save(step, state, metadata=metadata, metrics=metrics, overwrite=overwrite)
        if _dist.get_rank(self.process_group) == 0:
            upload = _Upload(self, step, overwrite=overwrite)
            self._upload_in_flight = upload
            upload.thread.start()
        return result

    # -- reading ------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The remote root's latest step (the newest copy that is complete remotely)."""
        return self.remote.latest()

    def steps(self) -> list[int]:
        """Committed steps on the remote root."""
        return self.remote.steps()

    def local_steps(self) -> list[int]:
        """Committed steps on the local root."""
        return super().steps()

    def path(self, step: int) -> str:
        return self.remote.path(step)

    def _choose(self, step: int | None) -> tuple[int | None, str | None]:
        """Rank 0: (step, where to read it): the local copy when its manifest is the remote one's
        (or the remote root lacks the step), else the remote copy."""
        if step is None:
            step, _ = self.remote._resolve_latest()
            if step is None:
                return None, None
        name = step_dir(step)
        local, remote = self.storage.child(name), self.remote.storage.child(name)
        local_ok = classify(local) == "committed"
        remote_ok = classify(remote) == "committed"
        if local_ok and (not remote_ok or local.read(MANIFEST_NAME) == remote.read(MANIFEST_NAME)):
            return step, local.uri
        if remote_ok:
            return step, remote.uri
        raise CheckpointNotFoundError(
            f"step {step} is committed neither under {self.root_uri} nor under {self.remote_root_uri}",
            path=self.remote.path(step),
        )

    def _load_checkpoint(self, state: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> LoadResult | None:
        """Load `step` (None: the remote latest) from the local copy when it is the same
        checkpoint, else from the remote root. First finishes an upload a crash interrupted."""
        if step is not None:
            step = check_step(step)
        self.resume_upload()
        step, where = _dist.decide_on_rank0(lambda: self._choose(step), self.process_group)
        if step is None:
            return self._load_initial(state, kwargs) if self.initial_load is not None else None
        result = load(where, state, process_group=self.process_group, **kwargs)
        self._last_save_step = step
        self.initial_loaded = False
        return result

    def gc(self, *, dry_run: bool = False, on_removed=None) -> list[str]:
        """Remote retention and debris removal (returned), then the local root's (keep_local)."""
        self.wait()
        removed = self.remote.gc(dry_run=dry_run, on_removed=on_removed)
        super().gc(dry_run=dry_run)
        return removed


__all__ = ["TieredCheckpointManager", "UploadError"]
