"""One `Storage` over any object store: retries with backoff, ranged and parallel reads
(prefixed.py, shared with S3), streamed multipart writes (multipart.py, shared with S3),
exclusive create, pointers. Each cloud supplies only an
`ObjectClient` (a handful of primitive calls and how to classify its errors): gcs.py, azure.py.

Guarantees (the same as S3's, s3.py):

* `write` and a finished `open_writer` are atomic: readers see the old object or the new one.
* `open_writer` sends nothing before the multipart threshold; small objects go as one put,
  large ones as parts uploaded by a bounded pool while the caller keeps writing (memory stays
  below about `(max_concurrency + 2) * part_size`), committed in one call at the end. An
  exception inside the context aborts: no object is created.
* Every primitive call is retried with exponential backoff and jitter on transient errors
  (HTTP 408/429/5xx, connection resets, timeouts), `max_attempts` tries in all; a permanent
  error, or retries exhausted, is a `StorageError` naming the URI and the operation, with
  credentials scrubbed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import random
import re
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar

from ..errors import StorageError
from .base import check_relative
from .multipart import MultipartWriter, Upload
from .prefixed import PrefixedObjects, deletion_phases, env_options  # noqa: F401 (env_options: gcs, azure)

log = logging.getLogger(__name__)

MiB = 1 << 20
# Objects up to 64 MiB go as one request, as the SDKs do (Azure's max_single_put_size;
# google-cloud-storage sends any upload as one request): a part round costs requests.
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_READ_CHUNK_SIZE = 32 * MiB
DEFAULT_MAX_ATTEMPTS = 8

T = TypeVar("T")

# Secrets that can appear in SDK messages: SAS signatures, account keys, bearer tokens.
_SECRET_RES = (
    re.compile(r"(?i)(sig|se|sv|sp|sr|st|skoid|sktid|skt|ske|sks|skv|spr|srt|ss)=[^&\s\"']+"),
    re.compile(r"(?i)(AccountKey|SharedAccessSignature|access_token|private_key|client_secret)\s*[=:]\s*[^;\s\"',]+"),
    re.compile(r"(?i)(authorization|x-goog-api-key)[\"']?\s*[:=]\s*[\"']?[^\"'\n,}]+"),
    re.compile(r"\bya29\.[A-Za-z0-9_\-\.]+"),
)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with anything that looks like a credential replaced by <redacted>."""
    for pattern in _SECRET_RES:
        text = pattern.sub(
            lambda m: m.group(0).split("=", 1)[0] + "=<redacted>" if "=" in m.group(0) else "<redacted>", text
        )
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "<redacted>")
    return text


class Exists(Exception):
    """Raised by `ObjectClient.put(if_absent=True)` when an object is already there."""


class ObjectClient(Protocol):
    """What a cloud provides to `ObjectStorage`. Keys are full object names in `container`.
    Every method may raise the SDK's own exceptions; `classify` tells them apart."""

    scheme: str  # "gs", "az": the URI scheme
    label: str  # "GCS", "Azure Blob": for messages

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """One-shot upload; `Exists` when if_absent and an object is there."""

    def get(self, key: str, start: int, end: int | None) -> tuple[bytes | None, int | None]:
        """Bytes [start, end] (inclusive; None: to the end) and the object size if known;
        (None, size) when start is at or past the end. FileNotFoundError if absent."""

    def size(self, key: str) -> int:
        """The object's size; FileNotFoundError if absent."""

    def list(self, key_prefix: str, limit: int | None = None) -> list[tuple[str, int]]:
        """Every (key, size) whose key starts with `key_prefix` (the first `limit` of them)."""

    def list_prefixes(self, key_prefix: str) -> list[str]:
        """The '/'-delimited sub-prefixes directly below `key_prefix` (with trailing '/')."""

    def delete(self, key: str) -> None:
        """Remove one object; absent is not an error."""

    def start_upload(self, key: str) -> "Upload":
        """Begin a multipart upload of `key` (no object is visible until `complete`)."""

    def classify(self, exc: BaseException) -> str:
        """'missing', 'exists', 'range' (416), 'transient' or 'permanent'."""

    def describe(self, exc: BaseException) -> str:
        """A one-line account of an SDK error (code, HTTP status, hint); scrubbed by the caller."""

    def secrets(self) -> Iterable[str]:
        """Credential strings to scrub from any message."""


