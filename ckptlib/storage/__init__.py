"""Where checkpoint bytes live: `open_storage(uri)` for plain paths, file://, s3://, gs:// and az:// URIs.

- `base`: the `Storage` protocol every backend implements (`open_storage` / `as_storage` here);
- `local`: a local (or shared) filesystem: fsynced files, atomic renames, a `latest` symlink;
- `objects`: one `Storage` over any object store, with `prefixed` its key space under a
  prefix, `multipart` its streamed multipart writer and `transfer` the transfer settings;
- `s3` (with `s3_client`, the boto3 requests), `gcs`, `azure`: the object stores' clients.

Imports nothing of ckptlib above it but `errors` and `_scrub`."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from ckptlib.errors import StorageError
from ckptlib.storage.base import (
    Storage,
    SupportsCreateExclusive,
    SupportsDirectReads,
    SupportsFileRoot,
    SupportsShallowList,
    check_relative,
    list_top,
    root_is_file,
)
from ckptlib.storage.local import LocalStorage

__all__ = [
    "Storage",
    "SupportsCreateExclusive",
    "SupportsDirectReads",
    "SupportsFileRoot",
    "SupportsShallowList",
    "LocalStorage",
    "as_storage",
    "open_storage",
    "check_relative",
    "is_remote",
    "list_top",
    "root_is_file",
]


REMOTE_SCHEMES = ("s3://", "gs://", "az://")


def is_remote(uri: str | os.PathLike) -> bool:
    return str(uri).startswith(REMOTE_SCHEMES)


def open_storage(uri: str | os.PathLike) -> Storage:
    """The backend for a URI: `s3://bucket/prefix`, `gs://bucket/prefix`,
    `az://container/prefix`, `file:///abs/path` or a plain path."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"checkpoint location must be a non-empty path or URI, got {uri!r}")
    if uri.startswith("s3://"):
        from ckptlib.storage.s3 import S3Storage  # boto3 is an optional dependency

        return S3Storage.from_uri(uri)
    if uri.startswith("gs://"):
        from ckptlib.storage.gcs import GCSStorage  # google-cloud-storage is an optional dependency

        return GCSStorage.from_uri(uri)
    if uri.startswith("az://"):
        from ckptlib.storage.azure import AzureStorage  # azure-storage-blob is an optional dependency

        return AzureStorage.from_uri(uri)
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"file:// URI with a remote host is not supported: {uri}", path=uri)
        return LocalStorage(parsed.path)
    if "://" in uri:
        raise StorageError(f"unsupported URI scheme in {uri!r} (use a path, file://, s3://, gs:// or az://)", path=uri)
    return LocalStorage(uri)


def as_storage(uri_or_storage: str | os.PathLike | Storage) -> Storage:
    """`open_storage(uri)` for a path or URI; a Storage is returned as it is."""
    return open_storage(uri_or_storage) if isinstance(uri_or_storage, (str, os.PathLike)) else uri_or_storage
