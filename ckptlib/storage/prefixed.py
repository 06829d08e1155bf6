"""The key-space half of `ObjectStorage` (objects.py), above its requests: keys below a prefix,
ranged reads split into parallel GETs, listing, and the order a tree is deleted in."""

from __future__ import annotations

import concurrent.futures

from ckptlib.storage.base import DELETE_FIRST, check_list_prefix, check_relative


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
        # Chunks that came back short, as the object size each implies: the size the service
        # reported, else where the chunk's bytes ended (the smallest such end is the size).
        short: list[int] = []

        def fetch(rel: int, n: int) -> None:
            data, total = self._get(key, where, offset + rel, offset + rel + n - 1)
            if data is None or len(data) != n:
                short.append(total if total is not None else offset + rel + len(data or b""))
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
            raise EOFError(f"{where}: wanted {length} bytes at offset {offset}, object holds {min(short)}")
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


def deletion_phases(keys: list[str]) -> list[list[str]]:
    """`keys` in the batches a tree is deleted in, non-empty, in order: what makes a directory
    look committed first (DELETE_FIRST), so a failure half-way leaves an incomplete-looking
    directory, never a committed one with files missing."""

    def rank(key: str) -> int:
        leaf = key.rsplit("/", 1)[-1]
        return DELETE_FIRST.index(leaf) if leaf in DELETE_FIRST else len(DELETE_FIRST)

    phases = [[k for k in keys if rank(k) == phase] for phase in range(len(DELETE_FIRST) + 1)]
    return [batch for batch in phases if batch]
