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

import binascii
import concurrent.futures
import contextlib
import hashlib
import io
import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from ..errors import StorageError
from .base import check_relative

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# S3's limits: parts are 5 MiB..5 GiB (the last may be smaller), at most 10,000 parts per
# upload, at most 5 GiB per single PUT, at most 1,000 keys per DeleteObjects request.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_PUT_SIZE = 5 * GiB
DELETE_BATCH = 1000

DEFAULT_MULTIPART_THRESHOLD = 16 * MiB
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_READ_CHUNK_SIZE = 32 * MiB
DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_READ_RETRIES = 4

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
# Anything that looks like an AWS access key id; scrubbed from every message we build.
_ACCESS_KEY_RE = re.compile(r"\b(AKIA|ASIA|AIDA|AROA)[A-Z0-9]{12,}\b")

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_HINTS = {
    "AccessDenied": "the credentials lack permission for this operation",
    "403": "the credentials lack permission for this operation",
    "Forbidden": "the credentials lack permission for this operation",
    "AllAccessDisabled": "access to this bucket has been disabled",
    "NoSuchBucket": "the bucket does not exist",
    "InvalidAccessKeyId": "the access key id is not valid",
    "SignatureDoesNotMatch": "the secret key does not match the access key id",
    "ExpiredToken": "the session credentials have expired",
    "InvalidToken": "the session token is not valid",
    "TokenRefreshRequired": "the session credentials have expired",
}


def _scrub(text: str) -> str:
    return _ACCESS_KEY_RE.sub("<redacted>", text)


