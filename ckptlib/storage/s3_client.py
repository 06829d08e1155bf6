"""S3 clients and errors: URI parsing, bucket-name checks, the shared boto3 client (retries
configured), and how botocore's errors become StorageErrors that never show credentials.
The storage (`s3.S3Storage`) and its multipart writer (`s3_writer`) build on this."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from typing import Any

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
        from urllib3.exceptions import ProtocolError
        from urllib3.exceptions import ReadTimeoutError as U3ReadTimeout

        transient = transient + (ProtocolError, U3ReadTimeout)
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, transient)
