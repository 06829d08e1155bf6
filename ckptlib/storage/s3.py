"""S3 storage: objects under `s3://bucket/prefix`, one more client under the shared object-store
layer (`objects.ObjectStorage`: retries, streamed multipart writes, ranged and parallel reads,
pointers, deletion order, the scrubber). What is S3's own is here and in `s3_client.py`:

* bucket names and URIs; S3's limits and the defaults table (`DEFAULTS`);
* exclusive create with `If-None-Match: *` (412: taken; 409 ConditionalRequestConflict:
  retried with the shared back-off);
* batch DeleteObjects (1,000 keys per request; the keys S3 reports it could not delete are
  named, the first five and the count); multipart uploads a crashed writer left are aborted by
  `delete_tree`;
* 416 read as past the end, a Content-Range without a size, a single PUT up to 5 GiB (beyond,
  `write` is a multipart upload), parts that grow past 1,000 so a stream fits 10,000 parts,
  and a Complete that recognises its own object after a lost response.

botocore's own retries are off (`make_client`); `ObjectStorage.call` retries every request,
including a response body that breaks off while it is read.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptlib._scrub import scrub
from ckptlib.errors import StorageError
from ckptlib.storage.base import check_relative
from ckptlib.storage.objects import ObjectStorage
from ckptlib.storage.s3_client import DELETE_BATCH, S3Client, default_client, make_client
from ckptlib.storage.transfer import GiB, MiB, Transfer, env_options

# S3's limits: parts are 5 MiB..5 GiB (the last may be smaller), at most 10,000 parts per
# upload, at most 5 GiB per single PUT.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_PUT_SIZE = 5 * GiB

#: S3's defaults. Multipart from 16 MiB, not the 64 MiB GCS and Azure start at: S3's multipart
#: upload is native and cheap (no temporary objects, unlike GCS's compose), its parts go up in
#: parallel (one S3 connection is slower than several) and a failed request re-sends one part,
#: not the whole object. 16 MiB parts (S3 allows 5 MiB..5 GiB) double past 1,000 parts, so a
#: stream of unknown length fits the 10,000-part limit. The rest is every backend's: 8 requests
#: in flight, 32 MiB read chunks, 8 tries per request.
DEFAULTS = Transfer(
    multipart_threshold=16 * MiB,
    part_size=16 * MiB,
    max_concurrency=8,
    read_chunk_size=32 * MiB,
    max_attempts=8,
    min_part_size=MIN_PART_SIZE,
    max_part_size=MAX_PART_SIZE,
    max_parts=MAX_PARTS,
    max_put_size=MAX_PUT_SIZE,
)
DEFAULT_MULTIPART_THRESHOLD = DEFAULTS.multipart_threshold
DEFAULT_PART_SIZE = DEFAULTS.part_size
DEFAULT_MAX_CONCURRENCY = DEFAULTS.max_concurrency

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


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
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    validate_bucket(bucket)
    prefix = prefix.strip("/")
    if prefix:
        check_relative(prefix, uri)
    return bucket, prefix


def env_settings() -> dict[str, int]:
    """Transfer settings from CKPTLIB_S3_<OPTION>; the number of tries also from AWS_MAX_ATTEMPTS
    (which set botocore's retries when botocore did the retrying) unless CKPTLIB_S3_MAX_ATTEMPTS is set."""
    options = env_options("s3")
    raw = os.environ.get("AWS_MAX_ATTEMPTS")
    if "max_attempts" not in options and raw:
        try:
            options["max_attempts"] = int(raw)
        except ValueError:
            raise StorageError(f"AWS_MAX_ATTEMPTS={raw!r} is not an integer") from None
    return options


class S3Storage(ObjectStorage):
    """Objects below `s3://bucket/prefix` through a boto3 client (`client`; default: the
    process's shared one for the current AWS environment)."""

    DEFAULTS = DEFAULTS

    def __init__(self, bucket: str, prefix: str = "", client: Any = None, **options):
        self.bucket = validate_bucket(bucket)
        self._sdk = client  # None: the process's shared default client, made on first use
        super().__init__("s3", bucket, prefix, **options)

    @classmethod
    def from_uri(cls, uri: str, client: Any = None, **options: Any) -> "S3Storage":
        """`s3://bucket/prefix`; transfer settings may also come from CKPTLIB_S3_MULTIPART_THRESHOLD,
        CKPTLIB_S3_PART_SIZE, CKPTLIB_S3_MAX_CONCURRENCY, CKPTLIB_S3_READ_CHUNK_SIZE and
        CKPTLIB_S3_MAX_ATTEMPTS (or AWS_MAX_ATTEMPTS); explicit keyword arguments win."""
        bucket, prefix = parse_uri(uri)
        return cls(bucket, prefix, client, **{**env_settings(), **options})

    def _new_api(self) -> S3Client:
        if self._sdk is not None:
            return S3Client(self._sdk, self.bucket)
        try:
            sdk = default_client()
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's configuration errors (a bad endpoint URL, profile)
            raise StorageError(
                scrub(f"S3: cannot make a client for {self.uri}: {type(exc).__name__}: {exc}"), path=self.uri
            ) from None
        return S3Client(sdk, self.bucket)


__all__ = [
    "S3Storage",
    "S3Client",
    "DEFAULTS",
    "DELETE_BATCH",
    "MIN_PART_SIZE",
    "MAX_PART_SIZE",
    "MAX_PARTS",
    "MAX_PUT_SIZE",
    "make_client",
    "default_client",
    "parse_uri",
    "validate_bucket",
]
