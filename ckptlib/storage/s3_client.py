"""S3 as an `objects.ObjectClient` over boto3: the requests `S3Storage` (s3.py) makes, how
botocore's errors are classified and described, the multipart upload, and the process's
shared boto3 client, made with botocore's own retries off (`ObjectStorage.call` retries)."""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import os
import threading
from typing import Any, Iterable
from urllib.parse import urlsplit

from ckptlib._scrub import guard_loggers, logger, scrub
from ckptlib.errors import StorageError
from ckptlib.storage.objects import Exists, IntoView

log = logger(__name__)

# The loggers whose records are scrubbed once a client exists (botocore logs request URLs,
# signed headers and signatures at DEBUG).
_SDK_PACKAGES = ("botocore", "boto3", "s3transfer", "urllib3")

#: At most this many keys per DeleteObjects request (S3's limit).
DELETE_BATCH = 1000

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# What botocore's "standard" retry mode retried when it did the retrying: throttling and
# transient codes, and these statuses (409: a concurrent conditional write, "try again").
_TRANSIENT_CODES = frozenset(
    {
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "TransactionInProgressException",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_TRANSIENT_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
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
    "ConditionalRequestConflict": "concurrent conditional writes to this key kept conflicting",
}


def _botocore_errors():
    from botocore import exceptions as bex

    return bex


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str((response.get("Error") or {}).get("Code") or "")


def _error_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None) or {}
    return (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def _transient_transport_error(exc: BaseException) -> bool:
    """A connection that failed, timed out or broke off mid-body (botocore raises the latter
    after its own call returned, while the body is read)."""
    bex = _botocore_errors()
    transient: tuple[type, ...] = (
        bex.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, ...
        bex.HTTPClientError,
        bex.IncompleteReadError,
        bex.ResponseStreamingError,
        bex.FlexibleChecksumError,  # a body that arrived damaged: fetch it again
        ConnectionError,
        TimeoutError,
    )
    try:
        from urllib3.exceptions import ProtocolError
        from urllib3.exceptions import ReadTimeoutError as U3ReadTimeout

        transient = transient + (ProtocolError, U3ReadTimeout)
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, transient)


