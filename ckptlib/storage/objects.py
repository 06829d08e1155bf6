"""One `Storage` over any object store: S3 (s3.py), GCS (gcs.py) and Azure Blob (azure.py) are
each an `ObjectClient` (a handful of primitive calls, how to classify and describe that SDK's
errors) and a defaults table (`transfer.Transfer`) under this one implementation.

Guarantees, the same on every object store:

* `write` and a finished `open_writer` are atomic: readers see the old object or the new one.
* `open_writer` sends nothing before the multipart threshold; small objects go as one put,
  large ones as parts uploaded by a bounded pool while the caller keeps writing (memory stays
  below about `(max_concurrency + 2) * part_size`), committed in one call at the end
  (multipart.py). An exception inside the context aborts: no object is created.
* Reads are ranged GETs, split into parallel chunk GETs for large ranges (prefixed.py), a
  large one into one buffer that the SDK writes each answer into where it can (`IntoView`);
  FileNotFoundError for a missing object, EOFError for a short one, like a local file.
* Every request is retried here, and only here, on transient errors (HTTP 408/409/429/5xx,
  connection resets, timeouts, a body that breaks off): `max_attempts` tries in all with
  exponential back-off and jitter (`backoff`). The SDKs' own retries are off, so the two never
  multiply (but for azure-storage-blob's downloader, which reads a broken body three times
  itself whatever its policy). A permanent error, or retries exhausted, is a `StorageError`
  naming the URI and the operation, scrubbed of credentials (scrub.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import random
import time
import uuid
from typing import Any, Callable, ClassVar, Iterable, Iterator, Protocol, TypeVar

from ckptlib._scrub import logger, scrub, scrub_exception
from ckptlib.errors import StorageError
from ckptlib.storage.base import check_relative
from ckptlib.storage.multipart import MultipartWriter, Upload
from ckptlib.storage.prefixed import PrefixedObjects, deletion_phases
from ckptlib.storage.transfer import OPTIONS, Transfer

log = logger(__name__)

T = TypeVar("T")

#: A delete that fails for some objects names this many of them, then how many failed in all.
SHOWN_FAILURES = 5
#: The `latest` pointer's content type.
POINTER_TYPE = "text/plain; charset=utf-8"


class Exists(Exception):
    """Raised by `ObjectClient.put(if_absent=True)` when an object is already there."""


class ObjectClient(Protocol):
    """What a cloud provides to `ObjectStorage`. Keys are full object names in the bucket or
    container. Every method may raise the SDK's own exceptions; `classify` tells them apart."""

    scheme: str  # "s3", "gs", "az": the URI scheme
    label: str  # "S3", "GCS", "Azure Blob": for messages
    sdk: Any  # the SDK client the calls go through (`ObjectStorage.client`)
    delete_batch: int  # how many keys one `delete` request takes
    writes_into: bool  # whether `get(into=...)` has the SDK write the answer in place (else a copy)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, content_type: str | None = None) -> None:
        """One-request upload; `Exists` when if_absent and an object is there."""

    def get(
        self, key: str, start: int, end: int | None, into: memoryview | None = None
    ) -> tuple[bytes | memoryview | None, int | None]:
        """Bytes [start, end] (inclusive; None: to the end) and the object size if known;
        (None, size) when start is at or past the end. `get(key, 0, None)` asks for no range.
        With `into` (end - start + 1 bytes) the response is written there (`IntoView`) and
        the data returned is the part of `into` it filled."""

    def size(self, key: str) -> int:
        """The object's size."""

    def has_objects(self, key_prefix: str) -> bool:
        """Whether any object's key starts with `key_prefix`."""

    def list(self, key_prefix: str) -> list[tuple[str, int]]:
        """Every (key, size) whose key starts with `key_prefix`."""

    def list_prefixes(self, key_prefix: str) -> list[str]:
        """The '/'-delimited sub-prefixes directly below `key_prefix` (with trailing '/')."""

    def delete(self, keys: list[str]) -> list[tuple[str, str]]:
        """Remove up to `delete_batch` objects; absent ones are not an error. A request that
        fails raises; failures the service reports per key in its answer are returned as
        (key, reason)."""

    def start_upload(self, key: str) -> Upload:
        """Begin a multipart upload of `key` (no object is visible until it completes)."""

    def abort_uploads(self, key_prefix: str) -> None:
        """Best effort: forget unfinished multipart uploads below `key_prefix` (a crashed writer's)."""

    def classify(self, exc: BaseException) -> str:
        """'missing' (no such object), 'transient' (worth another try) or 'permanent'."""

    def describe(self, exc: BaseException) -> str:
        """A one-line account of an SDK error (code, HTTP status, hint); scrubbed by the caller."""

    def secrets(self) -> Iterable[str]:
        """Credential strings to scrub beyond those in the environment (scrub.environment_secrets)."""


