"""Staging under a hard host-memory cap: `AsyncMode(max_staging_bytes=N)`.

Without a cap an async save copies the whole state before it writes (about one shard per rank,
kept for the next save). With one, nothing is copied up front: DCP is given the live state, and
each tensor is copied into a `StagingRing` of at most N bytes just before the writer takes it
(`staged_pieces`, or the writer process's streamed request, `writer_process`); a piece's bytes
are reused once the writer has written it. So a state larger than N still saves, just later:
the save counts as staged (`AsyncSave.wait_staged()`; without background staging,
`async_save` returns then) when its last piece is copied. The thread writer holds one piece at a
time (its ring is the largest tensor); the process writer's ring (min(N, the shard)) is one
exact-size shared-memory segment of the writer's arena, so its pieces are written while the next
are copied.

A tensor larger than N is refused (`StagingCapError` naming the key and both sizes, on every
rank, before anything is written; `check_fits`): torch.save encodes a tensor as one record, so a
piece is never part of a tensor. Objects (pickled by DCP as they are resolved) are not counted.
"""

from __future__ import annotations

import collections
import mmap
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

from ckptlib.errors import StagingCapError
from ckptlib.format.write.dcp_writer import InProcessShards

ALIGN = 64
_END = object()
_lock = threading.Lock()
_rings: dict[Any, "StagingRing"] = {}  # (caller's group, writer process?) -> the ring of its capped saves


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def tensor_sizes(state_dict: dict[str, Any]) -> dict[str, int]:
    """Key path -> bytes of every tensor a capped save stages (a DTensor's local shard)."""
    from ckptlib._torch import probes

    dtensor_cls = probes.dtensor_cls()
    out: dict[str, int] = {}

    def walk(obj: Any, path: str) -> None:
        if dtensor_cls is not None and isinstance(obj, dtensor_cls):
            obj = obj.to_local()
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.strided:
                out[path] = obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    walk(state_dict, "")
    return out


def check_fits(sizes: dict[str, int], cap: int, *, rank: int, where: str) -> None:
    """StagingCapError for the largest tensor above `cap` (none: nothing happens)."""
    over = {k: n for k, n in sizes.items() if n > cap}
    if over:
        key = max(over, key=over.__getitem__)
        raise StagingCapError(
            f"tensor {key!r} on rank {rank} is {over[key]} bytes, more than AsyncMode(max_staging_bytes={cap}): "
            f"a capped save stages whole tensors (raise the cap to at least {over[key]}, or shard the tensor); "
            f"nothing was written to {where}",
            key=key,
            nbytes=over[key],
            cap=cap,
            path=where,
            rank=rank,
        )


class StagingRing:
    """Staged pieces, first in first out, in one buffer of `size` bytes (anonymous memory, or
    a segment reserved in a writer process's `arena`). `put(tensor)` copies a tensor into the
    next free span (None when it does not fit until older pieces are freed); `free_oldest()`
    gives the oldest piece's bytes back. `peak` is the most bytes of pieces held at once since
    `begin()` (the diagnostics of `SaveResult.staging_peak_bytes`)."""

    def __init__(self, size: int, arena=None):
        self.size = size
        self.arena = arena
        if arena is None:
            self.segment = None
            self._mapping = mmap.mmap(-1, size)
        else:
            self.segment = arena.reserve(size)
            self._mapping = self.segment.mapping
        self._live: collections.deque[tuple[int, int]] = collections.deque()
        self._head = 0
        self.held = 0
        self.peak = 0

    def __repr__(self) -> str:
        return f"StagingRing({self.size} bytes, {len(self._live)} pieces held, peak {self.peak})"

    def begin(self) -> None:
        """A new save: no piece held, the peak counted from zero."""
        self.clear()
        self.peak = 0

    def clear(self) -> None:
        """Forget every piece held (the writer has none any more)."""
        self._live.clear()
        self._head = self.held = 0

    def _offset(self, nbytes: int) -> int | None:
        if not self._live:
            return 0 if nbytes <= self.size else None
        tail = self._live[0][0]
        start = _aligned(self._head)
        if tail < self._head:  # the free space is [head, size) and then [0, tail)
            if start + nbytes <= self.size:
                return start
            return 0 if nbytes <= tail else None
        return start if start + nbytes <= tail else None

    def put(self, value: torch.Tensor) -> torch.Tensor | None:
        """A contiguous copy of `value` in the ring, whose storage is exactly its bytes."""
        nbytes = value.numel() * value.element_size()
        offset = self._offset(nbytes)
        if offset is None:
            return None
        piece = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        piece = piece.view(value.dtype).view(value.shape)
        piece.copy_(value.detach())
        self._live.append((offset, nbytes))
        self._head = offset + nbytes
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return piece

    def free_oldest(self) -> None:
        _offset, nbytes = self._live.popleft()
        self.held -= nbytes
        if not self._live:
            self._head = 0

    def close(self) -> None:
        self._live.clear()
        if self.segment is not None:
            self.arena.unreserve(self.segment)
        else:
            try:
                self._mapping.close()
            except BufferError:  # a piece is still referenced: unmapped when it is freed
                pass