def _total_size(content_range: str | None) -> int | None:
    """The object size from a `Content-Range: bytes a-b/size` header (None for `a-b/*`)."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def _multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, '-', part count."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(binascii.unhexlify(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


class S3Client:
    """objects.ObjectClient over one bucket."""

    scheme = "s3"
    label = "S3"
    delete_batch = DELETE_BATCH
    writes_into = False  # botocore reads a body into bytes however it is asked: copying it costs a pass

    def __init__(self, sdk: Any, bucket: str):
        self.sdk = sdk
        self.bucket = bucket
        guard_loggers(_SDK_PACKAGES)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, content_type: str | None = None) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": data}
        if content_type:
            kwargs["ContentType"] = content_type
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            self.sdk.put_object(**kwargs)
        except _botocore_errors().ClientError as exc:
            # 412 (PreconditionFailed, or bare from a proxy): the key is taken.
            if if_absent and (_error_code(exc) == "PreconditionFailed" or _error_status(exc) == 412):
                raise Exists(key) from exc
            raise

    def get(
        self, key: str, start: int, end: int | None, into: memoryview | None = None
    ) -> tuple[bytes | memoryview | None, int | None]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-" + ("" if end is None else str(end))
        try:
            response = self.sdk.get_object(**kwargs)
        except _botocore_errors().ClientError as exc:
            if _error_code(exc) == "InvalidRange" or _error_status(exc) == 416:
                # Past the end; S3's InvalidRange body gives the object's size.
                size = (exc.response.get("Error") or {}).get("ActualObjectSize")
                return None, int(size) if size is not None and str(size).isdigit() else None
            raise
        body = response["Body"]
        try:
            data = body.read()  # a body that breaks off raises here: classified transient, retried
        finally:
            with contextlib.suppress(Exception):
                body.close()
        total = _total_size(response.get("ContentRange"))
        if total is None and "Range" not in kwargs:
            total = response.get("ContentLength")
        if into is not None:  # a chunk of a split read: one copy (botocore's readinto makes one too)
            sink = IntoView(into)
            sink.write(data)
            return sink.filled(), total
        return data, total

    def size(self, key: str) -> int:
        return int(self.sdk.head_object(Bucket=self.bucket, Key=key).get("ContentLength") or 0)

    def has_objects(self, key_prefix: str) -> bool:
        response = self.sdk.list_objects_v2(Bucket=self.bucket, Prefix=key_prefix, MaxKeys=1)
        # Some S3-compatible servers send no KeyCount; a reply may also count without listing.
        return bool(response.get("KeyCount") or response.get("Contents"))

    def _pages(self, **kwargs: Any):
        return self.sdk.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)

    def list(self, key_prefix: str) -> list[tuple[str, int]]:
        return [
            (obj["Key"], int(obj.get("Size") or 0))
            for page in self._pages(Prefix=key_prefix)
            for obj in page.get("Contents") or ()
        ]

    def list_top(self, key_prefix: str) -> list[tuple[str, int]]:
        """(key, size) of the objects directly below `key_prefix` (a '/'-delimited listing)."""
        return [
            (obj["Key"], int(obj.get("Size") or 0))
            for page in self._pages(Prefix=key_prefix, Delimiter="/")
            for obj in page.get("Contents") or ()
        ]

    def list_prefixes(self, key_prefix: str) -> list[str]:
        return [
            common["Prefix"]
            for page in self._pages(Prefix=key_prefix, Delimiter="/")
            for common in page.get("CommonPrefixes") or ()
        ]

    def delete(self, keys: list[str]) -> list[tuple[str, str]]:
        if len(keys) == 1:  # one object (a commit's pending marker): a plain DELETE, cheaper than a batch
            self.sdk.delete_object(Bucket=self.bucket, Key=keys[0])
            return []
        response = self.sdk.delete_objects(
            Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
        )
        return [
            (str(err.get("Key")), f"{err.get('Code')} {err.get('Message') or ''}".strip())
            for err in response.get("Errors") or ()
            if err.get("Code") != "NoSuchKey"
        ]

    def start_upload(self, key: str) -> "S3Upload":
        extra: dict[str, Any] = {}
        # Mirror s3transfer: when botocore computes checksums by default, declare the part
        # checksum algorithm on the upload so CompleteMultipartUpload accepts the part checksums.
        if getattr(self.sdk.meta.config, "request_checksum_calculation", None) == "when_supported":
            extra["ChecksumAlgorithm"] = "CRC32"
        response = self.sdk.create_multipart_upload(Bucket=self.bucket, Key=key, **extra)
        return S3Upload(self, key, response["UploadId"])

    def abort_uploads(self, key_prefix: str) -> None:
        bex = _botocore_errors()
        paginator = self.sdk.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=key_prefix):
            for upload in page.get("Uploads") or ():
                with contextlib.suppress(bex.ClientError):
                    self.sdk.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    def classify(self, exc: BaseException) -> str:
        if isinstance(exc, _botocore_errors().ClientError):
            code = _error_code(exc)
            if code in _NOT_FOUND_CODES:
                return "missing"
            if code in _TRANSIENT_CODES or _error_status(exc) in _TRANSIENT_STATUS:
                return "transient"
            return "permanent"
        return "transient" if _transient_transport_error(exc) else "permanent"

    def describe(self, exc: BaseException) -> str:
        bex = _botocore_errors()
        if isinstance(exc, bex.ClientError):
            code = _error_code(exc) or "unknown"
            status = _error_status(exc)
            message = str(((exc.response or {}).get("Error") or {}).get("Message") or "").strip()
            text = code + (f" (HTTP {status})" if status else "")
            if message and message != code:
                text += f": {message}"
            if code in _HINTS:
                text += f" - {_HINTS[code]}"
            return text
        if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            return (
                "no usable AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                "or an instance role)"
            )
        return f"{type(exc).__name__}: {exc}"

    def secrets(self) -> Iterable[str]:
        """The client's own credentials (from a profile or role, not only the environment) and
        its endpoint URL's password; read without a refresh (no request is made)."""
        out: list[str] = []
        with contextlib.suppress(Exception):
            out.append(urlsplit(self.sdk.meta.endpoint_url).password or "")
        with contextlib.suppress(Exception):
            fields = vars(self.sdk._request_signer._credentials)
            out += [str(fields.get(name) or "") for name in ("secret_key", "_secret_key", "token", "_token")]
        return [s for s in out if s]


