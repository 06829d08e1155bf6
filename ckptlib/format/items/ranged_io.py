"""Ranged reads of shard files: preadv into tensor memory, file-like windows for torch.load,
and coalescing of nearby ranges into few reads (few round trips on S3)."""

from __future__ import annotations

import io
import os
from typing import Callable

import torch

# Ranges closer than this are fetched with one read (helps S3; harmless locally).
_COALESCE_GAP = 1 << 20
# Upper bound of one coalesced ranged read on backends without a local file (S3).
_MAX_SPAN = 64 << 20


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor's memory."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset`; returns the bytes read (short only at end of file)."""
    done = 0
    total = view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


# The zip central directory of a tensor item (7 entries) and its end records fit in this.
_TAIL = 4096


ReadInto = Callable[[memoryview, int], int]  # fill the view from a file offset; bytes read


def _cached_tail_reader(read_into: ReadInto, base: int, length: int) -> Callable[[int, int], bytes]:
    """`read(pos, n)` of the item [base, base + length) of a file: its last _TAIL bytes come
    from one read made up front, anything else from its own read."""
    tail_start = max(0, length - _TAIL)
    tail = bytearray(length - tail_start)
    got = read_into(memoryview(tail), base + tail_start)

    def read(pos: int, n: int) -> bytes:
        if pos < 0 or n < 0 or pos + n > length:
            raise EOFError(f"bytes {pos}..{pos + n} lie outside the item ({length} bytes)")
        if pos >= tail_start and pos + n <= tail_start + got:
            return bytes(tail[pos - tail_start : pos - tail_start + n])
        buf = bytearray(n)
        if read_into(memoryview(buf), base + pos) != n:
            raise EOFError(f"short read at offset {base + pos}")
        return bytes(buf)

    return read


class _RangeReader(io.RawIOBase):
    """A read-only, seekable file-like over `size` bytes, so torch.load can decode one item
    in place; subclasses say where the bytes come from (`_fill`)."""

    def __init__(self, size: int):
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self._size - self._pos))
        got = self._fill(view[:n], self._pos) if n else 0
        self._pos += got
        return got

    def _fill(self, view: memoryview, pos: int) -> int:
        raise NotImplementedError


class _Window(_RangeReader):
    """Bytes [base, base+size) of a file descriptor, read with pread."""

    def __init__(self, fd: int, base: int, size: int):
        super().__init__(size)
        self._fd, self._base = fd, base

    def _fill(self, view: memoryview, pos: int) -> int:
        return _pread_into(self._fd, view, self._base + pos)


class _MemReader(_RangeReader):
    """A memoryview, read without copying it first."""

    def __init__(self, view: memoryview):
        super().__init__(view.nbytes)
        self._view = view

    def _fill(self, view: memoryview, pos: int) -> int:
        view[:] = self._view[pos : pos + view.nbytes]
        return view.nbytes


def _coalesce_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (lo, hi) ranges with overlapping or touching ones merged."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _coalesce(
    spans: list[tuple[int, int]], max_span: int | None = None, gap: int = _COALESCE_GAP
) -> list[tuple[int, int]]:
    """Merge (offset, length) spans, sorted, that lie within `gap` bytes of each other (into
    spans of at most `max_span` bytes, unless a single item is larger)."""
    merged: list[list[int]] = []
    for off, length in sorted(spans):
        if (
            merged
            and off <= merged[-1][0] + merged[-1][1] + gap
            and (max_span is None or max(merged[-1][0] + merged[-1][1], off + length) - merged[-1][0] <= max_span)
        ):
            end = max(merged[-1][0] + merged[-1][1], off + length)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([off, length])
    return [(a, b) for a, b in merged]
