"""Azure Blob Storage: objects under `az://container/prefix` through azure-storage-blob.

Account and credentials come from the standard sources, first match wins:
AZURE_STORAGE_CONNECTION_STRING; else the account (`az://container@account/prefix`, or
AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT) with AZURE_STORAGE_ACCOUNT_KEY /
AZURE_STORAGE_KEY, or AZURE_STORAGE_SAS_TOKEN, or azure-identity's DefaultAzureCredential
(environment, workload/managed identity, Azure CLI). AZURE_STORAGE_BLOB_ENDPOINT overrides
the https://<account>.blob.core.windows.net endpoint. Large objects stream as staged blocks
(uploaded concurrently, committed with one Put Block List). Retries are ckptlib's
(objects.ObjectStorage.call): the SDK's own retry policy is off.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import re
import threading
from typing import Any, Iterable

from ckptlib._scrub import guard_loggers, scrub
from ckptlib.errors import StorageError
from ckptlib.storage.base import check_relative
from ckptlib.storage.objects import Exists, IntoView, ObjectStorage, new_token
from ckptlib.storage.transfer import MiB, Transfer, env_options

#: Azure's defaults. One request up to 64 MiB (the SDK's own max_single_put_size default):
#: below it a round of staged blocks only adds requests. Beyond it, 16 MiB blocks, doubling
#: past 5,000 so a stream fits Azure's 50,000 blocks of at most 4,000 MiB. A single Put Blob is
#: kept to 256 MiB (the service takes 5,000 MiB): a larger `write` goes as blocks, each retried
#: alone, instead of one request re-sent whole. The rest is every backend's.
DEFAULTS = Transfer(
    multipart_threshold=64 * MiB,
    part_size=16 * MiB,
    max_concurrency=8,
    read_chunk_size=32 * MiB,
    max_attempts=8,
    max_part_size=4000 * MiB,
    max_parts=50_000,
    max_put_size=256 * MiB,
)

TIMEOUTS = {"connection_timeout": 10, "read_timeout": 120}
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:[a-z0-9]|-(?!-))*[a-z0-9]$")
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_CLIENT_ENV = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_BLOB_ENDPOINT",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_HINTS = {
    "AuthenticationFailed": "the account key, SAS token or credential was rejected",
    "AuthorizationFailure": "the credentials lack permission for this operation",
    "AuthorizationPermissionMismatch": "the credentials lack permission for this operation",
    "ContainerNotFound": "the container does not exist",
    "AccountIsDisabled": "the storage account is disabled",
}


def parse_uri(uri: str) -> tuple[str, str | None, str]:
    """`az://container[@account]/some/prefix` -> ("container", "account" or None, "some/prefix")."""
    if not isinstance(uri, str) or not uri.startswith("az://"):
        raise StorageError(f"not an az:// URI: {uri!r}", path=str(uri))
    netloc, _, prefix = uri[len("az://") :].partition("/")
    container, _, account = netloc.partition("@")
    account = account.split(".", 1)[0] or None  # container@account.blob.core.windows.net
    if not _CONTAINER_RE.match(container):
        raise StorageError(
            f"invalid Azure container name {container!r}: 3-63 lowercase letters, digits and "
            "single hyphens, starting and ending with a letter or digit",
            path=f"az://{netloc}",
        )
    if account is not None and not _ACCOUNT_RE.match(account):
        raise StorageError(
            f"invalid Azure storage account name {account!r}: 3-24 lowercase letters and digits", path=f"az://{netloc}"
        )
    prefix = prefix.strip("/")
    if prefix:
        check_relative(prefix, uri)
    return container, account, prefix


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _sdk_options() -> dict[str, Any]:
    """The SDK's own retries off (ObjectStorage.call retries), and its single requests as large
    as ckptlib's: it never splits a put or a get into its own unretried chunks."""
    return {
        "retry_total": 0,
        "max_single_put_size": DEFAULTS.max_put_size,
        "max_single_get_size": DEFAULTS.read_chunk_size,
        "max_chunk_get_size": DEFAULTS.read_chunk_size,
        **TIMEOUTS,
    }


def default_service(account: str | None = None):
    """The process's BlobServiceClient for the current environment (cached per process)."""
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise StorageError("az:// checkpoints need azure-storage-blob: pip install 'ckptlib[azure]'") from exc
    fingerprint = hashlib.sha256("\0".join(os.environ.get(k, "") for k in _CLIENT_ENV).encode()).hexdigest()
    key = (os.getpid(), fingerprint, account)
    with _CLIENTS_LOCK:
        service = _CLIENTS.get(key)
        if service is None:
            for stale in [k for k in _CLIENTS if k[0] != os.getpid()]:
                del _CLIENTS[stale]
            service = _CLIENTS[key] = _make_service(BlobServiceClient, account)
        return service


