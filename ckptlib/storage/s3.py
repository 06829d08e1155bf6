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

import concurrent.futures
import contextlib
import os
import random
import time
from typing import Any, Callable, Iterable, Iterator

from ..errors import StorageError
from .base import DELETE_FIRST, check_relative
from .s3_client import (  # noqa: F401  (constants and client factories: part of this module's API)
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_PART_SIZE,
    DEFAULT_READ_CHUNK_SIZE,
    DEFAULT_READ_RETRIES,
    DELETE_BATCH,
    MAX_PART_SIZE,
    MAX_PUT_SIZE,
    MIN_PART_SIZE,
    _NOT_FOUND_CODES,
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
from .multipart import MultipartWriter
from .s3_writer import s3_writer


class S3Storage:
    """Objects below `s3://bucket/prefix`. Paths are relative and '/'-separated."""

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
        return cls(bucket, prefix, client, **{**_env_options(), **options})

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

    # -- keys ----------------------------------------------------------------------------
    def _key(self, path: str) -> str:
        check_relative(path, self.uri)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _dir(self) -> str:
        """The key prefix of everything below the root (with the '/': step_1 must not match step_10)."""
        return f"{self.prefix}/" if self.prefix else ""

    def _where(self, path: str = "") -> str:
        return f"{self.uri}/{path}" if path else self.uri

    def _call(self, op: str, where: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        bex = _botocore_errors()
        try:
            return fn(**kwargs)
        except (bex.ClientError, bex.BotoCoreError) as exc:
            raise _storage_error(exc, op, where) from exc

    # -- Storage protocol ----------------------------------------------------------------
    def child(self, name: str) -> "S3Storage":
        return S3Storage(self.bucket, self._key(name), self._client, **self._options())

    def local_path(self, path: str = "") -> None:
        if path:
            check_relative(path, self.uri)
        return None

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
        raise StorageError(f"S3 conditional put failed for {where}: kept conflicting with concurrent writers", path=where)

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

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) by ranged GET; a range over 2 * read_chunk_size is
        fetched as parallel chunk GETs into one buffer and returned as a bytearray (no second
        copy). FileNotFoundError: no such key; EOFError: the object is shorter."""
        key = self._key(path)
        where = self._where(path)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"{where}: negative offset or length ({offset}, {length})")
        if length == 0:
            self._head(key, where)  # FileNotFoundError like a local open()
            return b""
        if length is None:
            data, _total = self._get(key, where, offset, None)
            return data if data is not None else b""
        if length > 2 * self.read_chunk_size and self.max_concurrency > 1:
            return self._parallel_read(key, where, offset, length)
        data, total = self._get(key, where, offset, offset + length - 1)
        if data is None or len(data) != length:
            got = 0 if data is None else len(data)
            raise EOFError(
                f"{where}: wanted {length} bytes at offset {offset}, "
                f"object holds {total if total is not None else offset + got}"
            )
        return data

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
                        where, type(exc).__name__, delay, attempt, self.read_retries,
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

    def _parallel_read(self, key: str, where: str, offset: int, length: int) -> bytearray:
        """Split a large range into read_chunk_size ranged GETs run by a bounded pool."""
        out = bytearray(length)
        chunk = self.read_chunk_size
        spans = [(a, min(chunk, length - a)) for a in range(0, length, chunk)]
        short: list[int | None] = []

        def fetch(rel: int, n: int) -> None:
            data, total = self._get(key, where, offset + rel, offset + rel + n - 1)
            if data is None or len(data) != n:
                short.append(total)
                return
            out[rel : rel + n] = data

        workers = min(self.max_concurrency, len(spans))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckptlib-s3-read") as pool:
            futures = [pool.submit(fetch, a, n) for a, n in spans]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
        if short:
            sizes = [s for s in short if s is not None]
            held = min(sizes) if sizes else "fewer bytes"
            raise EOFError(f"{where}: wanted {length} bytes at offset {offset}, object holds {held}")
        return out

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

    def list(self, prefix: str = "") -> dict[str, int]:
        if prefix:
            _check_list_prefix(prefix, self.uri)
        base = self._dir()
        out: dict[str, int] = {}
        for key, size in self._list_keys(base + prefix).items():
            rel = key[len(base) :]
            if rel and not rel.endswith("/"):  # skip console-made "directory" marker objects
                out[rel] = size
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
            self._call("delete", self._where(paths[0]), self.client.delete_object, Bucket=self.bucket,
                       Key=self._key(paths[0]))
            return
        self._delete_keys([self._key(p) for p in paths])

    def _delete_keys(self, keys: list[str]) -> None:
        failures: list[str] = []
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            response = self._call(
                "delete", self.uri, self.client.delete_objects,
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            for err in response.get("Errors") or ():
                if err.get("Code") in ("NoSuchKey",):
                    continue
                failures.append(f"{err.get('Key')}: {err.get('Code')} {err.get('Message') or ''}".strip())
        if failures:
            shown = "; ".join(failures[:5]) + (f" ... ({len(failures)} in all)" if len(failures) > 5 else "")
            raise StorageError(_scrub(f"S3 delete failed for {len(failures)} object(s) under {self.uri}: {shown}"), path=self.uri)

    def delete_tree(self, name: str = "") -> None:
        target = self.child(name) if name else self
        base = target._dir()
        keys = list(self._list_keys(base))
        # Delete what makes a directory look committed first, so a crash or failure half-way
        # leaves an incomplete-looking directory, never a committed one with files missing
        # (LocalStorage renames the directory away first for the same reason).
        def rank(key: str) -> int:
            leaf = key.rsplit("/", 1)[-1]
            return DELETE_FIRST.index(leaf) if leaf in DELETE_FIRST else len(DELETE_FIRST)

        for phase in range(len(DELETE_FIRST) + 1):
            batch = [k for k in keys if rank(k) == phase]
            if batch:
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
            "put pointer", self._where(name), self.client.put_object,
            Bucket=self.bucket, Key=key, Body=target.encode("utf-8"), ContentType="text/plain; charset=utf-8",
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


def _env_options() -> dict[str, int]:
    out = {}
    for option in ("multipart_threshold", "part_size", "max_concurrency", "read_chunk_size"):
        raw = os.environ.get(f"CKPTLIB_S3_{option.upper()}")
        if raw:
            try:
                out[option] = int(raw)
            except ValueError:
                raise StorageError(f"CKPTLIB_S3_{option.upper()}={raw!r} is not an integer") from None
    return out


def _total_size(content_range: str | None) -> int | None:
    """The object size from a `Content-Range: bytes a-b/size` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def _check_list_prefix(prefix: str, root_uri: str) -> None:
    """A list prefix may end mid-name ('__0', 'step_') or with '/', but never climbs out."""
    if prefix.startswith("/") or "\\" in prefix:
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)
    parts = prefix.split("/")
    if any(p in (".", "..") for p in parts) or any(p == "" for p in parts[:-1]):
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)


__all__ = ["S3Storage", "make_client", "default_client", "parse_uri", "validate_bucket"]
