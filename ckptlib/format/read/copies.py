"""Where a load reads each file of a checkpoint from: this rank's copies of it, in order.

Contract of `ckptlib.loading.loading.load(uri, state, ..., copies=..., info=...)` (the entry point of
the cluster tier, which keeps node-local copies, peer replicas and a remote):

``copies``
    Each rank passes its own `Copies`: the copies of the checkpoint directory it can read, in
    the order it prefers them. One copy is ``Copy(label, storage, files=None, key=None)``:

    - ``storage``: a Storage rooted at that copy of the checkpoint directory (the directory of
      ``ckptlib.json``, ``.metadata`` and the shard files, or of some of them);
    - ``files``: the names (as the manifest lists them, e.g. ``__3_0.distcp``) of the files this
      copy holds; None: every file. A rank reads a file only from the copies that list it, so a
      node-local root lists just the files on that node;
    - ``label``: where the copy is, for the accounting and the messages: "local", "replica",
      "remote" or any short name (`LoadResult.bytes_by_source` sums the bytes read per label);
    - ``key``: what identifies the copy's bytes across ranks (default: ``storage.uri``). Ranks
      whose copies share a key read the same bytes: node-local roots mounted at the same path
      on different nodes need different keys (e.g. ``f"node{K}:{uri}"``);
    - ``cost``: how far the copy is, lower is nearer (default by label: "local" 0, "replica"
      1, "remote" 2, any other 1). Each item is read from the nearest copy ANY rank holds, by
      a rank holding it, and sent to the ranks that need it: with node-local copies intact, a
      load reads nothing from the remote, even the items a rank on another node needs.

    ``Copies.from_files({name: [(label, storage), ...]})`` gives the list per file instead. The
    ranks' copy sets may differ (each its own node's) and need not cover every file: an item
    of a file this rank has no copy of is read by a rank that has one and sent to it over the
    process group (`ckptlib.loading.read_exchange`); an item no rank can read is `NoCopyError` (a
    CheckpointNotFoundError) on every rank, naming the file and the ranks that need it.

Fallback
    Each item is read from the first copy of its file that has it intact. A missing file, a
    short read, a checksum mismatch against the manifest or a failing storage warns
    (`CopyFallbackWarning`, naming the bad copy and the next one) and the file's remaining
    items are read from the next copy. When every copy a rank holds fails, the load is retried
    with those copies excluded, so that a rank holding another copy (another key) reads the
    file's items and sends them; when no copy is left anywhere, `CopiesExhaustedError` (a
    CheckpointCorruptError; `CopiesMissingError`, also a CheckpointNotFoundError, when no copy
    holds the file at all) names the file and every copy tried, on every rank. A plain load
    (no ``copies``) reads from ``uri`` alone and raises today's errors unchanged.

``info``
    The checkpoint's manifest and ``.metadata``, so that the load does not read them: a
    `CheckpointInfo`, or their raw bytes ``(manifest_bytes, metadata_bytes)`` as read from any
    copy (``manifest_bytes`` None for a plain DCP checkpoint). Group rank 0 checks them (the
    ``.metadata`` checksum against the manifest, its structure) and broadcasts the result, so
    only rank 0's value counts (other ranks may pass None). Without ``info``, rank 0 reads them
    from the first of its copies that holds them intact, falling back like a shard file.
    ``uri`` only names the checkpoint (`LoadResult.uri`, messages) when ``copies`` are given.

Result
    `LoadResult.storage_bytes_read` (this rank), ``storage_bytes_read_by_rank``,
    ``bytes_by_source`` (per label, summed over ranks), ``bytes_received`` (this rank, over the
    process group) and ``bytes_needed`` (the stored items any rank's plan references, each
    counted once). Bytes are shard-file bytes; reading the manifest and ``.metadata`` is not
    counted.

Nothing on disk changes: a copy is an ordinary checkpoint directory, or part of one.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch.distributed.checkpoint.metadata import Metadata

from ckptlib.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CopiesExhaustedError,
    CopiesMissingError,
    CopyFallbackWarning,
    NoCopyError,
    StorageError,
    UnsafeCheckpointError,
    warn_scrubbed,
)
from ckptlib.format.native.file_names import describe_file
from ckptlib.format.native.layout import CheckpointInfo, open_checkpoint
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME, Manifest
from ckptlib.format.native.safe_pickle import safe_loads
from ckptlib.format.native.structure import structure_problems
from ckptlib.storage.base import Storage


def default_label(storage: Storage) -> str:
    """The label of a plain load's one copy: "local" on a filesystem, else "remote"."""
    return "local" if storage.local_path() is not None else "remote"