class S3Upload:
    """One S3 multipart upload (see `multipart.Upload`)."""

    def __init__(self, client: S3Client, key: str, upload_id: str):
        self._c = client
        self._key = key
        self._upload_id = upload_id
        self._sizes: dict[int, int] = {}
        self._sizes_lock = threading.Lock()

    def put_part(self, number: int, data: bytes) -> dict[str, Any]:
        c = self._c
        response = c.sdk.upload_part(
            Bucket=c.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=data
        )
        with self._sizes_lock:
            self._sizes[number] = len(data)
        record = {"PartNumber": number, "ETag": response["ETag"]}
        record.update({k: v for k, v in response.items() if k.startswith("Checksum") and k != "ChecksumType"})
        return record

    def complete(self, parts: list[dict[str, Any]]) -> None:
        c = self._c
        try:
            c.sdk.complete_multipart_upload(
                Bucket=c.bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )
        except _botocore_errors().ClientError as exc:
            # A retried Complete whose first attempt succeeded (response lost) answers NoSuchUpload:
            # the object is there if its ETag is the one this upload produces.
            if _error_code(exc) == "NoSuchUpload" and self._completed_anyway(parts):
                log.info("s3://%s/%s: multipart upload had completed before a retry; keeping it", c.bucket, self._key)
                return
            raise

    def _completed_anyway(self, parts: list[dict[str, Any]]) -> bool:
        try:
            head = self._c.sdk.head_object(Bucket=self._c.bucket, Key=self._key)
        except Exception:  # noqa: BLE001 - the NoSuchUpload error is the one to report
            return False
        size = sum(self._sizes.values())
        return head.get("ETag") == _multipart_etag([p["ETag"] for p in parts]) and head.get("ContentLength") == size

    def abort(self) -> None:
        """Best effort, never raises: an upload already gone is fine, anything else is logged."""
        c = self._c
        try:
            c.sdk.abort_multipart_upload(Bucket=c.bucket, Key=self._key, UploadId=self._upload_id)
        except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise
            if _error_code(exc) != "NoSuchUpload":
                log.warning("s3://%s/%s: could not abort multipart upload: %s", c.bucket, self._key, scrub(str(exc)))


_CLIENT_CACHE: dict[tuple, Any] = {}
_CLIENT_LOCK = threading.Lock()
_LOADER: tuple[int, Any] | None = None
_LOADER_LOCK = threading.Lock()  # not _CLIENT_LOCK: default_client() holds that one while it calls make_client()
# The environment that decides which endpoint and account a default client uses.
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
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


def make_client(*, max_pool_connections: int = 32, **config_kwargs: Any):
    """A fresh boto3 S3 client from the standard AWS sources (env vars incl. AWS_ENDPOINT_URL,
    config files, profiles, instance roles) with timeouts suited to checkpoints and botocore's
    own retries off: every request is retried by `ObjectStorage.call`, so the two never multiply
    (tries: `S3Storage(max_attempts=)`, CKPTLIB_S3_MAX_ATTEMPTS or AWS_MAX_ATTEMPTS)."""
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
    options: dict[str, Any] = {
        "retries": {"mode": "standard", "total_max_attempts": 1},
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
