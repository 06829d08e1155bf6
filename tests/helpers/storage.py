"""Test helpers for the object-store backends: every request an `ObjectStorage` makes, recorded
and, on demand, failed, at the seam every backend shares (its `ObjectClient`), with each SDK's
own exceptions; and the shared back-off's sleeps recorded instead of slept.

    faults = Faults.install(monkeypatch, store)     # every client of that backend class, from now on
    faults.fail("put", permanent_error(backend), when=lambda key, n: key.endswith("/ckptlib.json"))
    ...
    faults.count("put_part")
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable

from ckptlib.storage import objects

#: How each backend names itself in messages.
LABELS = {"s3": "S3", "gcs": "GCS", "azure": "Azure Blob"}

#: The client's requests (and an upload's), as `Faults` names them.
REQUESTS = (
    "put",
    "get",
    "size",
    "has_objects",
    "list",
    "list_top",
    "list_prefixes",
    "delete",
    "start_upload",
    "abort_uploads",
)
UPLOAD_REQUESTS = ("put_part", "complete", "abort")


def transient_error() -> Exception:
    """A connection reset: every backend classifies it as transient."""
    return ConnectionResetError("connection reset by peer (injected)")


def permanent_error(backend: str) -> Exception:
    """A 403 in the backend's SDK's own exception type: permanent everywhere."""
    if backend == "s3":
        from botocore.exceptions import ClientError

        reply = {
            "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }
        return ClientError(reply, "Injected")
    if backend == "gcs":
        from google.api_core.exceptions import Forbidden

        return Forbidden("Access denied (injected)")
    from azure.core.exceptions import ClientAuthenticationError

    return ClientAuthenticationError(message="Server failed to authenticate the request (injected)")


class Faults:
    """Records the requests of every client of one `ObjectStorage` class and raises injected
    errors for those a rule picks. `calls` holds (request, key) in order; the key is the first
    argument (a key, a key prefix, a list of keys for delete, the part number for put_part), for
    get all three: (key, start, end). A retried request is recorded once per try."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.rules: list[tuple[str, Callable[[Any, int], bool], Callable[[], BaseException]]] = []
        self.injected: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    @classmethod
    def install(cls, monkeypatch, storage: objects.ObjectStorage) -> "Faults":
        """Wrap every client `type(storage)` makes from now on (and `storage`'s own)."""
        faults = cls()
        backend = type(storage)
        original = backend._new_api
        monkeypatch.setattr(backend, "_new_api", lambda self: _Client(original(self), faults))
        storage._api = None
        return faults

    def fail(self, request: str, error: BaseException | Callable[[], BaseException], when=None, times=None) -> None:
        """Raise `error` (or what it makes) for `request`s where `when(key, n)` holds (n: that
        request's count so far, from 1; default: always), at most `times` times. Request "*":
        any request, n counting all of them. The request is failed before it is sent."""
        left = [times]

        def pick(key: Any, n: int) -> bool:
            if left[0] is not None and left[0] <= 0:
                return False
            if when is not None and not when(key, n):
                return False
            if left[0] is not None:
                left[0] -= 1
            return True

        make = error if callable(error) and not isinstance(error, BaseException) else (lambda: error)
        self.rules.append((request, pick, make))

    def count(self, request: str) -> int:
        return sum(1 for name, _ in self.calls if name == request)

    def keys(self, request: str) -> list[Any]:
        return [key for name, key in self.calls if name == request]

    def names(self) -> list[str]:
        """The requests in order, a request's tries one after another counted once (an
        emulator that drops a connection under load makes a retry the test did not ask for)."""
        out: list[tuple[str, Any]] = []
        for call in self.calls:
            if not out or out[-1] != call:
                out.append(call)
        return [name for name, _ in out]

    def _record(self, request: str, key: Any) -> None:
        with self._lock:
            self.calls.append((request, key))
            n = self.count(request)
            for name, pick, make in self.rules:
                if name in ("*", request) and pick(key, len(self.calls) if name == "*" else n):
                    self.injected.append((request, key))
                    raise make()


class _Client:
    """An ObjectClient that records each request in `Faults` before passing it on."""

    def __init__(self, real: Any, faults: Faults):
        self._real = real
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in REQUESTS:
            return attr

        def request(*args, **kwargs):
            self._faults._record(name, tuple(args) if name == "get" else args[0] if args else None)
            result = attr(*args, **kwargs)
            return _Upload(result, self._faults) if name == "start_upload" else result

        return request