def validate_bucket(bucket: str) -> str:
    """Check an S3 bucket name against the naming rules (3-63 chars, lowercase, no '..')."""
    if (
        not isinstance(bucket, str)
        or not _BUCKET_RE.match(bucket)
        or ".." in bucket
        or ".-" in bucket
        or "-." in bucket
        or _IPV4_RE.match(bucket)
    ):
        raise StorageError(
            f"invalid S3 bucket name {bucket!r}: 3-63 characters of lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit",
            path=f"s3://{bucket}",
        )
    return bucket


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` -> ("bucket", "some/prefix"); the prefix may be empty."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise StorageError(f"not an s3:// URI: {uri!r}", path=str(uri))
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    validate_bucket(bucket)
    prefix = prefix.strip("/")
    if prefix:
        check_relative(prefix, uri)
    return bucket, prefix


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------

_CLIENT_CACHE: dict[tuple, Any] = {}
_CLIENT_LOCK = threading.Lock()
_LOADER: tuple[int, Any] | None = None
_LOADER_LOCK = threading.Lock()  # not _CLIENT_LOCK: default_client() holds that one while it calls make_client()
# The environment that decides which endpoint, account and retry policy a default client uses.
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_RETRY_MODE",
    "AWS_MAX_ATTEMPTS",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


def make_client(*, max_attempts: int | None = None, max_pool_connections: int = 32, **config_kwargs: Any):
    """A fresh boto3 S3 client from the standard AWS sources (env vars incl. AWS_ENDPOINT_URL,
    config files, profiles, instance roles) with retries and timeouts suited to checkpoints.

    Retries: mode "standard" and `max_attempts` (default 8) unless the user configured them
    (AWS_RETRY_MODE / AWS_MAX_ATTEMPTS / the profile), which then win.
    """
    try:
        import boto3
        import botocore.session
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise StorageError("s3:// checkpoints need boto3: pip install 'ckptlib[s3]'") from exc

    session = botocore.session.get_session()
    # A fresh session per client (credentials and config are resolved now, from the current
    # environment), sharing one loader so the service model is parsed once per process.
    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None or _LOADER[0] != os.getpid():
            _LOADER = (os.getpid(), session.get_component("data_loader"))
        else:
            session.register_component("data_loader", _LOADER[1])
    user_mode = session.get_config_variable("retry_mode")
    user_attempts = session.get_config_variable("max_attempts")
    # total_max_attempts counts the first try (Config's "max_attempts" would count retries
    # only, while AWS_MAX_ATTEMPTS / the profile's max_attempts count the first try too).
    retries = {
        "mode": user_mode or "standard",
        "total_max_attempts": int(max_attempts or user_attempts or DEFAULT_MAX_ATTEMPTS),
    }
    options: dict[str, Any] = {
        "retries": retries,
        "connect_timeout": 10,
        "read_timeout": 120,
        "max_pool_connections": max_pool_connections,
        "tcp_keepalive": True,
        "user_agent_extra": "ckptlib",
    }
    options.update(config_kwargs)
    return boto3.session.Session(botocore_session=session).client("s3", config=Config(**options))


def default_client():
    """The process's shared client for the current AWS environment (clients are thread-safe,
    not fork-safe: the cache is per process)."""
    fingerprint = hashlib.sha256("\0".join(os.environ.get(k, "") for k in _CLIENT_ENV).encode()).hexdigest()
    key = (os.getpid(), fingerprint)
    with _CLIENT_LOCK:
        client = _CLIENT_CACHE.get(key)
        if client is None:
            for stale in [k for k in _CLIENT_CACHE if k[0] != os.getpid()]:
                del _CLIENT_CACHE[stale]
            client = _CLIENT_CACHE[key] = make_client()
        return client


def _botocore_errors():
    from botocore import exceptions as bex

    return bex


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str((response.get("Error") or {}).get("Code") or "")


def _error_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None) or {}
    return (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def _storage_error(exc: BaseException, op: str, where: str) -> StorageError:
    """A StorageError that names the operation and the s3:// URI; never the credentials."""
    bex = _botocore_errors()
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, bex.ClientError):
        code = _error_code(exc) or "unknown"
        status = _error_status(exc)
        response = exc.response or {}
        message = str((response.get("Error") or {}).get("Message") or "").strip()
        attempts = (response.get("ResponseMetadata") or {}).get("RetryAttempts") or 0
        hint = _HINTS.get(code)
        text = f"S3 {op} failed for {where}: {code}" + (f" (HTTP {status})" if status else "")
        if message and message != code:
            text += f": {message}"
        if hint:
            text += f" - {hint}"
        if attempts:
            text += f" (gave up after {attempts + 1} attempts)"
        return StorageError(_scrub(text), path=where)
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return StorageError(
            f"S3 {op} failed for {where}: no usable AWS credentials found (set AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role)",
            path=where,
        )
    if isinstance(exc, bex.BotoCoreError):
        return StorageError(_scrub(f"S3 {op} failed for {where}: {type(exc).__name__}: {exc}"), path=where)
    return StorageError(_scrub(f"S3 {op} failed for {where}: {type(exc).__name__}: {exc}"), path=where)


def _retryable_stream_error(exc: BaseException) -> bool:
    """Errors while reading a response body: botocore's retry loop has already returned."""
    bex = _botocore_errors()
    transient = (
        bex.IncompleteReadError,
        bex.ResponseStreamingError,
        bex.ReadTimeoutError,
        bex.ConnectionClosedError,
        bex.EndpointConnectionError,
        ConnectionError,
        TimeoutError,
    )
    try:
        from urllib3.exceptions import ProtocolError, ReadTimeoutError as U3ReadTimeout

        transient = transient + (ProtocolError, U3ReadTimeout)
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, transient)


def _multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, '-', part count."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(binascii.unhexlify(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


# --------------------------------------------------------------------------------------
# The streaming writer
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# The storage
# --------------------------------------------------------------------------------------


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
    def open_writer(self, path: str) -> Iterator[_S3Writer]:
        key = self._key(path)
        writer = _S3Writer(self, key, self._where(path))
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
        from ..format.manifest import MANIFEST_NAME, METADATA_NAME

        def rank(key: str) -> int:
            leaf = key.rsplit("/", 1)[-1]
            return 0 if leaf == MANIFEST_NAME else 1 if leaf == METADATA_NAME else 2

        for phase in (0, 1, 2):
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