class IntoView:
    """A write-only stream over a caller's buffer, for SDKs that download into a file object:
    each response chunk is copied straight into place. More bytes than the buffer holds (the
    service ignored the range) is an error, never a silent truncation."""

    def __init__(self, view: memoryview):
        self.view = view
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> int:
        n = memoryview(data).nbytes
        if self.pos + n > self.view.nbytes:
            raise ValueError(f"the response holds more than the {self.view.nbytes} bytes asked for")
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n

    def filled(self) -> memoryview:
        return self.view[: self.pos]


class ObjectStorage(PrefixedObjects):
    """Objects below `<scheme>://container/prefix`, through the `ObjectClient` that the
    subclass's `_new_api` makes on first use (and again after unpickling). Transfer settings
    not given default to the subclass's `DEFAULTS` table and must lie in its ranges."""

    DEFAULTS: ClassVar[Transfer]

    def __init__(
        self,
        scheme: str,
        container: str,
        prefix: str = "",
        *,
        multipart_threshold: int | None = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        read_chunk_size: int | None = None,
        max_attempts: int | None = None,
        backoff_base: float = 0.1,
        backoff_cap: float = 8.0,
    ):
        given = {
            "multipart_threshold": multipart_threshold,
            "part_size": part_size,
            "max_concurrency": max_concurrency,
            "read_chunk_size": read_chunk_size,
            "max_attempts": max_attempts,
        }
        options = {name: self.DEFAULTS.defaults()[name] if value is None else value for name, value in given.items()}
        self.DEFAULTS.check(options)
        self.scheme = scheme
        self.container = container
        prefix = (prefix or "").strip("/")
        if prefix:
            check_relative(prefix, self._base_uri())
        self.prefix = prefix
        self.uri = f"{self._base_uri()}/{prefix}" if prefix else self._base_uri()
        self.multipart_threshold = options["multipart_threshold"]
        self.part_size = options["part_size"]
        self.max_concurrency = options["max_concurrency"]
        self.read_chunk_size = options["read_chunk_size"]
        self.max_attempts = options["max_attempts"]
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._api: ObjectClient | None = None

    def _base_uri(self) -> str:
        """The URI of the bucket or container itself."""
        return f"{self.scheme}://{self.container}"

    def _options(self) -> dict[str, Any]:
        """The transfer settings, as keyword arguments of the constructor."""
        return {name: getattr(self, name) for name in (*OPTIONS, "backoff_base", "backoff_cap")}

    def _new_api(self) -> ObjectClient:
        raise NotImplementedError

    @property
    def api(self) -> ObjectClient:
        """The backend's `ObjectClient`, made on first use."""
        if self._api is None:
            self._api = self._new_api()
        return self._api

    @property
    def client(self) -> Any:
        """The SDK client requests go through (boto3's S3 client, google.cloud.storage.Client,
        azure's BlobServiceClient)."""
        return self.api.sdk

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_api"] = None  # SDK clients do not pickle; the copy makes its own
        state["_sdk"] = None
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def part_size_of(self, number: int) -> int:
        """The size of part `number` of a stream (see Transfer.part_size_of)."""
        return self.DEFAULTS.part_size_of(self.part_size, number)

    # -- calls ---------------------------------------------------------------------------
    def error(self, exc: BaseException, op: str, where: str, attempts: int = 1) -> StorageError:
        """A StorageError naming the operation and URI; credentials scrubbed from it and from
        `exc` (which it chains)."""
        if isinstance(exc, StorageError):
            return exc
        api = self.api
        secrets = list(api.secrets())
        text = f"{api.label} {op} failed for {where}: {api.describe(exc)}"
        if attempts > 1:
            text += f" (gave up after {attempts} attempts)"
        scrub_exception(exc, secrets)
        return StorageError(scrub(text, secrets), path=where)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed try `attempt` (1-based): backoff_base doubled per try,
        at most backoff_cap, times a jitter in [0.5, 1.0] (concurrent clients spread out)."""
        return min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def call(self, op: str, where: str, fn: Callable[[], T], *, absent_ok: bool = False) -> T:
        """Run `fn` (one request), again after a back-off while it fails transiently, up to
        max_attempts tries. A missing object is a FileNotFoundError when `absent_ok` (reads),
        else a StorageError; `Exists` and StorageErrors pass unchanged."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except (FileNotFoundError, Exists, StorageError):
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                kind = self.api.classify(exc)
                if kind == "missing" and absent_ok:
                    scrub_exception(exc, self.api.secrets())
                    raise FileNotFoundError(f"{where}: no such object") from exc
                if kind == "transient" and attempt < self.max_attempts:
                    delay = self.backoff(attempt)
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
        clone.uri = f"{self._base_uri()}/{clone.prefix}"
        return clone

    def exists(self) -> bool:
        return bool(self.call("list", self.uri, lambda: self.api.has_objects(self._dir())))

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        key = self._key(path)
        limit = self.DEFAULTS.max_put_size
        if limit is not None and len(data) > limit:  # beyond one request: a multipart upload is atomic too
            with self.open_writer(path) as stream:
                stream.write(data)
            return
        body = bytes(data)
        self.call("put", self._where(path), lambda: self.api.put(key, body))

    def sync(self, paths: Iterable[str], names_only: Iterable[str] = ()) -> None:
        """Nothing to do: a completed upload is durable."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Put `data` only if no object is at `path` (see base.SupportsCreateExclusive)."""
        key = self._key(path)
        where = self._where(path)
        body = bytes(data)
        for _ in range(4):
            try:
                self.call("conditional put", where, lambda: self.api.put(key, body, if_absent=True))
                return True
            except Exists:
                pass
            # Taken, perhaps by this very call (a retried put whose first response was lost):
            # the caller's data is unique (a lock token), so equal bytes mean the object is ours.
            try:
                return bytes(self.read(path)) == body
            except FileNotFoundError:
                continue  # deleted meanwhile: try again
        raise StorageError(
            f"{self.api.label} conditional put failed for {where}: kept racing with concurrent writers", path=where
        )

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[MultipartWriter]:
        writer = MultipartWriter(self, self._key(path), self._where(path))
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.finish()

    @property
    def writes_into(self) -> bool:  # type: ignore[override]
        return self.api.writes_into

    def _get(
        self, key: str, where: str, start: int, end: int | None, into: memoryview | None = None
    ) -> tuple[bytes | memoryview | None, int | None]:
        if into is None:
            return self.call("get", where, lambda: self.api.get(key, start, end), absent_ok=True)
        return self.call("get", where, lambda: self.api.get(key, start, end, into=into), absent_ok=True)

    def _head(self, key: str, where: str) -> int:
        return self.call("head", where, lambda: self.api.size(key), absent_ok=True)

    def _list_keys(self, key_prefix: str) -> dict[str, int]:
        return dict(self.call("list", self.uri, lambda: self.api.list(key_prefix)))

    def _listed(self, rel: str) -> bool:
        return super()._listed(rel) and not is_upload_part(rel)

    def list_top(self) -> dict[str, int]:
        """`SupportsShallowList`: one '/'-delimited listing (a client without `list_top` lists
        everything below the root and keeps the top level)."""
        base = self._dir()
        lister = getattr(self.api, "list_top", None)
        if lister is None:
            return {rel: size for rel, size in self.list().items() if "/" not in rel}
        out: dict[str, int] = {}
        for key, size in self.call("list", self.uri, lambda: lister(base)):
            rel = key[len(base) :]
            if self._listed(rel) and "/" not in rel:
                out[rel] = size
        return out

    def list_children(self) -> list[str]:
        base = self._dir()
        names = set()
        for common in self.call("list", self.uri, lambda: self.api.list_prefixes(base)):
            name = common[len(base) :].rstrip("/")
            if name and name not in (".", ".."):
                names.add(name)
        return sorted(names)

    def delete(self, paths: Iterable[str]) -> None:
        self._delete_keys(list(dict.fromkeys(self._key(p) for p in paths)))

    def _delete_keys(self, keys: list[str]) -> None:
        """Delete `keys` (below this root) in requests of the client's batch size, run by a
        bounded pool. A failed request raises its StorageError (the first one); objects the
        service reports it could not delete are one StorageError naming them."""
        if not keys:
            return
        api = self.api
        size = max(1, api.delete_batch)
        batches = [keys[i : i + size] for i in range(0, len(keys), size)]

        def run(batch: list[str]) -> list[tuple[str, str]]:
            where = self._where(batch[0][len(self._dir()) :]) if len(batch) == 1 else self.uri
            try:
                return self.call("delete", where, lambda: api.delete(batch), absent_ok=True)
            except FileNotFoundError:
                return []

        if len(batches) == 1:
            reports = [run(batches[0])]
        else:
            workers = min(self.max_concurrency, len(batches))
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix=f"ckptlib-{self.scheme}-del"
            ) as pool:
                futures = [pool.submit(run, batch) for batch in batches]
                concurrent.futures.wait(futures)
            for future in futures:
                if future.exception() is not None:
                    raise future.exception()
            reports = [future.result() for future in futures]
        failures = [f"{key}: {reason}".strip() for report in reports for key, reason in report]
        if failures:
            shown = "; ".join(failures[:SHOWN_FAILURES])
            if len(failures) > SHOWN_FAILURES:
                shown += f" ... ({len(failures)} in all)"
            text = f"{api.label} delete failed for {len(failures)} object(s) under {self.uri}: {shown}"
            raise StorageError(scrub(text, api.secrets()), path=self.uri)

    def delete_tree(self, name: str = "") -> None:
        target = self.child(name) if name else self
        base = target._dir()
        # Committed-looking objects first (LocalStorage renames the directory away first instead).
        for batch in deletion_phases(list(self._list_keys(base))):
            target._delete_keys(batch)
        try:
            self.api.abort_uploads(base)
        except Exception as exc:  # noqa: BLE001 - best effort: the objects are gone, which is what counts
            log.debug("%s: cannot abort pending uploads: %s", target.uri, self.api.describe(exc))

    def set_pointer(self, name: str, target: str) -> None:
        key = self._key(name)
        check_relative(target, self.uri)
        body = target.encode("utf-8")
        self.call("put pointer", self._where(name), lambda: self.api.put(key, body, content_type=POINTER_TYPE))

    def read_pointer(self, name: str) -> str | None:
        key = self._key(name)
        where = self._where(name)
        try:
            data, _ = self.call("get pointer", where, lambda: self.api.get(key, 0, None), absent_ok=True)
        except FileNotFoundError:
            return None
        try:
            return (data or b"").decode("utf-8").strip().rstrip("/")
        except UnicodeDecodeError as exc:
            raise StorageError(f"{where}: pointer object is not UTF-8 text", path=where) from exc


#: Marks the temporary objects a backend without native multipart (GCS) keeps parts in until
#: they are joined; `list` never shows them, `delete_tree` removes leftovers.
UPLOAD_PART_MARK = ".ckptlib-part-"


def is_upload_part(path: str) -> bool:
    return UPLOAD_PART_MARK in path.rsplit("/", 1)[-1]


def new_token() -> str:
    return uuid.uuid4().hex[:16]