def stageable(data: Any) -> bool:
    """Whether a payload is a tensor the ring copies (not an object's bytes, not an empty or
    sparse tensor, which are written as they are)."""
    return isinstance(data, torch.Tensor) and data.layout == torch.strided and data.numel() > 0


def ring_for(group_key: Any, cap: int, sizes: dict[str, int], arena=None) -> StagingRing:
    """The ring for a capped save of `group_key`'s state of tensors `sizes`: the largest tensor
    for the thread writer (one piece at a time), min(cap, the shard) for a writer process;
    reused by the next capped save when it fits."""
    largest = max(sizes.values(), default=0)
    if arena is None:
        size = max(largest, 1)
    else:
        size = max(1, min(cap, sum(_aligned(n) for n in sizes.values())))
    key = (group_key, arena is not None)
    with _lock:
        ring = _rings.pop(key, None)
    if ring is not None and (ring.arena is not arena or ring.size != size):
        ring.close()
        ring = None
    if ring is None:
        ring = StagingRing(size, arena)
    with _lock:
        _rings[key] = ring
    ring.begin()
    return ring


def release(which: Callable[[Any], bool] | None = None) -> None:
    """Free every ring (`background_save.release_staging`), or those whose group `which` names
    (a world left behind: `background_save._forget_world`)."""
    with _lock:
        keys = [key for key in _rings if which is None or which(key[0])]
        rings = [_rings.pop(key) for key in keys]
    for ring in rings:
        ring.close()


def staged_pieces(payloads: Iterable[Any], ring: StagingRing, on_staged: Callable[[], None]) -> Iterator[Any]:
    """`payloads` with each tensor copied into `ring` just before it is yielded, and its bytes
    given back once the consumer asks for the next (one piece held at a time); `on_staged()`
    runs once the last one is copied."""
    items = iter(payloads)
    current = next(items, _END)
    if current is _END:
        on_staged()
    while current is not _END:
        piece = ring.put(current) if stageable(current) else None
        if stageable(current) and piece is None:
            raise AssertionError(f"{ring!r} cannot hold a tensor of {current.numel() * current.element_size()} bytes")
        following = next(items, _END)
        if following is _END:
            on_staged()
        yield current if piece is None else piece
        if piece is not None:
            del piece
            ring.free_oldest()
        current = following


class CappedShards:
    """The ShardBackend of a capped save: the shard's tensors staged through `ring` as they are
    written, in this thread or by `writer` (a `writer_process.WriterProcess`)."""

    def __init__(self, ring: StagingRing, on_staged: Callable[[], None], writer=None):
        self.ring, self.on_staged, self.writer = ring, on_staged, writer

    def write_shard(self, transaction, name: str, payloads: Iterable[Any], planned_bytes: int):
        if self.writer is not None:
            return self.writer.write_streamed(transaction, name, payloads, planned_bytes, self.ring, self.on_staged)
        pieces = staged_pieces(payloads, self.ring, self.on_staged)
        return InProcessShards().write_shard(transaction, name, pieces, planned_bytes)


__all__ = ["CappedShards", "StagingRing", "check_fits", "release", "ring_for", "staged_pieces", "tensor_sizes"]
