"""The streamed multipart writer of every object-store backend (`ObjectStorage.open_writer`: S3,
GCS, Azure): a write-only stream that buffers up to the multipart threshold (then one put),
else uploads parts in a bounded pool while the caller keeps writing, and commits them in one
call; an exception aborts. What differs per backend is the client's `Upload`; every request
goes through `ObjectStorage.call` (the shared retries)."""

from __future__ import annotations

import concurrent.futures
import io
import threading
from typing import TYPE_CHECKING, Any, Protocol

from ckptlib._scrub import logger
from ckptlib.errors import StorageError

if TYPE_CHECKING:
    from ckptlib.storage.objects import ObjectStorage

log = logger(__name__)


class Upload(Protocol):
    """One multipart upload: parts in any order and concurrently, then one commit."""

    def put_part(self, number: int, data: bytes) -> Any:
        """Upload part `number` (1-based); returns what `complete` needs about it."""

    def complete(self, parts: list[Any]) -> None:
        """Make the object from the parts, in order; idempotent when retried."""

    def abort(self) -> None:
        """Forget the parts (best effort); no object appears."""


class MultipartWriter(io.RawIOBase):
    """Write-only stream: buffers up to the threshold, then uploads parts in the background."""

    def __init__(self, target: "ObjectStorage", key: str, where: str):
        super().__init__()
        self._t = target
        self._label = target.api.label
        self._key = key
        self._where = where
        self._buf = bytearray()
        self._written = 0
        self._upload: Upload | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(target.max_concurrency)
        self._futures: list[concurrent.futures.Future] = []
        self._parts: dict[int, Any] = {}
        self._parts_lock = threading.Lock()
        self._next_part = 1
        self._error: BaseException | None = None
        self._done = False
        self.parts_uploaded = 0

    # io.RawIOBase surface -------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._written

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self._where} is a {self._label} object stream: no file descriptor")

    def write(self, b) -> int:
        if self._done:
            raise ValueError(f"write to a finished {self._label} object stream ({self._where})")
        self._raise_part_error()
        mv = memoryview(b)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            target = self._t.multipart_threshold if self._upload is None else self._t.part_size_of(self._next_part)
            take = min(target - len(self._buf), n - pos)
            if take <= 0:  # a threshold below the part size with a part pending
                take = n - pos
            self._buf += mv[pos : pos + take]
            pos += take
            if len(self._buf) >= target:
                if self._upload is None:
                    self._start()
                while len(self._buf) >= self._t.part_size_of(self._next_part):
                    size = self._t.part_size_of(self._next_part)
                    with memoryview(self._buf) as view, view[:size] as piece:
                        part = bytes(piece)  # one copy; the views are released before the resize
                    del self._buf[:size]
                    self._submit(part)
        self._written += n
        return n

    # multipart machinery ----------------------------------------------------------------
    def _start(self) -> None:
        api = self._t.api
        self._upload = self._t.call("start upload", self._where, lambda: api.start_upload(self._key))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._t.max_concurrency, thread_name_prefix=f"ckptlib-{self._t.scheme}-upload"
        )

    def _submit(self, data: bytes) -> None:
        number = self._next_part
        max_parts = self._t.DEFAULTS.max_parts
        if max_parts is not None and number > max_parts:
            raise StorageError(f"{self._where}: object needs more than {max_parts} parts", path=self._where)
        self._next_part += 1
        # Backpressure: at most max_concurrency parts in flight, so memory stays bounded. Every
        # part releases its slot when it ends, failed or not, so this never waits forever.
        self._slots.acquire()
        if self._error is not None:
            self._slots.release()
            self._raise_part_error()
        assert self._pool is not None
        self._futures.append(self._pool.submit(self._upload_part, number, data))

    def _upload_part(self, number: int, data: bytes) -> None:
        try:
            if self._error is not None:
                return
            upload = self._upload
            assert upload is not None
            record = self._t.call(f"upload part {number}", self._where, lambda: upload.put_part(number, data))
            with self._parts_lock:
                self._parts[number] = record
                self.parts_uploaded += 1
        except BaseException as exc:  # noqa: BLE001 - surfaced on the writer's thread
            if self._error is None:
                self._error = exc
        finally:
            self._slots.release()

    def _raise_part_error(self) -> None:
        error = self._error
        if error is None:
            return
        if isinstance(error, StorageError):
            raise error
        raise self._t.error(error, "multipart upload", self._where) from error

    # finishing ---------------------------------------------------------------------------
    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._upload is None:
            data = bytes(self._buf)
            self._buf = bytearray()
            api = self._t.api
            try:
                self._t.call("put", self._where, lambda: api.put(self._key, data))
            finally:
                self._shutdown()
            return
        try:
            if self._buf or not self._futures:
                part = bytes(self._buf)
                self._buf = bytearray()
                self._submit(part)
            for fut in self._futures:
                fut.result()
            self._raise_part_error()
            parts = [self._parts[n] for n in sorted(self._parts)]
            upload = self._upload
            self._t.call("complete multipart upload", self._where, lambda: upload.complete(parts))
        except BaseException:
            self._abort()
            raise
        finally:
            self._shutdown()

    def abort(self) -> None:
        """Called when the caller's block raised: no object, no parts left behind."""
        if self._done:
            return
        self._done = True
        try:
            self._abort()
        finally:
            self._shutdown()

    def _abort(self) -> None:
        self._buf = bytearray()
        if self._error is None:
            self._error = StorageError(f"{self._where}: upload aborted", path=self._where)
        if self._pool is not None:
            # Let in-flight parts finish (or fail) first: no part may land after the abort (S3
            # documents that a part still being uploaded while the upload is aborted may survive it).
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload is not None:
            try:
                self._upload.abort()
            except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise
                log.warning("could not abort the upload: %s", self._t.error(exc, "abort upload", self._where))

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._buf = bytearray()
        super().close()
