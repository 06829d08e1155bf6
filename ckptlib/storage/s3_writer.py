"""S3's side of the streamed multipart writer (`multipart.MultipartWriter`) behind
`S3Storage.open_writer`: one PUT when small, else a multipart upload whose parts grow so an
object of unknown length fits S3's 10,000 parts, and a Complete that recognises its own object
when a retry finds the upload already completed."""

from __future__ import annotations

import binascii
import hashlib
import threading
from typing import TYPE_CHECKING, Any

from .multipart import MultipartWriter
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


def s3_writer(storage: "S3Storage", key: str, where: str) -> MultipartWriter:
    """The stream `S3Storage.open_writer` hands out for `key`."""
    return MultipartWriter(_S3Uploads(storage), key, where)


class _S3Uploads:
    """An `S3Storage` as `MultipartWriter`'s target: botocore retries each request itself,
    `S3Storage._call` names its failures."""

    scheme = "s3"
    stream_label = "S3 object stream"
    max_parts = MAX_PARTS

    def __init__(self, storage: "S3Storage"):
        self._s = storage
        self.multipart_threshold = storage.multipart_threshold
        self.max_concurrency = storage.max_concurrency
        self.call = storage._call
        self.error = _storage_error

    def part_size(self, number: int) -> int:
        # Grow the part size every 1,000 parts so a stream of unknown length never needs more
        # than 10,000 parts: 16 MiB parts cover 16 GiB, then 32 MiB parts, and so on.
        grow = (number - 1) // 1000
        return min(self._s.part_size << grow, MAX_PART_SIZE)

    def put(self, key: str, where: str, data: bytes) -> None:
        s = self._s
        s._call("put", where, s.client.put_object, Bucket=s.bucket, Key=key, Body=data)

    def start_upload(self, key: str, where: str) -> "_S3Upload":
        s = self._s
        extra: dict[str, Any] = {}
        # Mirror s3transfer: when botocore computes checksums by default, declare the part
        # checksum algorithm on the upload so CompleteMultipartUpload accepts the part checksums.
        if getattr(s.client.meta.config, "request_checksum_calculation", None) == "when_supported":
            extra["ChecksumAlgorithm"] = "CRC32"
        response = s._call(
            "create multipart upload", where, s.client.create_multipart_upload, Bucket=s.bucket, Key=key, **extra
        )
        return _S3Upload(s, key, where, response["UploadId"])


class _S3Upload:
    """One S3 multipart upload (see `multipart.Upload`)."""

    def __init__(self, storage: "S3Storage", key: str, where: str, upload_id: str):
        self._s = storage
        self._key = key
        self._where = where
        self._upload_id = upload_id
        self._sizes: dict[int, int] = {}
        self._sizes_lock = threading.Lock()

    def put_part(self, number: int, data: bytes) -> dict[str, Any]:
        s = self._s
        response = s.client.upload_part(
            Bucket=s.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=data
        )
        with self._sizes_lock:
            self._sizes[number] = len(data)
        record = {"PartNumber": number, "ETag": response["ETag"]}
        record.update({k: v for k, v in response.items() if k.startswith("Checksum") and k != "ChecksumType"})
        return record

    def complete(self, parts: list[dict[str, Any]]) -> None:
        s = self._s
        bex = _botocore_errors()
        try:
            s.client.complete_multipart_upload(
                Bucket=s.bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
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
        size = sum(self._sizes.values())
        return head.get("ETag") == _multipart_etag([p["ETag"] for p in parts]) and head.get("ContentLength") == size

    def abort(self) -> None:
        """Best effort, never raises: an upload already gone is fine, anything else is logged."""
        s = self._s
        try:
            s.client.abort_multipart_upload(Bucket=s.bucket, Key=self._key, UploadId=self._upload_id)
        except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise
            if _error_code(exc) != "NoSuchUpload":
                log.warning("%s: could not abort multipart upload: %s", self._where, _scrub(str(exc)))


__all__ = ["s3_writer"]
