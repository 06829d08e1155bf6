"""The key-space half of `ObjectStorage` (objects.py), above its requests: keys below a prefix,
ranged reads split into parallel GETs, listing, and the order a tree is deleted in."""

from __future__ import annotations

import concurrent.futures

from ckptlib.storage.base import DELETE_FIRST, check_list_prefix, check_relative

#: Ranged reads of at least this many bytes go into a buffer allocated once where the client
#: writes answers in place (`read`); smaller ones (manifests, pointers, item headers) return
#: the client's own bytes.
INTO_MIN = 1 << 20


class PrefixedObjects:
    """Objects below `uri` (`<scheme>://container/prefix`), whose keys start with `prefix`.
    A subclass sets `scheme`, `uri`, `prefix`, `read_chunk_size` and `max_concurrency`, and
    supplies the requests: `_get`, `_head` and `_list_keys`."""

    scheme: str
    uri: str
    prefix: str
    read_chunk_size: int
    max_concurrency: int
    writes_into: bool = False  # whether `_get(into=...)` has the SDK write an answer in place (else a copy)

    def _get(
        self, key: str, where: str, start: int, end: int | None, into: memoryview | None = None
    ) -> tuple[bytes | memoryview | None, int | None]:
        """Bytes [start, end] (end inclusive, None: to the end) and the object size if known;
        data is None when `start` lies at or past the end. FileNotFoundError if absent. With
        `into` (end - start + 1 bytes) the response lands there and data is the filled part."""
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
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        """Bytes [offset, offset+length) by ranged GET, split into parallel chunk GETs over
        2 * read_chunk_size. A split read, or one of at least INTO_MIN bytes on a client that
        writes answers in place (`writes_into`), is a bytearray allocated once and filled by
        the answers. FileNotFoundError: no such key; EOFError: the object is shorter."""
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
        split = length > 2 * self.read_chunk_size and self.max_concurrency > 1
        if split or (length >= INTO_MIN and self.writes_into):
            out = bytearray(length)
            self._fill(key, where, offset, memoryview(out))
            return out
        data, total = self._get(key, where, offset, offset + length - 1)
        if data is None or len(data) != length:
            size = self._size(key, where, offset, data, total)
            raise EOFError(f"{where}: wanted {length} bytes at offset {offset}, object holds {size}")
        return data

    def _size(self, key: str, where: str, start: int, data, total: int | None) -> int:
        """The object's size after a short answer at `start`: as the service reported it, else
        where the answer's bytes ended, else (nothing came back: GCS and Azure answer a range
        past the end without the size) as a HEAD gives it."""
        if total is not None:
            return total
        if data:
            return start + len(data)
        return int(self._head(key, where))  # type: ignore[call-overload]

    def _fill(self, key: str, where: str, offset: int, view: memoryview) -> None:
        """The object's bytes from `offset` into all of `view`: one ranged GET, or over
        2 * read_chunk_size, read_chunk_size GETs run by a bounded pool, each answer put into
        its slice by the client (written there by the SDK where `writes_into`, else copied)."""
        length = view.nbytes
        chunk = self.read_chunk_size
        if length > 2 * chunk and self.max_concurrency > 1:
            spans = [(a, min(chunk, length - a)) for a in range(0, length, chunk)]
        else:
            spans = [(0, length)]
        # Spans that came back short, as the object size each implies (the smallest is the size).
        short: list[int] = []

        def fetch(rel: int, n: int) -> None:
            data, total = self._get(key, where, offset + rel, offset + rel + n - 1, into=view[rel : rel + n])
            if data is None or len(data) != n:
                short.append(self._size(key, where, offset + rel, data, total))

        if len(spans) == 1:
            fetch(*spans[0])
        else:
            workers = min(self.max_concurrency, len(spans))
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix=f"ckptlib-{self.scheme}-read"
            ) as pool:
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