# How far a copy is, by label, when its Copy does not say (lower is nearer).
COSTS = {"local": 0, "replica": 1, "remote": 2}
OTHER_COST = 1


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy of a checkpoint directory that this rank can read (see the module)."""

    label: str
    storage: Storage
    files: frozenset[str] | None = None  # the files it holds; None: every file
    key: str | None = None  # identity across ranks; default storage.uri
    cost: int | None = None  # how far it is (lower: nearer); default COSTS by label

    def __post_init__(self):
        if self.files is not None and not isinstance(self.files, frozenset):
            object.__setattr__(self, "files", frozenset(self.files))
        if self.key is None:
            object.__setattr__(self, "key", self.storage.uri)
        if self.cost is None:
            object.__setattr__(self, "cost", COSTS.get(self.label, OTHER_COST))

    def holds(self, name: str) -> bool:
        return self.files is None or name in self.files


class Copies:
    """This rank's copies of a checkpoint, in preference order, and which of them hold each file."""

    def __init__(self, copies: Iterable[Copy | tuple], per_file: Mapping[str, Sequence[Copy]] | None = None):
        made = []
        for c in copies:
            if not isinstance(c, Copy) and not (
                isinstance(c, tuple) and 2 <= len(c) <= 4 and isinstance(c[0], str) and isinstance(c[1], Storage)
            ):
                raise StorageError(
                    f"copies=: expected Copy(label, storage, files=None, key=None) or a (label, storage) tuple, "
                    f"got {c!r}"
                )
            made.append(c if isinstance(c, Copy) else Copy(*c))
        self.copies: tuple[Copy, ...] = tuple(made)
        self._per_file = {name: tuple(found) for name, found in (per_file or {}).items()}

    @classmethod
    def single(cls, storage: Storage, label: str | None = None) -> "Copies":
        """A plain load: every file from `storage`."""
        return cls([Copy(label or default_label(storage), storage)])

    @classmethod
    def from_files(cls, mapping: Mapping[str, Sequence[tuple[str, Storage]]]) -> "Copies":
        """Copies given per file: {file name: [(label, storage), ...] in preference order}."""
        made: dict[tuple[str, str], Copy] = {}
        per_file = {
            name: [made.setdefault((label, storage.uri), Copy(label, storage)) for label, storage in found]
            for name, found in mapping.items()
        }
        return cls(made.values(), per_file)

    def for_file(self, name: str, excluded: frozenset[tuple[str, str]] = frozenset()) -> list[Copy]:
        """The copies of file `name`, in order, without those `excluded` ((key, name) pairs that failed)."""
        if self._per_file:
            found = self._per_file.get(name, ())
        else:
            found = tuple(c for c in self.copies if c.holds(name))
        return [c for c in found if (c.key, name) not in excluded]

    def access(
        self, names: Callable[[], Iterable[str]], excluded: frozenset[tuple[str, str]] = frozenset()
    ) -> tuple[dict[str, int], int | None]:
        """What this rank can read, compactly: (the cost of its nearest copy of each file where
        that is nearer than `default`; `default`: the cost of its nearest copy holding every
        file, or None). A file in neither has no copy here (left). `names()`: the checkpoint's
        files, asked for only when copies are given per file or some were excluded."""
        if self._per_file or excluded:
            costs = {}
            for name in names():
                found = self.for_file(name, excluded)
                if found:
                    costs[name] = min(c.cost for c in found)
            return costs, None
        default = min((c.cost for c in self.copies if c.files is None), default=None)
        costs = {}
        for copy in self.copies:
            if copy.files is not None and (default is None or copy.cost < default):
                for name in copy.files:
                    costs[name] = min(copy.cost, costs.get(name, copy.cost))
        return costs, default

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.label for c in self.copies))


# What makes a copy unusable (the next one is tried): it is missing, short, damaged or its
# storage fails. UnsafeCheckpointError (an intact object that needs arbitrary unpickling) is
# the checkpoint's, not the copy's, and is raised as it is.
COPY_FAILURES = (CheckpointCorruptError, StorageError, OSError, EOFError)


def problem_of(exc: BaseException, where: str) -> str:
    """What was wrong with a copy, without the path its message starts with ("missing" when the file is absent)."""
    if isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError):
        return "missing"
    text = str(exc)
    return text[len(where) + 2 :] if text.startswith(where + ": ") else text


def exhausted_error(name: str, tried: Sequence[tuple[Copy, BaseException]], rank: int | None = None):
    """CopiesExhaustedError (CopiesMissingError when no copy holds the file) naming every copy tried."""
    entries = [(c.label, f"{c.storage.uri}/{name}", problem_of(e, f"{c.storage.uri}/{name}")) for c, e in tried]
    shown = "; ".join(f"{label} {uri}: {problem}" for label, uri, problem in entries)
    cls = CopiesMissingError if all(p == "missing" for _, _, p in entries) else CopiesExhaustedError
    err = cls(f"every copy of {describe_file(name)} failed: {shown}", file=name, tried=entries, path=entries[0][1])
    err.failed_copies = [(c.key, name) for c, _ in tried]
    return err


