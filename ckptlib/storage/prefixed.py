"""What the object-store backends (`S3Storage`; `ObjectStorage` for GCS and Azure) share above
their own requests: keys below a prefix, ranged reads split into parallel GETs, listing, the
order a tree is deleted in, and transfer sizes from the environment."""

from __future__ import annotations

import concurrent.futures
import os

from ..errors import StorageError
from .base import DELETE_FIRST, check_relative

TRANSFER_OPTIONS = ("multipart_threshold", "part_size", "max_concurrency", "read_chunk_size", "max_attempts")


class PrefixedObjects:
    """Objects below `uri` (`<scheme>://container/prefix`), whose keys start with `prefix`.
    A subclass sets `scheme`, `uri`, `prefix`, `read_chunk_size` and `max_concurrency`, and
    supplies the requests: `_get`, `_head` and `_list_keys`."""

    scheme: str
    uri: str
    prefix: str
    read_chunk_size: int
    max_concurrency: int

    def _get(self, key: str, where: str, start: int, end: int | None) -> tuple[bytes | None, int | None]:
        """Bytes [start, end] (end inclusive, None: to the end) and the object size if known;
        data is None when `start` lies at or past the end. FileNotFoundError if absent."""
        raise NotImplementedError

    def _head(self, key: str, where: str) -> object:
        """Check that the object is there; FileNotFoundError if absent."""
        raise NotImplementedError

    def _list_keys(self, key_prefix: str) -> dict[str, int]:
        """Every key starting with `key_prefix`, mapped to its size."""
        raise NotImplementedError

    # -- keys ----------------------------------------------------------------------------
    def _key(self, path: str) -> str:
        check_relative(path, self.uri)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _dir(self) -> str:
        """The key prefix of everything below the root (with the '/': step_1 must not match step_10)."""
        return f"{self.prefix}/" if self.prefix else ""

    def _where(self, path: str = "") -> str:
        return f"{self.uri}/{path}" if path else self.uri

    def local_path(self, path: str = "") -> None:
        if path:
            check_relative(path, self.uri)
        return None

    # -- reads ---------------------------------------------------------------------------
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) by ranged GET; a range over 2 * read_chunk_size is
        fetched as parallel chunk GETs into one buffer and returned as a bytearray (no second
        copy). FileNotFoundError: no such key; EOFError: the object is shorter."""
        key = self._key(path)
        where = self._where(path)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"{where}: negative offset or length ({offset}, {length})")
        if length == 0:
            self._head(key, where)  # FileNotFoundError like a local open()
            return b""
        if length is None:
            data, _total = self._get(key, where, offset, None)
            return data if data is not None else b""
        if length > 2 * self.read_chunk_size and self.max_concurrency > 1:
            return self._parallel_read(key, where, offset, length)
        data, total = self._get(key, where, offset, offset + length - 1)
        if data is None or len(data) != length:
            got = 0 if data is None else len(data)
            raise EOFError(
                f"{where}: wanted {length} bytes at offset {offset}, "
                f"object holds {total if total is not None else offset + got}"
            )
        return data

    def _parallel_read(self, key: str, where: str, offset: int, length: int) -> bytearray:
        """Split a large range into read_chunk_size ranged GETs run by a bounded pool."""
        out = bytearray(length)
        chunk = self.read_chunk_size
        spans = [(a, min(chunk, length - a)) for a in range(0, length, chunk)]
        short: list[int | None] = []

        def fetch(rel: int, n: int) -> None:
            data, total = self._get(key, where, offset + rel, offset + rel + n - 1)
            if data is None or len(data) != n:
                short.append(total)
                return
            out[rel : rel + n] = data

        workers = min(self.max_concurrency, len(spans))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"ckptlib-{self.scheme}-read") as pool:
            futures = [pool.submit(fetch, a, n) for a, n in spans]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
        if short:
            sizes = [s for s in short if s is not None]
            held = min(sizes) if sizes else "fewer bytes"
            raise EOFError(f"{where}: wanted {length} bytes at offset {offset}, object holds {held}")
        return out

    # -- listing -------------------------------------------------------------------------
    def _listed(self, rel: str) -> bool:
        """Whether the object at `rel` (below the root) is one `list` shows: not the root
        itself, not a console-made "directory" marker object."""
        return bool(rel) and not rel.endswith("/")

    def list(self, prefix: str = "") -> dict[str, int]:
        if prefix:
            check_list_prefix(prefix, self.uri)
        base = self._dir()
        out: dict[str, int] = {}
        for key, size in self._list_keys(base + prefix).items():
            rel = key[len(base) :]
            if self._listed(rel):
                out[rel] = size
        return out


def check_list_prefix(prefix: str, root_uri: str) -> None:
    """A list prefix may end mid-name ('__0', 'step_') or with '/', but never climbs out."""
    if prefix.startswith("/") or "\\" in prefix:
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)
    parts = prefix.split("/")
    if any(p in (".", "..") for p in parts) or any(p == "" for p in parts[:-1]):
        raise StorageError(f"list prefix {prefix!r} escapes the checkpoint root {root_uri}", path=root_uri)


def deletion_phases(keys: list[str]) -> list[list[str]]:
    """`keys` in the batches a tree is deleted in, non-empty, in order: what makes a directory
    look committed first (DELETE_FIRST), so a failure half-way leaves an incomplete-looking
    directory, never a committed one with files missing."""

    def rank(key: str) -> int:
        leaf = key.rsplit("/", 1)[-1]
        return DELETE_FIRST.index(leaf) if leaf in DELETE_FIRST else len(DELETE_FIRST)

    phases = [[k for k in keys if rank(k) == phase] for phase in range(len(DELETE_FIRST) + 1)]
    return [batch for batch in phases if batch]


def env_options(scheme: str, options: tuple[str, ...] = TRANSFER_OPTIONS) -> dict[str, int]:
    """Transfer sizes from CKPTLIB_<SCHEME>_<OPTION> (e.g. CKPTLIB_GS_PART_SIZE), for each of `options`."""
    out = {}
    for option in options:
        name = f"CKPTLIB_{scheme.upper()}_{option.upper()}"
        raw = os.environ.get(name)
        if raw:
            try:
                out[option] = int(raw)
            except ValueError:
                raise StorageError(f"{name}={raw!r} is not an integer") from None
    return out
