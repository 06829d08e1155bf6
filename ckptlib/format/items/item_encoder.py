"""A tensor item's torch.save bytes with one fast CRC pass instead of two slow ones.

DCP stores every tensor as a torch.save zip archive. torch's zip writer computes a CRC-32
of each record (at ~4 GiB/s on the dev box: as long as writing the bytes to the page cache),
and the manifest needs the item's CRC on top. Here torch writes the archive with its CRC
pass off (`_torch.serialization.torch_save_without_zip_crc`), and the zip CRCs (data
descriptors, central directory; located by `zip_directory`) and the serialization id torch
derives from them are filled in from one zlib-ng pass that also yields the item's CRC.

The pass is fused with the write: every CRC field lies after the bytes it covers (each
record's data descriptor follows its data; the serialization id and the central directory
come last), so `EncodedItem.pieces` hands the pieces over in order, each with its CRC computed
right before (pieces of at most 1 MiB: the write that follows copies bytes the CRC just brought
into the core's cache), and fills each field in just before the piece holding it. Everything
that could make the encoding fail is checked before the first piece is handed over.

The bytes are identical to torch.save's. `fast_path_reason` checks that once per process
against torch.save itself; if anything differs (another torch, another zip layout) the
writer uses plain torch.save.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import io
import struct
from typing import Callable, Iterator

import numpy as np
import torch

from ckptlib._torch import serialization
from ckptlib.format.items import zip_directory
from ckptlib.format.items.checksum import FAST, crc32, crc32_combine
from ckptlib.format.items.zip_directory import UnsupportedArchive

# Tensors of fewer bytes than this are written as torch.save's bytes from one in-memory buffer
# (one write, one CRC pass over it): the encoder's Python work per zip record costs more than
# torch's own CRC of a small record (issue 13: thousands of small tensors).
SMALL_ITEM_BYTES = 1 << 18

# Pieces torch hands over smaller than this are copied (its writer reuses its buffers);
# larger ones that lie inside the tensor's memory are kept as views of it (no copy).
_COPY_BELOW = 1 << 16

_U64_MASK = (1 << 64) - 1
_ID_SUFFIX = "/.data/serialization_id"
_ID_DIGITS = 20  # torch writes the combined record CRC hash as 20 zero-padded digits


# Large pieces in the tensor's memory are handed over in pieces of at most this many bytes
# (cut at file offsets that are multiples of it, so at every checksum block boundary too): each
# is checksummed and then written while it is still in the core's L2 cache.
_PIECE = 1 << 20


class EncodedItem:
    """torch.save's bytes of one tensor as pieces to write in order (`pieces`), with their
    CRC-32s; `size` bytes in all. The CRC fields are filled in as the pieces are handed over;
    `chunks`, `crcs` and `crc` give the finished item."""

    def __init__(self, archive: "_Archive", fixups: list[tuple[int, Callable[[], None]]]):
        self._archive = archive
        self._fixups = fixups  # (archive offset of the field, fill it in), by offset
        self._done = 0
        self.size = archive.size

    def _fill_before(self, end: int) -> None:
        fixups = self._fixups
        while self._done < len(fixups) and fixups[self._done][0] < end:
            fixups[self._done][1]()
            self._done += 1

    def pieces(self) -> Iterator[tuple[memoryview, int]]:
        """(piece, its CRC-32) in order; each piece's CRC fields filled in and its CRC computed
        just before it is handed over (one pass over the tensor's bytes, fused with the write)."""
        archive = self._archive
        for i, chunk in enumerate(archive.chunks):
            self._fill_before(archive.starts[i] + chunk.nbytes)
            yield chunk, archive.chunk_crc(i)
        self._fill_before(archive.size + 1)

    @property
    def chunks(self) -> list[memoryview]:
        self._fill_before(self.size + 1)
        return self._archive.chunks

    @property
    def crcs(self) -> list[int]:
        return [self._archive.chunk_crc(i) for i in range(len(self.chunks))]

    @property
    def crc(self) -> int:
        self._fill_before(self.size + 1)
        return self._archive.crc(0, self.size)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class _Capture:
    """The file-like torch's zip writer writes into: keeps the pieces in order, large ones
    cut every `_PIECE` bytes of the file (the item starts at file offset `base`), so at every
    checksum block boundary too: each piece's CRC serves its zip record, the item and its
    block alike."""

    def __init__(self, tensor: torch.Tensor, base: int = 0, block_size: int = 0):
        self.chunks: list[memoryview] = []
        self.size = 0
        nbytes = tensor.numel() * tensor.element_size()
        self._lo = tensor.data_ptr() if nbytes else 0
        self._hi = self._lo + nbytes
        self._base = base
        self._block = block_size

    def write(self, data) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if n < _COPY_BELOW or not (self._lo <= _address(view) and _address(view) + n <= self._hi):
            self.chunks.append(memoryview(bytearray(view)))
        else:
            step = self._block if self._block and self._block % _PIECE else _PIECE
            done = 0
            while done < n:
                room = step - (self._base + self.size + done) % step
                self.chunks.append(view[done : done + room])
                done += min(room, n - done)
        self.size += n
        return n

    def flush(self) -> None:
        pass


class _Archive:
    """The captured pieces as one byte space: reads, in-place patches, range CRCs."""

    def __init__(self, chunks: list[memoryview], size: int):
        self.chunks = chunks
        self.size = size
        self.starts = []
        pos = 0
        for chunk in chunks:
            self.starts.append(pos)
            pos += chunk.nbytes
        self._chunk_crc: dict[int, int] = {}

    def _pieces(self, start: int, end: int):
        """(chunk index, begin, stop) within each chunk covering [start, end)."""
        if start < 0 or end > self.size or start > end:
            raise UnsupportedArchive(f"range {start}..{end} outside the archive ({self.size} bytes)")
        for i in range(max(0, bisect.bisect_right(self.starts, start) - 1), len(self.chunks)):
            first, chunk = self.starts[i], self.chunks[i]
            last = first + chunk.nbytes
            if last <= start or chunk.nbytes == 0:
                continue
            if first >= end:
                break
            yield i, max(start, first) - first, min(end, last) - first

    def check_writable(self, start: int, n: int) -> None:
        """UnsupportedArchive unless bytes [start, start + n) can be patched."""
        for i, _, _ in self._pieces(start, start + n):
            if self.chunks[i].readonly:
                raise UnsupportedArchive("a patched field lies in the tensor's own memory")

    def read(self, start: int, n: int) -> bytes:
        return b"".join(bytes(self.chunks[i][a:b]) for i, a, b in self._pieces(start, start + n))

    def patch(self, start: int, data: bytes) -> None:
        done = 0
        for i, a, b in self._pieces(start, start + len(data)):
            chunk = self.chunks[i]
            if chunk.readonly:
                raise UnsupportedArchive("a patched field lies in the tensor's own memory")
            chunk[a:b] = data[done : done + b - a]
            done += b - a
            self._chunk_crc.pop(i, None)

    def chunk_crc(self, i: int) -> int:
        if i not in self._chunk_crc:
            self._chunk_crc[i] = crc32(self.chunks[i])
        return self._chunk_crc[i]

    def crc(self, start: int, end: int) -> int:
        """CRC-32 of [start, end); whole pieces reuse (and cache) their CRC, so the big data
        record is read once for its zip CRC and the item CRC together."""
        total = 0
        for i, a, b in self._pieces(start, end):
            if crc32_combine is None:  # without zlib-ng: a running CRC over the pieces, the same value
                total = crc32(self.chunks[i][a:b], total)
                continue
            piece = self.chunk_crc(i) if (a, b) == (0, self.chunks[i].nbytes) else crc32(self.chunks[i][a:b])
            total = crc32_combine(total, piece, b - a)
        return total


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t: how torch folds record CRCs into the id."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64_MASK)) & _U64_MASK


def _fixups(archive: _Archive) -> list[tuple[int, Callable[[], None]]]:
    """Every CRC field of the archive (and the serialization id, torch's hash of the record
    CRCs) as (offset of the field, a function that fills it in), by offset. Only the small
    records are read here; each record's CRC is computed when a field first needs it, by then
    (the fields follow what they cover) from the CRCs of pieces already handed over. Raises
    UnsupportedArchive for anything the fields cannot be filled in for."""
    records = zip_directory.records(archive.read, archive.size)
    values: dict[int, int] = {}

    def value(index: int) -> int:
        if index not in values:
            record = records[index]
            if record.name.endswith(_ID_SUFFIX):
                combined = 0
                for other in range(len(records)):
                    if not records[other].name.endswith(_ID_SUFFIX) and records[other].size:
                        combined = _hash_combine(combined, value(other))  # torch leaves empty records out
                archive.patch(record.data_start + record.size - _ID_DIGITS, f"{combined:0{_ID_DIGITS}d}".encode())
            values[index] = archive.crc(record.data_start, record.data_start + record.size)
        return values[index]

    def fill(index: int, at: int) -> Callable[[], None]:
        return lambda: archive.patch(at, struct.pack("<I", value(index)))

    fixups = []
    for index, record in enumerate(records):
        if record.name.endswith(_ID_SUFFIX):
            digits = archive.read(record.data_start, record.size)
            if len(digits) < _ID_DIGITS or not digits.isdigit():
                raise UnsupportedArchive(f"{record.name}: not a string of digits")
            archive.check_writable(record.data_start + record.size - _ID_DIGITS, _ID_DIGITS)
            fixups.append((record.data_start, lambda index=index: value(index)))
        for at in (record.descriptor_crc_at, record.central_crc_at):
            if at is not None:
                archive.check_writable(at, 4)
                fixups.append((at, fill(index, at)))
    fixups.sort(key=lambda fixup: fixup[0])
    return fixups


def _encode(tensor: torch.Tensor, base: int = 0, block_size: int = 0) -> EncodedItem | None:
    capture = _Capture(tensor, base, block_size)
    if not serialization.torch_save_without_zip_crc(tensor, capture):
        return None
    archive = _Archive(capture.chunks, capture.size)
    try:
        return EncodedItem(archive, _fixups(archive))
    except (UnsupportedArchive, struct.error, UnicodeDecodeError):
        return None


def _probe_tensors() -> list[torch.Tensor]:
    return [
        torch.arange(3 * _COPY_BELOW // 4, dtype=torch.float32).reshape(-1, 3),  # kept as a view
        torch.arange(7, dtype=torch.bfloat16),
        torch.zeros(0, 5, dtype=torch.int64),
    ]


@functools.lru_cache(maxsize=None)
def fast_path_reason() -> str | None:
    """Why `encode` falls back to plain torch.save in this process (None: it does not)."""
    if not FAST or crc32_combine is None:
        return "zlib-ng is not installed (pip install zlib-ng): the standard zlib CRC is slower than torch's"
    for tensor in _probe_tensors():
        expected = io.BytesIO()
        torch.save(tensor, expected)
        item = _encode(tensor)
        if item is None:
            return f"this torch ({torch.__version__}) writes archives this encoder does not recognise"
        got = b"".join(bytes(c) for c in item.chunks)
        if got != expected.getvalue() or item.crc != crc32(got):
            return f"the encoding differs from torch.save's on this torch ({torch.__version__})"
    return None


def torch_save_bytes(tensor: torch.Tensor) -> memoryview:
    """torch.save(tensor)'s bytes in one buffer."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getbuffer()


_CONSTANT, _DATA, _ID = 0, 1, 2


@dataclasses.dataclass
class _Template:
    """torch.save's archive of one tensor signature (dtype, shape, strides): every record but
    the data and the serialization id is the same for all tensors of that signature, so a
    tensor's archive is this one with its bytes put in and those two records' CRCs redone."""

    archive: bytes
    data_start: int
    data_size: int
    # Each record in directory order: (kind, start, size, its CRC (constant records), the
    # offsets of its CRC fields: data descriptor and central directory).
    records: list[tuple[int, int, int, int, tuple[int, ...]]]

    def fill(self, data: memoryview) -> bytearray:
        out = bytearray(self.archive)
        out[self.data_start : self.data_start + self.data_size] = data
        view = memoryview(out)
        combined = 0
        for kind, start, size, value, fields in self.records:
            if kind == _DATA:
                value = crc32(data)
            elif kind == _ID:
                view[start + size - _ID_DIGITS : start + size] = b"%020d" % combined
                value = crc32(view[start : start + size])
            if kind != _ID and size:  # torch leaves the id and empty records out of the id
                combined = _hash_combine(combined, value)
            if kind != _CONSTANT:
                for at in fields:
                    struct.pack_into("<I", out, at, value)
        return out


_templates: dict[tuple, _Template | None] = {}
_MAX_TEMPLATES = 4096


def _template_for(tensor: torch.Tensor, expected: bytes, data: memoryview) -> _Template | None:
    """The template of `tensor`'s signature from `expected`, its torch.save bytes; None
    unless filling it with `data` gives exactly those bytes back."""
    archive = _Archive([memoryview(bytearray(expected))], len(expected))
    try:
        records = []
        data_start = -1
        for record in zip_directory.records(archive.read, archive.size):
            fields = (
                (record.central_crc_at,)
                if record.descriptor_crc_at is None
                else (record.descriptor_crc_at, record.central_crc_at)
            )
            if record.name.endswith(_ID_SUFFIX):
                kind = _ID
            elif "/data/" in record.name and "/." not in record.name:
                if data_start >= 0 or record.size != data.nbytes:
                    return None
                kind, data_start = _DATA, record.data_start
            else:
                kind = _CONSTANT
            records.append(
                (
                    kind,
                    record.data_start,
                    record.size,
                    archive.crc(record.data_start, record.data_start + record.size),
                    fields,
                )
            )
    except (UnsupportedArchive, struct.error, UnicodeDecodeError):
        return None
    if data_start < 0:
        return None
    template = _Template(expected, data_start, data.nbytes, records)
    return template if template.fill(data) == expected else None


def small_item_bytes(tensor: torch.Tensor) -> memoryview:
    """torch.save(tensor)'s exact bytes, the writer's path for small tensors: torch.save's
    per-call work (pickling, the zip writer: ~0.4 ms) dominates a small tensor's save, so a
    plain tensor of a signature seen before is written from that signature's template
    instead (~20 us). `tensor`: contiguous, CPU, owning exactly its bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    plain = (
        type(tensor) is torch.Tensor
        and nbytes
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_quantized
        and not tensor.__dict__
    )
    if not plain:
        return torch_save_bytes(tensor)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    key = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
    template = _templates.get(key, False)
    if template is False:
        expected = torch_save_bytes(tensor).tobytes()
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = _template_for(tensor, expected, data)
        return memoryview(expected)
    if template is None:
        return torch_save_bytes(tensor)
    return memoryview(template.fill(data))


def encode(tensor: torch.Tensor, base: int = 0, block_size: int = 0) -> EncodedItem | None:
    """torch.save(tensor)'s exact bytes as pieces to write, with their CRC-32; None where the
    fast path is off (see `fast_path_reason`), then use torch.save. `tensor`: contiguous, CPU,
    owning exactly its bytes (the views in the pieces point into it: keep it alive). With a
    `block_size`, no large piece crosses a multiple of it counted from `base` back."""
    if fast_path_reason() is not None:
        return None
    return _encode(tensor, base, block_size)
