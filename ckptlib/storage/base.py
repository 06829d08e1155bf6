"""The storage seam: where checkpoint bytes live, independent of what they mean.

A `Storage` is rooted at a local directory (`local.LocalStorage`) or at a key prefix in an
object store: S3, GCS or Azure Blob, each an `ObjectClient` under the one shared
implementation (`objects.ObjectStorage`). Paths passed to it are relative, '/'-separated, and
never escape the root. Optional capabilities are the `Supports*` protocols below.
"""

from __future__ import annotations

from typing import BinaryIO, ContextManager, Iterable, Protocol, runtime_checkable

from ckptlib.errors import StorageError

# What makes a directory look committed (ckptlib's manifest, then DCP's metadata; the names
# `ckptlib.format.native.manifest` gives them). A backend that deletes a tree object by object
# removes these first, so an interrupted deletion never leaves a committed-looking directory
# with files missing.
DELETE_FIRST = ("ckptlib.json", ".metadata")


@runtime_checkable
class Storage(Protocol):
    """What every backend provides. Small on purpose: DCP layout lives in ckptlib.format."""

    uri: str

    def child(self, name: str) -> "Storage":
        """The storage rooted at `name` below this one."""

    def exists(self) -> bool:
        """Whether the root itself exists (a directory, or any object under the prefix)."""

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        """Write a whole object atomically: readers see the old bytes or the new, never a part.

        durable=False: a crash (power loss) before a later `sync` covering it may lose the
        object, never tear it; for markers whose loss is harmless and files a commit syncs."""

    def open_writer(self, path: str) -> ContextManager[BinaryIO]:
        """A stream for a large object. When the context exits cleanly its bytes are durable
        (fsynced/uploaded); its name is once a `sync` covers it."""

    def sync(self, paths: Iterable[str], names_only: Iterable[str] = ()) -> None:
        """Before something that refers to them is published: make `paths` durable, bytes
        and names, and of `names_only` (objects whose bytes their writer already made
        durable, `open_writer`) the names (local: fsync each of `paths`, then each directory
        involved once; object stores: nothing to do, a completed upload is durable)."""

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of an object; FileNotFoundError if it is absent."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object below the root whose path starts with `prefix`, mapped to its size."""

    def list_children(self) -> list[str]:
        """Names directly below the root that hold objects (sub-directories / sub-prefixes)."""

    def delete(self, paths: Iterable[str]) -> None:
        """Remove objects; absent ones are ignored."""

    def delete_tree(self, name: str = "") -> None:
        """Remove everything below `name` (the whole root when empty)."""

    def set_pointer(self, name: str, target: str) -> None:
        """Atomically make pointer `name` refer to the child `target`."""

    def read_pointer(self, name: str) -> str | None:
        """The child a pointer refers to, or None when there is no pointer."""

    def local_path(self, path: str = "") -> str | None:
        """A filesystem path for `path` when the backend is a local filesystem, else None."""


@runtime_checkable
class SupportsCreateExclusive(Protocol):
    """Optional for backends: create an object only if nothing is there yet (used for the
    checkpoint root's writer lock, `ckptlib.manager.manager`). Kept out of `Storage` so backends
    without it still satisfy the protocol; without it the lock is best effort.

    Local: link(2) of a fully written temporary file (O_CREAT|O_EXCL where links are not
    supported). Object stores: a conditional put (S3: `If-None-Match: *`, where HTTP 412 means
    the object exists and 409 ConditionalRequestConflict is retried; GCS: `ifGenerationMatch=0`;
    Azure: `If-None-Match: *`); an object already there holding exactly `data` is this call's
    own (a retried put whose first answer was lost).
    """

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` iff no object is there; True if this call created it, False if
        one already existed. Atomic: of concurrent callers at most one gets True, and readers
        never see a partial object."""


@runtime_checkable
class SupportsShallowList(Protocol):
    """Optional for backends: the objects directly below the root, not those in sub-directories
    (local: one scandir; object stores: one '/'-delimited listing), so telling what a directory
    is (a checkpoint, or not) never walks a large tree below it."""

    def list_top(self) -> dict[str, int]:
        """Every object directly below the root (no '/' in its name), mapped to its size."""


def list_top(storage: Storage) -> dict[str, int]:
    """`storage.list_top()` where the backend supports it, else the top-level part of `list()`."""
    if isinstance(storage, SupportsShallowList):
        return storage.list_top()
    return {name: size for name, size in storage.list().items() if "/" not in name}


@runtime_checkable
class SupportsDirectReads(Protocol):
    """Optional for backends whose objects are plain local files: a reader may read such a file
    itself (`os.preadv` straight into tensor memory) instead of through `read`.

    `direct_read_path` returns None whenever reads must go through `read` after all (a
    subclass or a test that wraps `read` for fault injection or instrumentation)."""

    def direct_read_path(self, path: str) -> str | None:
        """The local file whose bytes `read(path, ...)` returns, or None."""


@runtime_checkable
class SupportsFileRoot(Protocol):
    """Optional for backends whose root may be a single file rather than a directory (a local
    path to a torch.save or safetensors file, which `ckptlib.format.source` reads)."""

    def is_file(self) -> bool:
        """Whether the root is a file."""


def root_is_file(storage: Storage) -> bool:
    """Whether `storage` is rooted at a single file (see SupportsFileRoot)."""
    return isinstance(storage, SupportsFileRoot) and bool(storage.is_file())


def check_relative(path: str, root_uri: str) -> str:
    """Reject paths that would escape the storage root (absolute, '..', empty parts)."""
    if not isinstance(path, str) or path == "":
        raise StorageError(f"invalid empty path below {root_uri}", path=root_uri)
    if path.startswith("/") or "\\" in path:
        raise StorageError(f"path {path!r} escapes the checkpoint root {root_uri}", path=root_uri)
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"path {path!r} escapes the checkpoint root {root_uri}", path=root_uri)
    return path


def check_list_prefix(prefix: str, root_uri: str) -> None:
    """A list prefix may end mid-name ('__0', 'step_') or with '/', but never climbs out."""
    if prefix.startswith("/") or "\\" in prefix:
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)
    parts = prefix.split("/")
    if any(p in (".", "..") for p in parts) or any(p == "" for p in parts[:-1]):
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)