class _Upload:
    def __init__(self, real: Any, faults: Faults):
        self._real = real
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in UPLOAD_REQUESTS:
            return attr

        def request(*args, **kwargs):
            self._faults._record(name, args[0] if name == "put_part" else None)
            return attr(*args, **kwargs)

        return request


class JitterAt:
    """Stands in for `random` in ckptlib.storage.objects: uniform() returns the low or the high
    end of its range, so back-off delays are exact and a test sees the range's ends."""

    def __init__(self, end: str):
        self.end = end

    def uniform(self, a: float, b: float) -> float:
        return min(a, b) if self.end == "low" else max(a, b)


#: The back-off's jitter range: [0.5, 1.0] x the base delay.
JITTER = {"low": 0.5, "high": 1.0}


def record_sleeps(monkeypatch, end: str = "high") -> list[float]:
    """The shared back-off's sleeps, recorded instead of slept, with the jitter at `end`."""
    sleeps: list[float] = []
    monkeypatch.setattr(objects, "time", types.SimpleNamespace(sleep=sleeps.append))
    monkeypatch.setattr(objects, "random", JitterAt(end))
    return sleeps


#: The LocalStorage calls a remote that is "down" fails (every read, listing and write).
DOWN_CALLS = ("read", "write", "list", "list_children", "exists", "read_pointer", "create_exclusive", "open_writer")


def local_remote_down(monkeypatch, uri: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(take_down, bring_up) for a directory remote at `uri`: while down, every LocalStorage call
    under it raises StorageError ("connection refused"), as an unreachable endpoint would."""
    import ckptlib.storage.local as local_storage
    from ckptlib.errors import StorageError

    down: list[int] = []
    for name in DOWN_CALLS:
        real = getattr(local_storage.LocalStorage, name)

        def failing(self, *args, _real=real, **kwargs):
            if down and self.uri.startswith(uri):
                raise StorageError(f"{self.uri}: injected: connection refused")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(local_storage.LocalStorage, name, failing)
    return lambda: down.append(1), down.clear


def remote_that_goes_down(
    request, tmp_path, monkeypatch, kind: str
) -> tuple[str, Callable[[], None], Callable[[], None]]:
    """(remote URI, take_down(), bring_up()) of `kind`: "s3", an S3 remote behind a fault proxy
    (one attempt per request), or "local", a directory remote whose storage calls fail."""
    if kind == "s3":
        proxy = request.getfixturevalue("fault_proxy")(request.getfixturevalue("s3_server"))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        monkeypatch.setenv("CKPTLIB_S3_MAX_ATTEMPTS", "1")
        return request.getfixturevalue("s3_root"), lambda: proxy.cut_after(0), proxy.restore
    uri = str(tmp_path / "remote")
    return (uri, *local_remote_down(monkeypatch, uri))


#: The LocalStorage calls that change a directory remote (a cut falls before one of them).
CHANGING_CALLS = ("write", "create_exclusive", "open_writer", "delete", "delete_tree", "set_pointer")


class LocalCut:
    """A directory remote whose connection is cut after a number of changes: `cut_after(n)` lets
    the next `n` changing calls (`CHANGING_CALLS`) under the remote succeed, then every call
    under it (reads too) raises StorageError ("connection reset") until `restore()`;
    `changes` counts the changing calls made so far (to find every point of an operation)."""

    def __init__(self, monkeypatch, uri: str):
        import ckptlib.storage.local as local_storage
        from ckptlib.errors import StorageError

        self.uri = uri
        self.changes = 0
        self.budget: int | None = None
        self.down = False
        for name in dict.fromkeys((*DOWN_CALLS, *CHANGING_CALLS)):
            real = getattr(local_storage.LocalStorage, name)

            def call(storage, *args, _real=real, _name=name, **kwargs):
                if storage.uri.startswith(uri):
                    self._before(_name, storage.uri, StorageError)
                return _real(storage, *args, **kwargs)

            monkeypatch.setattr(local_storage.LocalStorage, name, call)

    def _before(self, name: str, where: str, error) -> None:
        if not self.down and name in CHANGING_CALLS:
            if self.budget is not None and self.budget <= 0:
                self.down = True
            else:
                self.changes += 1
                if self.budget is not None:
                    self.budget -= 1
        if self.down:
            raise error(f"{where}: injected: connection reset by peer")

    def cut_after(self, n: int) -> None:
        self.budget, self.down = n, False

    def restore(self) -> None:
        self.budget, self.down = None, False
