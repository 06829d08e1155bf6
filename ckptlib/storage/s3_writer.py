"""The streaming multipart writer behind `S3Storage.open_writer`: buffers up to the threshold,
then uploads parts from a bounded thread pool while the caller keeps writing; a clean exit
completes the upload (one PUT when small), an exception aborts it."""

from __future__ import annotations

import binascii
import concurrent.futures
import hashlib
import io
import threading
from typing import TYPE_CHECKING, Any

from ..errors import StorageError

from .s3_client import (
    MAX_PART_SIZE,
    MAX_PARTS,
    _botocore_errors,
    _error_code,
    _scrub,
    _storage_error,
    log,
)

if TYPE_CHECKING:
    from .s3 import S3Storage


def _multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, '-', part count."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(binascii.unhexlify(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


class _S3Writer(io.RawIOBase):
    """Write-only stream: buffers up to the threshold, then uploads parts in the background."""

    def __init__(self, storage: "S3Storage", key: str, where: str):
        super().__init__()
        self._s = storage
        self._key = key
        self._where = where
        self._buf = bytearray()
        self._written = 0
        self._upload_id: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(storage.max_concurrency)
        self._futures: list[concurrent.futures.Future] = []
        self._parts: dict[int, dict[str, Any]] = {}
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
        raise io.UnsupportedOperation(f"{self._where} is an S3 object stream: no file descriptor")

    def write(self, b) -> int:
        if self._done:
            raise ValueError(f"write to a finished S3 stream ({self._where})")
        self._raise_part_error()
        mv = memoryview(b)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            target = self._s.multipart_threshold if self._upload_id is None else self._part_size()
            take = min(target - len(self._buf), n - pos)  # > 0: the buffer is always below target
            self._buf += mv[pos : pos + take]
            pos += take
            if len(self._buf) >= target:
                if self._upload_id is None:
                    self._start()
                while len(self._buf) >= self._part_size():
                    size = self._part_size()
                    with memoryview(self._buf) as view, view[:size] as piece:
                        part = bytes(piece)  # one copy; the views are released before the resize
                    del self._buf[:size]
                    self._submit(part)
        self._written += n
        return n

    # multipart machinery ----------------------------------------------------------------
    def _part_size(self) -> int:
        # Grow the part size every 1,000 parts so a stream of unknown length never needs more
        # than 10,000 parts: 16 MiB parts cover 16 GiB, then 32 MiB parts, and so on.
        grow = (self._next_part - 1) // 1000
        return min(self._s.part_size << grow, MAX_PART_SIZE)

    def _start(self) -> None:
        extra: dict[str, Any] = {}
        # Mirror s3transfer: when botocore computes checksums by default, declare the part
        # checksum algorithm on the upload so CompleteMultipartUpload accepts the part checksums.
        if getattr(self._s.client.meta.config, "request_checksum_calculation", None) == "when_supported":
            extra["ChecksumAlgorithm"] = "CRC32"
        response = self._s._call(
            "create multipart upload", self._where, self._s.client.create_multipart_upload,
            Bucket=self._s.bucket, Key=self._key, **extra,
        )
        self._upload_id = response["UploadId"]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._s.max_concurrency, thread_name_prefix="ckptlib-s3-upload"
        )

    def _submit(self, data: bytes) -> None:
        number = self._next_part
        if number > MAX_PARTS:
            raise StorageError(f"{self._where}: object needs more than {MAX_PARTS} parts", path=self._where)
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
            response = self._s._call(
                f"upload part {number}", self._where, self._s.client.upload_part,
                Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=data,
            )
            record = {"PartNumber": number, "ETag": response["ETag"]}
            record.update({k: v for k, v in response.items() if k.startswith("Checksum") and k != "ChecksumType"})
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
        raise _storage_error(error, "multipart upload", self._where) from error

    def _wait(self) -> None:
        for fut in self._futures:
            fut.result()
        self._raise_part_error()

    # finishing ---------------------------------------------------------------------------
    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._upload_id is None:
            data = bytes(self._buf)
            self._buf = bytearray()
            try:
                self._s._call(
                    "put", self._where, self._s.client.put_object, Bucket=self._s.bucket, Key=self._key, Body=data
                )
            finally:
                self._shutdown()
            return
        try:
            if self._buf or not self._futures:
                part = bytes(self._buf)
                self._buf = bytearray()
                self._submit(part)
            self._wait()
            self._complete()
        except BaseException:
            self._abort()
            raise
        finally:
            self._shutdown()

    def _complete(self) -> None:
        parts = [self._parts[n] for n in sorted(self._parts)]
        bex = _botocore_errors()
        try:
            self._s.client.complete_multipart_upload(
                Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )
        except bex.ClientError as exc:
            # A retried Complete whose first attempt succeeded (response lost) answers NoSuchUpload:
            # the object is there if its ETag is the one this upload produces.
            if _error_code(exc) == "NoSuchUpload" and self._completed_anyway(parts):
                log.info("%s: multipart upload had completed before a retry; keeping it", self._where)
                return
            raise _storage_error(exc, "complete multipart upload", self._where) from exc
        except Exception as exc:
            raise _storage_error(exc, "complete multipart upload", self._where) from exc

    def _completed_anyway(self, parts: list[dict[str, Any]]) -> bool:
        try:
            head = self._s.client.head_object(Bucket=self._s.bucket, Key=self._key)
        except Exception:  # noqa: BLE001 - the NoSuchUpload error is the one to report
            return False
        return head.get("ETag") == _multipart_etag([p["ETag"] for p in parts]) and head.get("ContentLength") == self._written

    def abort(self) -> None:
        """Called when the caller's block raised: no object, no pending upload."""
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
            # Let in-flight parts finish (or fail) first: S3 documents that a part still being
            # uploaded while the upload is aborted may survive the abort.
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            try:
                self._s.client.abort_multipart_upload(Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id)
            except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise
                if _error_code(exc) != "NoSuchUpload":
                    log.warning("%s: could not abort multipart upload: %s", self._where, _scrub(str(exc)))

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._buf = bytearray()
        super().close()