class ObjectStorage(PrefixedObjects):
    """Objects below `<scheme>://container/prefix`, through the `ObjectClient` that the
    subclass's `_new_client` makes on first use (and again after unpickling)."""

    def __init__(
        self,
        scheme: str,
        container: str,
        prefix: str = "",
        *,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        read_chunk_size: int = DEFAULT_READ_CHUNK_SIZE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff_base: float = 0.1,
        backoff_cap: float = 8.0,
    ):
        prefix = (prefix or "").strip("/")
        base_uri = f"{scheme}://{container}"
        if prefix:
            check_relative(prefix, base_uri)
        if part_size < 1 or multipart_threshold < 1 or max_concurrency < 1 or read_chunk_size < 1 or max_attempts < 1:
            raise ValueError("transfer sizes, max_concurrency and max_attempts must be >= 1")
        self._client: ObjectClient | None = None
        self.scheme = scheme
        self.container = container
        self.prefix = prefix
        self.uri = f"{base_uri}/{prefix}" if prefix else base_uri
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.read_chunk_size = read_chunk_size
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap

    def _options(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "multipart_threshold",
                "part_size",
                "max_concurrency",
                "read_chunk_size",
                "max_attempts",
                "backoff_base",
                "backoff_cap",
            )
        }

    @property
    def client(self) -> ObjectClient:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _new_client(self) -> ObjectClient:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # SDK clients do not pickle; the copy makes its own
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- calls ---------------------------------------------------------------------------
    def error(self, exc: BaseException, op: str, where: str, attempts: int = 1) -> StorageError:
        """A StorageError naming the operation and URI; credentials scrubbed."""
        if isinstance(exc, StorageError):
            return exc
        client = self.client
        text = f"{client.label} {op} failed for {where}: {client.describe(exc)}"
        if attempts > 1:
            text += f" (gave up after {attempts} attempts)"
        return StorageError(scrub(text, client.secrets()), path=where)

    def call(
        self, op: str, where: str, fn: Callable[[], T], *, passthrough: tuple[str, ...] = (), absent_ok: bool = False
    ) -> T:
        """Run `fn` with retries on transient errors. Errors classified in `passthrough`
        ('missing', 'exists', 'range') propagate unchanged for the caller to interpret; a
        missing object is a FileNotFoundError when `absent_ok` (reads), else a StorageError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except (FileNotFoundError, Exists):
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                kind = self.client.classify(exc)
                if kind in passthrough:
                    raise
                if kind == "missing" and absent_ok:
                    raise FileNotFoundError(f"{where}: no such object") from exc
                if kind == "transient" and attempt < self.max_attempts:
                    delay = min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                    log.info(
                        "%s: %s failed transiently (%s); retry %d/%d in %.2fs",
                        where,
                        op,
                        type(exc).__name__,
                        attempt,
                        self.max_attempts - 1,
                        delay,
                    )
                    time.sleep(delay)
                    continue
                raise self.error(exc, op, where, attempt) from exc

    # -- Storage protocol ----------------------------------------------------------------
    def child(self, name: str) -> "ObjectStorage":
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        clone.prefix = self._key(name)
        clone.uri = f"{self.scheme}://{self.container}/{clone.prefix}"
        return clone

    def exists(self) -> bool:
        return bool(self.call("list", self.uri, lambda: self.client.list(self._dir(), limit=1)))

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        key = self._key(path)
        body = bytes(data)
        self.call("put", self._where(path), lambda: self.client.put(key, body))

    def sync(self, paths: Iterable[str], names_only: Iterable[str] = ()) -> None:
        """Nothing to do: a completed upload is durable."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Put `data` only if no object is at `path` (see base.SupportsCreateExclusive)."""
        key = self._key(path)
        where = self._where(path)
        body = bytes(data)
        for _ in range(4):
            try:
                self.call(
                    "conditional put",
                    where,
                    lambda: self.client.put(key, body, if_absent=True),
                    passthrough=("exists",),
                )
                return True
            except Exists:
                pass
            except Exception as exc:  # noqa: BLE001 - an SDK's own "exists" error
                if self.client.classify(exc) != "exists":
                    raise self.error(exc, "conditional put", where) from exc
            # Taken, perhaps by this very call (a retried put whose first response was lost):
            # the caller's data is unique (a lock token), so equal bytes mean the object is ours.
            try:
                return bytes(self.read(path)) == body
            except FileNotFoundError:
                continue  # deleted meanwhile: try again
        raise StorageError(f"conditional put failed for {where}: kept racing with concurrent writers", path=where)

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[MultipartWriter]:
        writer = MultipartWriter(_Uploads(self), self._key(path), self._where(path))
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.finish()

    def _get(self, key: str, where: str, start: int, end: int | None) -> tuple[bytes | None, int | None]:
        return self.call("get", where, lambda: self.client.get(key, start, end), absent_ok=True)

    def _head(self, key: str, where: str) -> int:
        return self.call("head", where, lambda: self.client.size(key), absent_ok=True)

    def _list_keys(self, key_prefix: str) -> dict[str, int]:
        return dict(self.call("list", self.uri, lambda: self.client.list(key_prefix)))

    def _listed(self, rel: str) -> bool:
        return super()._listed(rel) and not is_upload_part(rel)

    def list_children(self) -> list[str]:
        base = self._dir()
        names = set()
        for common in self.call("list", self.uri, lambda: self.client.list_prefixes(base)):
            name = common[len(base) :].rstrip("/")
            if name and name not in (".", ".."):
                names.add(name)
        return sorted(names)

    def delete(self, paths: Iterable[str]) -> None:
        self._delete_keys(list(dict.fromkeys(self._key(p) for p in paths)))

    def _delete_keys(self, keys: list[str]) -> None:
        if not keys:
            return

        def delete_one(key: str) -> None:
            self.call(
                "delete", f"{self.scheme}://{self.container}/{key}", lambda: self.client.delete(key), absent_ok=True
            )

        def tolerant(key: str) -> None:
            try:
                delete_one(key)
            except FileNotFoundError:
                pass
            except StorageError:
                raise
            except Exception as exc:  # noqa: BLE001 - an SDK "missing" passed through
                if self.client.classify(exc) != "missing":
                    raise

        workers = min(self.max_concurrency, len(keys))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"ckptlib-{self.scheme}-del") as pool:
            errors = [f.exception() for f in [pool.submit(tolerant, k) for k in keys]]
        failures = [e for e in errors if e is not None]
        if failures:
            raise failures[0]

    def delete_tree(self, name: str = "") -> None:
        target = self.child(name) if name else self
        for batch in deletion_phases(list(self._list_keys(target._dir()))):
            self._delete_keys(batch)

    def set_pointer(self, name: str, target: str) -> None:
        key = self._key(name)
        check_relative(target, self.uri)
        body = target.encode("utf-8")
        self.call("put pointer", self._where(name), lambda: self.client.put(key, body))

    def read_pointer(self, name: str) -> str | None:
        key = self._key(name)
        where = self._where(name)
        try:
            data, _ = self.call("get pointer", where, lambda: self.client.get(key, 0, None), absent_ok=True)
        except FileNotFoundError:
            return None
        try:
            return (data or b"").decode("utf-8").strip().rstrip("/")
        except UnicodeDecodeError as exc:
            raise StorageError(f"{where}: pointer object is not UTF-8 text", path=where) from exc