def _make_service(cls, account: str | None):
    env = os.environ
    connection = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection and account is None:
        try:
            return cls.from_connection_string(connection, **_sdk_options())
        except ValueError as exc:
            raise StorageError(
                "AZURE_STORAGE_CONNECTION_STRING is not a valid connection string: " + scrub(str(exc), [connection])
            ) from None
    account = account or env.get("AZURE_STORAGE_ACCOUNT_NAME") or env.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise StorageError(
            "az:// needs an account: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
            "(with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or an azure-identity credential), "
            "or write az://container@account/prefix"
        )
    endpoint = env.get("AZURE_STORAGE_BLOB_ENDPOINT") or f"https://{account}.blob.core.windows.net"
    key = env.get("AZURE_STORAGE_ACCOUNT_KEY") or env.get("AZURE_STORAGE_KEY")
    sas = env.get("AZURE_STORAGE_SAS_TOKEN")
    if key:
        credential: Any = {"account_name": account, "account_key": key}
    elif sas:
        credential = sas
    else:
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError as exc:
            raise StorageError(
                f"az:// account {account}: no AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, and "
                "azure-identity (for DefaultAzureCredential) is not installed: pip install "
                "'ckptlib[azure]'"
            ) from exc
        credential = DefaultAzureCredential()
    return cls(account_url=endpoint, credential=credential, **_sdk_options())


class AzureClient:
    """objects.ObjectClient over one container."""

    scheme = "az"
    label = "Azure Blob"
    delete_batch = 1
    writes_into = True  # downloader.readinto: each chunk written in place

    def __init__(self, service: Any, container: str):
        self.sdk = service
        self.container = service.get_container_client(container)
        guard_loggers(("azure", "urllib3", "requests"))

    def _blob(self, key: str):
        return self.container.get_blob_client(key)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, content_type: str | None = None) -> None:
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError
        from azure.storage.blob import ContentSettings

        settings = ContentSettings(content_type=content_type) if content_type else None
        try:
            self._blob(key).upload_blob(data, overwrite=not if_absent, max_concurrency=1, content_settings=settings)
        except (ResourceExistsError, ResourceModifiedError) as exc:
            if if_absent and self._error_code(exc) in ("BlobAlreadyExists", "ConditionNotMet", ""):
                raise Exists(key) from exc
            raise

    def get(
        self, key: str, start: int, end: int | None, into: memoryview | None = None
    ) -> tuple[bytes | memoryview | None, int | None]:
        from azure.core.exceptions import HttpResponseError

        length = None if end is None else end - start + 1
        try:
            downloader = self._blob(key).download_blob(
                offset=start if (start or length) else None, length=length, max_concurrency=1
            )
            total = downloader.size if end is None else None
            if into is None:
                return downloader.readall(), total
            sink = IntoView(into)
            downloader.readinto(sink)
            return sink.filled(), total
        except HttpResponseError as exc:
            if getattr(exc, "status_code", None) == 416:
                return None, None
            raise

    def size(self, key: str) -> int:
        return int(self._blob(key).get_blob_properties().size)

    def has_objects(self, key_prefix: str) -> bool:
        blobs = self.container.list_blobs(name_starts_with=key_prefix or None, results_per_page=1)
        return any(True for _ in itertools.islice(blobs, 1))

    def list(self, key_prefix: str) -> list[tuple[str, int]]:
        blobs = self.container.list_blobs(name_starts_with=key_prefix or None)
        return [(b.name, int(b.size or 0)) for b in blobs]

    def list_top(self, key_prefix: str) -> list[tuple[str, int]]:
        """(key, size) of the objects directly below `key_prefix` (a '/'-delimited listing)."""
        from azure.storage.blob import BlobPrefix

        return [
            (item.name, int(item.size or 0))
            for item in self.container.walk_blobs(name_starts_with=key_prefix or None, delimiter="/")
            if not isinstance(item, BlobPrefix)
        ]

    def list_prefixes(self, key_prefix: str) -> list[str]:
        from azure.storage.blob import BlobPrefix

        return sorted(
            item.name
            for item in self.container.walk_blobs(name_starts_with=key_prefix or None, delimiter="/")
            if isinstance(item, BlobPrefix)
        )

    def delete(self, keys: list[str]) -> list[tuple[str, str]]:
        from azure.core.exceptions import ResourceNotFoundError

        for key in keys:
            try:
                self._blob(key).delete_blob()
            except ResourceNotFoundError as exc:
                if self._error_code(exc) == "ContainerNotFound":
                    raise
        return []

    def start_upload(self, key: str) -> "BlockUpload":
        return BlockUpload(self._blob(key))

    def abort_uploads(self, key_prefix: str) -> None:
        """Nothing to do: uncommitted blocks create no blob and Azure discards them within a week."""

    @staticmethod
    def _error_code(exc: BaseException) -> str:
        return str(getattr(exc, "error_code", None) or "")

    def classify(self, exc: BaseException) -> str:
        from azure.core import exceptions as aex

        code = self._error_code(exc)
        if isinstance(exc, aex.ResourceNotFoundError):
            return "permanent" if code == "ContainerNotFound" else "missing"
        if isinstance(exc, aex.ClientAuthenticationError):
            return "permanent"
        if isinstance(exc, (aex.ServiceRequestError, aex.ServiceResponseError, aex.IncompleteReadError)):
            return "transient"
        if isinstance(exc, aex.HttpResponseError) and getattr(exc, "status_code", None) in _TRANSIENT_STATUS:
            return "transient"
        if isinstance(exc, aex.HttpResponseError) and isinstance(
            exc.__cause__, (aex.IncompleteReadError, aex.ServiceResponseError)
        ):
            return "transient"  # the downloader's own three tries at a body that broke off, given up
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return "transient"
        return "permanent"

    def describe(self, exc: BaseException) -> str:
        status = getattr(exc, "status_code", None)
        code = self._error_code(exc)
        text = type(exc).__name__ + (f" {code}" if code else "") + (f" (HTTP {status})" if status else "")
        reason = getattr(exc, "reason", None) or ""
        message = str(getattr(exc, "message", None) or exc).splitlines()
        first = (message[0].strip() if message else "") or str(reason)
        if first and first != code:
            text += f": {first[:300]}"
        if code in _HINTS:
            text += f" - {_HINTS[code]}"
        return text

    def secrets(self) -> Iterable[str]:
        """The service client's own account key (the environment's are scrubbed anyway)."""
        credential = getattr(self.sdk, "credential", None)
        key = getattr(credential, "account_key", None)
        return [key] if isinstance(key, str) and key else []