def read_over_copies(
    reader: Any, name: str, pending: list[Any], attempt: Callable[[list[Any]], None], done: Callable[[Any], bool]
) -> None:
    """Run `attempt(pending)` on the reader with `reader.storage` set to each of its copies of
    file `name` in turn, until one succeeds; after a failed one, only the entries `done` says
    were not served yet are retried. Bytes read are counted per copy label."""
    chain = reader.copies.for_file(name, reader.excluded)
    if not chain:
        raise NoCopyError(f"{reader.storage.uri}: this rank has no copy of {describe_file(name)}", path=name)
    home, tried = reader.storage, []
    for index, copy in enumerate(chain):
        reader.storage = copy.storage
        before = reader.bytes_read
        try:
            attempt(pending)
            return
        except COPY_FAILURES as exc:
            if reader.plain:
                raise
            tried.append((copy, exc))
            where = f"{copy.storage.uri}/{name}"
            reader.unusable[(copy.key, name)] = (copy.label, where, problem_of(exc, where))
            pending = [entry for entry in pending if not done(entry)]
            if index + 1 < len(chain):
                nxt = chain[index + 1]
                warn_scrubbed(
                    f"the {copy.label} copy {where} is unusable ({problem_of(exc, where)}); reading "
                    f"{describe_file(name)} from the {nxt.label} copy {nxt.storage.uri}",
                    CopyFallbackWarning,
                )
        finally:
            reader.storage = home
            reader.bytes_by_source[copy.label] = reader.bytes_by_source.get(copy.label, 0) + reader.bytes_read - before
    raise exhausted_error(name, tried)


def as_copies(value, fallback: Storage) -> Copies:
    """`load(copies=...)`'s value as Copies: Copies, a sequence of Copy (or (label, storage[,
    files[, key]]) tuples), a {file: [(label, storage), ...]} mapping; None: `fallback` alone."""
    if value is None:
        return Copies.single(fallback)
    if isinstance(value, Copies):
        return value
    if isinstance(value, Mapping):
        return Copies.from_files(value)
    return Copies(value)


def open_from_copies(copies: Copies, *, verify: bool = True) -> CheckpointInfo:
    """What `layout.open_checkpoint` finds, from the first of `copies` holding the manifest and
    `.metadata` intact (the shard files are not listed: each copy may hold only some)."""
    chain = copies.for_file(MANIFEST_NAME) or copies.for_file(METADATA_NAME) or list(copies.copies)
    tried: list[tuple[Copy, BaseException]] = []
    for index, copy in enumerate(chain):
        try:
            return open_checkpoint(copy.storage, verify=verify, check_files=False)
        except (CheckpointError, OSError, EOFError) as exc:
            if isinstance(exc, UnsafeCheckpointError):
                raise
            tried.append((copy, exc))
            if index + 1 < len(chain):
                warn_scrubbed(
                    f"the {copy.label} copy {copy.storage.uri} is unusable ({exc}); reading the checkpoint's "
                    f"manifest from the {chain[index + 1].label} copy {chain[index + 1].storage.uri}",
                    CopyFallbackWarning,
                )
    if len(tried) == 1:
        raise tried[0][1]
    raise exhausted_error(MANIFEST_NAME, tried)


def info_from_bytes(uri: str, manifest_bytes: bytes | None, metadata_bytes: bytes, *, verify: bool = True):
    """A CheckpointInfo from the raw bytes of a checkpoint's manifest and `.metadata` (read by
    the caller from any copy), checked as `layout.open_checkpoint` checks a directory's, except
    that the shard files are not listed (each copy holds only some of them)."""
    manifest = None if manifest_bytes is None else Manifest.from_bytes(manifest_bytes, f"{uri}/{MANIFEST_NAME}")
    where = f"{uri}/{METADATA_NAME}"
    if manifest is not None and verify:
        record = manifest.files.get(METADATA_NAME)
        if record is None:
            raise CheckpointCorruptError(f"{where}: not listed in the manifest", path=where)
        if len(metadata_bytes) != record.size or zlib.crc32(metadata_bytes) != record.crc32:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch (size {len(metadata_bytes)} vs {record.size} in the manifest)", path=where
            )
    metadata = safe_loads(metadata_bytes, where)
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: holds {type(metadata).__name__}, not DCP Metadata", path=where)
    errors = [p for p in structure_problems(metadata, manifest, {}, exhaustive=False) if p.is_error]
    if manifest is None:  # without a manifest the sizes come from a listing, which there is not
        errors = [p for p in errors if p.kind == "unsafe"]
    if errors:
        cls = UnsafeCheckpointError if any(p.kind == "unsafe" for p in errors) else CheckpointCorruptError
        shown = "; ".join(p.text() for p in errors[:5])
        raise cls(f"{uri}: {METADATA_NAME} does not match the checkpoint's files: {shown}", path=where)
    return CheckpointInfo(uri=uri, kind="ckptlib" if manifest else "dcp", manifest=manifest, metadata=metadata)


__all__ = [
    "Copies",
    "Copy",
    "as_copies",
    "default_label",
    "exhausted_error",
    "info_from_bytes",
    "open_from_copies",
    "read_over_copies",
]