class _Uploads:
    """An `ObjectStorage` as `MultipartWriter`'s target: parts of one size, each request
    through `ObjectStorage.call` (ckptlib's retries), the client's put and upload."""

    stream_label = "object stream"
    max_parts = None

    def __init__(self, storage: ObjectStorage):
        self._s = storage
        self.scheme = storage.scheme
        self.multipart_threshold = storage.multipart_threshold
        self.max_concurrency = storage.max_concurrency
        self.call = storage.call
        self.error = storage.error

    def part_size(self, number: int) -> int:
        return self._s.part_size

    def put(self, key: str, where: str, data: bytes) -> None:
        self._s.call("put", where, lambda: self._s.client.put(key, data))

    def start_upload(self, key: str, where: str) -> Upload:
        return self._s.call("start upload", where, lambda: self._s.client.start_upload(key))


UPLOAD_PART_MARK = ".ckptlib-part-"


def upload_part_key(key: str, token: str, number: int) -> str:
    """Where a backend without native multipart keeps part `number` until it is composed."""
    return f"{key}{UPLOAD_PART_MARK}{token}-{number:05d}"


def is_upload_part(path: str) -> bool:
    return UPLOAD_PART_MARK in path.rsplit("/", 1)[-1]


def new_token() -> str:
    return uuid.uuid4().hex[:16]
