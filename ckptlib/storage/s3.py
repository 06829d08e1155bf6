"""S3 storage: objects under `s3://bucket/prefix`, streamed with multipart uploads, read with ranged GETs.

Semantics mirror `LocalStorage`:

* `write` is one PUT, atomic on S3 (readers see the old object or the new one).
* `open_writer` streams straight to S3: nothing before the multipart threshold is sent,
  small objects go as one PUT on a clean exit, large ones as a multipart upload whose parts
  are sent by a bounded thread pool while the caller keeps writing (memory stays below
  about `(max_concurrency + 2) * part_size`). An exception inside the context aborts the
  upload: no object and no pending multipart upload is left behind.
* `read` is a ranged GET (`Range: bytes=a-b`), split into parallel ranged GETs for large
  ranges; `FileNotFoundError` for a missing key and `EOFError` for a short object, like a
  local file.
* The `latest` pointer is a small text object holding the target's name.

Failures botocore retries itself (500/503 SlowDown, throttling, connection resets,
timeouts) are retried with backoff by a botocore `Config` (mode "standard", 8 attempts,
unless the user configured retries through AWS_RETRY_MODE / AWS_MAX_ATTEMPTS or a profile).
A response body that breaks off while it is being read is outside botocore's retry loop;
`read` retries that itself. Everything permanent (AccessDenied, NoSuchBucket, invalid keys,
retries exhausted) becomes a `StorageError` naming the s3:// URI and the operation, never
the credentials.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Callable, Iterable, Iterator

from ..errors import StorageError
from .base import check_relative
from .multipart import MultipartWriter
from .prefixed import PrefixedObjects, deletion_phases, env_options
from .s3_client import (  # noqa: F401  (constants and client factories: part of this module's API)
    _NOT_FOUND_CODES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_PART_SIZE,
    DEFAULT_READ_CHUNK_SIZE,
    DEFAULT_READ_RETRIES,
    DELETE_BATCH,
    MAX_PART_SIZE,
    MAX_PUT_SIZE,
    MIN_PART_SIZE,
    _botocore_errors,
    _error_code,
    _error_status,
    _retryable_stream_error,
    _scrub,
    _storage_error,
    default_client,
    log,
    make_client,
    parse_uri,
    validate_bucket,
)
from .s3_writer import s3_writer

# The transfer sizes CKPTLIB_S3_<OPTION> may set (retries are botocore's: AWS_MAX_ATTEMPTS).
_ENV_OPTIONS = ("multipart_threshold", "part_size", "max_concurrency", "read_chunk_size")


class S3Storage(PrefixedObjects):
    """Objects below `s3://bucket/prefix`. Paths are relative and '/'-separated. Keys, reads
    and listing are `PrefixedObjects`' (shared with GCS and Azure) over `_get`, `_head` and
    `_list_keys` here."""

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: Any = None,
        *,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        read_chunk_size: int = DEFAULT_READ_CHUNK_SIZE,
        read_retries: int = DEFAULT_READ_RETRIES,
    ):
        self.bucket = validate_bucket(bucket)
        prefix = (prefix or "").strip("/")
        base_uri = f"s3://{bucket}"
        if prefix:
            check_relative(prefix, base_uri)
        self.prefix = prefix
        self.uri = f"{base_uri}/{prefix}" if prefix else base_uri
        if part_size < MIN_PART_SIZE or part_size > MAX_PART_SIZE:
            raise ValueError(f"part_size must be within [{MIN_PART_SIZE}, {MAX_PART_SIZE}] bytes, got {part_size}")
        if multipart_threshold < 1 or multipart_threshold > MAX_PUT_SIZE:
            raise ValueError(f"multipart_threshold must be within [1, {MAX_PUT_SIZE}], got {multipart_threshold}")
        if max_concurrency < 1 or read_chunk_size < 1 or read_retries < 0:
            raise ValueError("max_concurrency and read_chunk_size must be >= 1, read_retries >= 0")
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.read_chunk_size = read_chunk_size
        self.read_retries = read_retries
        self._client = client  # None: the process's shared default client, made on first use

    @classmethod
    def from_uri(cls, uri: str, client: Any = None, **options: Any) -> "S3Storage":
        """`s3://bucket/prefix`; transfer sizes may also come from CKPTLIB_S3_MULTIPART_THRESHOLD,
        CKPTLIB_S3_PART_SIZE, CKPTLIB_S3_MAX_CONCURRENCY and CKPTLIB_S3_READ_CHUNK_SIZE (bytes,
        counts); explicit keyword arguments win."""
        bucket, prefix = parse_uri(uri)
        return cls(bucket, prefix, client, **{**env_options("s3", _ENV_OPTIONS), **options})

    def _options(self) -> dict[str, Any]:
        return {
            "multipart_threshold": self.multipart_threshold,
            "part_size": self.part_size,
            "max_concurrency": self.max_concurrency,
            "read_chunk_size": self.read_chunk_size,
            "read_retries": self.read_retries,
        }

    @property
    def client(self):
        if self._client is None:
            self._client = default_client()
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        # Clients do not pickle; the copy uses the default client of the process it lands in.
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r})"

    # -- requests ------------------------------------------------------------------------
    def _call(self, op: str, where: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        bex = _botocore_errors()
        try:
            return fn(**kwargs)
        except (bex.ClientError, bex.BotoCoreError) as exc:
            raise _storage_error(exc, op, where) from exc

    # -- Storage protocol ----------------------------------------------------------------
    def child(self, name: str) -> "S3Storage":
        return S3Storage(self.bucket, self._key(name), self._client, **self._options())

    def exists(self) -> bool:
        response = self._call(
            "list", self.uri, self.client.list_objects_v2, Bucket=self.bucket, Prefix=self._dir(), MaxKeys=1
        )
        return bool(response.get("KeyCount") or response.get("Contents"))

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        key = self._key(path)
        where = self._where(path)
        if len(data) > MAX_PUT_SIZE:  # beyond a single PUT: a multipart upload is atomic too
            with self.open_writer(path) as stream:
                stream.write(data)
            return
        self._call("put", where, self.client.put_object, Bucket=self.bucket, Key=key, Body=bytes(data))

    def sync(self, paths: Iterable[str], names_only: Iterable[str] = ()) -> None:
        """Nothing to do: a completed PUT or multipart upload is durable."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """PUT `data` only if no object is at `path` (`If-None-Match: *`); True if this call
        created it (see base.SupportsCreateExclusive)."""
        key = self._key(path)
        where = self._where(path)
        body = bytes(data)
        bex = _botocore_errors()
        for attempt in range(6):
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
                return True
            except bex.ClientError as exc:
                code, status = _error_code(exc), _error_status(exc)
                if code == "PreconditionFailed" or status == 412:
                    # Taken, perhaps by this very call: a first attempt whose response was lost
                    # and that botocore retried. The caller's data is unique (a lock token), so
                    # equal bytes mean the object is ours.
                    try:
                        data_now, _ = self._get(key, where, 0, None)
                    except FileNotFoundError:
                        continue  # deleted meanwhile: try again
                    return data_now == body
                if code == "ConditionalRequestConflict" or status == 409:
                    # A concurrent conditional write to the same key is in flight: S3 asks to retry.
                    time.sleep(min(2.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0))
                    continue
                raise _storage_error(exc, "conditional put", where) from exc
            except bex.BotoCoreError as exc:
                raise _storage_error(exc, "conditional put", where) from exc
        raise StorageError(
            f"S3 conditional put failed for {where}: kept conflicting with concurrent writers", path=where
        )

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[MultipartWriter]:
        key = self._key(path)
        writer = s3_writer(self, key, self._where(path))
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.finish()

    def _head(self, key: str, where: str) -> dict[str, Any]:
        bex = _botocore_errors()
        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)
        except bex.ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                raise FileNotFoundError(f"{where}: no such object") from exc
            raise _storage_error(exc, "head", where) from exc
        except bex.BotoCoreError as exc:
            raise _storage_error(exc, "head", where) from exc

    def _get(self, key: str, where: str, start: int, end: int | None) -> tuple[bytes | None, int | None]:
        """GET bytes [start, end] (end inclusive, None: to the end). Returns (data, object size);
        data is None when `start` lies at or past the end of the object."""
        bex = _botocore_errors()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-" + ("" if end is None else str(end))
        attempt = 0
        while True:
            try:
                response = self.client.get_object(**kwargs)
            except bex.ClientError as exc:
                code = _error_code(exc)
                if code in _NOT_FOUND_CODES:
                    raise FileNotFoundError(f"{where}: no such object") from exc
                if code == "InvalidRange" or _error_status(exc) == 416:
                    size = (exc.response.get("Error") or {}).get("ActualObjectSize")
                    return None, int(size) if size is not None and str(size).isdigit() else None
                raise _storage_error(exc, "get", where) from exc
            except bex.BotoCoreError as exc:
                raise _storage_error(exc, "get", where) from exc
            try:
                data = response["Body"].read()
            except Exception as exc:  # noqa: BLE001 - classified below
                if attempt < self.read_retries and _retryable_stream_error(exc):
                    attempt += 1
                    delay = min(8.0, 0.2 * 2**attempt) * random.uniform(0.5, 1.0)
                    log.warning(
                        "%s: response body broke off (%s); retrying GET in %.1fs (%d/%d)",
                        where,
                        type(exc).__name__,
                        delay,
                        attempt,
                        self.read_retries,
                    )
                    time.sleep(delay)
                    continue
                raise _storage_error(exc, "get (reading the body)", where) from exc
            finally:
                with contextlib.suppress(Exception):
                    response["Body"].close()
            total = _total_size(response.get("ContentRange"))
            if total is None and "Range" not in kwargs:
                total = response.get("ContentLength")
            return data, total

    def _paginate(self, op: str, where: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        bex = _botocore_errors()
        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)
        except (bex.ClientError, bex.BotoCoreError) as exc:
            raise _storage_error(exc, op, where) from exc

    def _list_keys(self, key_prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for page in self._paginate("list", self.uri, Prefix=key_prefix):
            for obj in page.get("Contents") or ():
                out[obj["Key"]] = int(obj.get("Size") or 0)
        return out

    def list_children(self) -> list[str]:
        base = self._dir()
        names = set()
        for page in self._paginate("list", self.uri, Prefix=base, Delimiter="/"):
            for common in page.get("CommonPrefixes") or ():
                name = common["Prefix"][len(base) :].rstrip("/")
                if name and name not in (".", ".."):
                    names.add(name)
        return sorted(names)

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(dict.fromkeys(paths))
        if len(paths) == 1:  # one object (a commit's pending marker): a plain DELETE, cheaper than a batch
            self._call(
                "delete", self._where(paths[0]), self.client.delete_object, Bucket=self.bucket, Key=self._key(paths[0])
            )
            return
        self._delete_keys([self._key(p) for p in paths])

    def _delete_keys(self, keys: list[str]) -> None:
        failures: list[str] = []
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            response = self._call(
                "delete",
                self.uri,
                self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            for err in response.get("Errors") or ():
                if err.get("Code") in ("NoSuchKey",):
                    continue
                failures.append(f"{err.get('Key')}: {err.get('Code')} {err.get('Message') or ''}".strip())
        if failures:
            shown = "; ".join(failures[:5]) + (f" ... ({len(failures)} in all)" if len(failures) > 5 else "")
            raise StorageError(
                _scrub(f"S3 delete failed for {len(failures)} object(s) under {self.uri}: {shown}"), path=self.uri
            )

    def delete_tree(self, name: str = "") -> None:
        target = self.child(name) if name else self
        base = target._dir()
        # Committed-looking objects first (LocalStorage renames the directory away first instead).
        for batch in deletion_phases(list(self._list_keys(base))):
            target._delete_keys(batch)
        target._abort_uploads(base)

    def _abort_uploads(self, key_prefix: str) -> None:
        """Abort multipart uploads left under the prefix by a crashed writer (best effort)."""
        bex = _botocore_errors()
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=key_prefix
            ):
                for upload in page.get("Uploads") or ():
                    with contextlib.suppress(bex.ClientError):
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
        except (bex.ClientError, bex.BotoCoreError) as exc:
            log.debug("%s: cannot list pending multipart uploads: %s", self.uri, _scrub(str(exc)))

    def set_pointer(self, name: str, target: str) -> None:
        key = self._key(name)
        check_relative(target, self.uri)
        self._call(
            "put pointer",
            self._where(name),
            self.client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=target.encode("utf-8"),
            ContentType="text/plain; charset=utf-8",
        )

    def read_pointer(self, name: str) -> str | None:
        key = self._key(name)
        where = self._where(name)
        try:
            data, _ = self._get(key, where, 0, None)
        except FileNotFoundError:
            return None
        try:
            text = (data or b"").decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise StorageError(f"{where}: pointer object is not UTF-8 text", path=where) from exc
        return text.rstrip("/")


def _total_size(content_range: str | None) -> int | None:
    """The object size from a `Content-Range: bytes a-b/size` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


__all__ = ["S3Storage", "make_client", "default_client", "parse_uri", "validate_bucket"]
