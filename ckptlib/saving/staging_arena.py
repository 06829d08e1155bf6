"""Shared-memory staging for async saves in a writer process (`async_mode="process"`).

The staging copy of the state (`background_save.stage`) is made into segments of anonymous
shared memory (`memfd_create`), which the writer process maps once (their descriptors cross
the socket once, `writer_process`): a shard is written from the very bytes the training
process copied, with nothing copied a second time and nothing pickled. Each staged tensor is
its own `torch.frombuffer` view of exactly its bytes (64-byte aligned), so torch.save writes
the same bytes as from a plain buffer; buffers are reused by the next save of a state with the
same shapes (`background_save`'s pool), and a segment left with nothing in it is unmapped.

Segments are reserved with `posix_fallocate` (a full memory is an error now, not a SIGBUS in
the writer later); memfds are not bounded by /dev/shm's mount size, leave nothing behind to
unlink, and vanish when the last process holding one ends (kill -9 included). On a CUDA
machine each segment is pinned (`_torch.host_memory`) so device-to-host copies land in it at
full speed.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import sys
import threading
from typing import Any

import torch

from ckptlib._torch import host_memory
from ckptlib.errors import CheckpointError

ALIGN = 64
_MIN_SEGMENT = 1 << 20  # segments are sized to what one save needs, rounded up to this


def unavailable_reason() -> str | None:
    """Why shared-memory staging cannot work here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"memfd shared memory is Linux-only (this is {sys.platform})"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds"
    try:
        os.close(os.memfd_create("ckptlib-probe", os.MFD_CLOEXEC))
    except OSError as exc:
        return f"memfd_create failed: {exc}"
    return None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclasses.dataclass
class Segment:
    """One memfd mapping: `free` holds its unused (offset, size) spans, sorted and disjoint."""

    id: int
    fd: int
    size: int
    mapping: mmap.mmap
    address: int
    pinned: bool
    free: list[list[int]]
    live: int = 0

    def take(self, nbytes: int) -> int | None:
        """The offset of a first-fit span of `nbytes` (aligned), or None."""
        for span in self.free:
            if span[1] >= nbytes:
                offset = span[0]
                span[0] += nbytes
                span[1] -= nbytes
                if not span[1]:
                    self.free.remove(span)
                self.live += 1
                return offset
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        self.free.append([offset, nbytes])
        self.free.sort()
        merged: list[list[int]] = []
        for span in self.free:
            if merged and merged[-1][0] + merged[-1][1] == span[0]:
                merged[-1][1] += span[1]
            else:
                merged.append(span)
        self.free = merged
        self.live -= 1