class BlockUpload:
    """A multipart upload on Azure: parts are staged blocks, `complete` commits the list."""

    def __init__(self, blob: Any):
        self._blob = blob
        self._token = new_token()

    def put_part(self, number: int, data: bytes) -> str:
        block_id = base64.b64encode(f"{self._token}-{number:06d}".encode()).decode("ascii")
        self._blob.stage_block(block_id, data)
        return block_id

    def complete(self, parts: list[str]) -> None:
        from azure.storage.blob import BlobBlock

        self._blob.commit_block_list([BlobBlock(block_id=b) for b in parts])

    def abort(self) -> None:
        """Nothing to do: uncommitted blocks create no blob and Azure discards them within a week."""


class AzureStorage(ObjectStorage):
    """Objects below `az://container[@account]/prefix` through a BlobServiceClient (`service`;
    default: the process's shared one for the current environment and account)."""

    DEFAULTS = DEFAULTS

    def __init__(
        self, container: str, prefix: str = "", service: Any = None, *, account: str | None = None, **options: Any
    ):
        self._sdk = service
        self.account = account
        super().__init__("az", container, prefix, **options)

    def _base_uri(self) -> str:
        return f"az://{self.container}@{self.account}" if self.account else f"az://{self.container}"

    def _new_api(self) -> AzureClient:
        service = self._sdk if self._sdk is not None else default_service(self.account)
        return AzureClient(service, self.container)

    @classmethod
    def from_uri(cls, uri: str, service: Any = None, **options: Any) -> "AzureStorage":
        """`az://container[@account]/prefix`; transfer settings may also come from CKPTLIB_AZ_PART_SIZE
        and kin (transfer.env_options); explicit keyword arguments win."""
        container, account, prefix = parse_uri(uri)
        return cls(container, prefix, service, account=account, **{**env_options("az"), **options})


__all__ = ["AzureStorage", "AzureClient", "DEFAULTS", "parse_uri", "default_service"]