class StagingArena:
    """Tensors in memfd shared memory, mapped by a writer process (see the module docstring).

    `tensor(shape, dtype, grow)` allocates (a new segment of at least `grow` bytes when no span
    fits); `release(tensor)` gives its bytes back; `trim()` unmaps empty segments; `locate`
    describes a tensor by (segment, offset) for the writer process; `close()` frees it all.
    The writer learns of new segments through `unsent()` and of dropped ones through `dropped()`.
    """

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        self._spans: dict[int, tuple[int, int, int]] = {}  # data_ptr -> (segment id, offset, size)
        self._next_id = 0
        self._sent: set[int] = set()
        self._dropped: list[int] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"StagingArena({len(self.segments)} segments, {self.mapped_bytes()} bytes)"

    def mapped_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    def live_buffers(self) -> int:
        return len(self._spans)

    # -- allocation ---------------------------------------------------------------------
    def tensor(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, grow: int = 0) -> torch.Tensor:
        """An uninitialised contiguous tensor in shared memory whose storage is exactly its bytes."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)  # nothing to share: written inline
        need = _aligned(nbytes)
        with self._lock:
            for segment in self.segments.values():
                offset = segment.take(need)
                if offset is not None:
                    break
            else:
                segment = self._new_segment(max(need, grow))
                offset = segment.take(need)
                assert offset is not None
            buffer = torch.frombuffer(segment.mapping, dtype=torch.uint8, count=nbytes, offset=offset)
            self._spans[buffer.data_ptr()] = (segment.id, offset, need)
        return buffer.view(dtype).view(shape)

    def release(self, tensor: torch.Tensor) -> None:
        """Give `tensor`'s bytes back (a buffer of this arena no longer used); others are ignored."""
        with self._lock:
            span = self._spans.pop(tensor.untyped_storage().data_ptr(), None)
            if span is not None and span[0] in self.segments:
                self.segments[span[0]].give_back(span[1], span[2])

    def reserve(self, nbytes: int) -> Segment:
        """A segment of exactly `nbytes`, all of it taken (no `tensor` lands in it): the ring of
        a capped save (`capped_staging`), which places its pieces itself; `unreserve` frees it."""
        with self._lock:
            segment = self._new_segment(nbytes, exact=True)
            segment.take(nbytes)
        return segment

    def unreserve(self, segment: Segment) -> None:
        with self._lock:
            if segment.id in self.segments:
                self._drop(segment)

    def trim(self) -> None:
        """Unmap every segment with nothing in it (the writer process is told by `dropped()`)."""
        with self._lock:
            for segment in [s for s in self.segments.values() if s.live == 0]:
                self._drop(segment)

    def _new_segment(self, nbytes: int, exact: bool = False) -> Segment:
        size = nbytes if exact else -(-nbytes // _MIN_SEGMENT) * _MIN_SEGMENT
        fd = os.memfd_create(f"ckptlib-staging-{self._next_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # the memory exists now: ENOSPC here, never SIGBUS later
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(
                f"cannot stage {size} bytes in shared memory for the writer process ({exc}); "
                'free memory or use async_mode="thread"'
            ) from exc
        address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        segment = Segment(self._next_id, fd, size, mapping, address, host_memory.pin(address, size), [[0, size]])
        self.segments[segment.id] = segment
        self._next_id += 1
        return segment

    def _drop(self, segment: Segment) -> None:
        del self.segments[segment.id]
        if segment.id in self._sent:
            self._sent.discard(segment.id)
            self._dropped.append(segment.id)
        if segment.pinned:
            host_memory.unpin(segment.address)
        try:
            segment.mapping.close()
        except BufferError:  # a staged tensor is still referenced: unmapped when it is freed
            pass
        os.close(segment.fd)

    # -- the writer process's view ------------------------------------------------------
    def unsent(self) -> list[Segment]:
        """Segments the writer process has not mapped yet; marked as sent."""
        with self._lock:
            fresh = [s for s in self.segments.values() if s.id not in self._sent]
            self._sent.update(s.id for s in fresh)
        return fresh

    def dropped(self) -> list[int]:
        """Segments unmapped here since the last call, which the writer process still maps."""
        with self._lock:
            gone, self._dropped = self._dropped, []
        return gone

    def forget_sent(self) -> None:
        """A new writer process maps nothing yet."""
        with self._lock:
            self._sent.clear()
            self._dropped.clear()

    def locate(self, tensor: torch.Tensor) -> tuple[Any, ...] | None:
        """("arena", segment, offset, storage bytes, dtype, shape, stride, storage offset) of a
        CPU tensor whose storage lies in this arena; None otherwise."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            for segment in self.segments.values():
                if segment.address <= start and start + nbytes <= segment.address + segment.size:
                    return (
                        "arena",
                        segment.id,
                        start - segment.address,
                        nbytes,
                        tensor.dtype,
                        tuple(tensor.shape),
                        tuple(tensor.stride()),
                        tensor.storage_offset(),
                    )
        return None

    def close(self) -> None:
        """Unmap and close every segment (buffers still referenced stay valid until freed)."""
        with self._lock:
            for segment in list(self.segments.values()):
                self._drop(segment)
            self._spans.clear()
            self._sent.clear()
            self._dropped.clear()
