"""Where things lie in a torch.save archive (an uncompressed zip), read from its central
directory without torch.load: every record with the offsets of its CRC fields (for the
item encoder, which fills them in), and the one tensor's data and pickle records (for the
reader's zero-copy and small-item paths, and the load planner's header checks).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable

_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESCRIPTOR_SIG = 0x08074B50
_EOCD_SIG = 0x06054B50
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD_SIG = 0x06064B50
_ZIP64_EXTRA = 0x0001
_U32_MAX = 0xFFFFFFFF


class UnsupportedArchive(Exception):
    """The archive is not laid out as expected (the callers then fall back to torch's own code)."""


def _zip64_values(extra: bytes, wanted: int) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA:
            return list(struct.unpack_from(f"<{wanted}Q", extra, pos + 4)) if wanted * 8 <= length else []
        pos += 4 + length
    return []


@dataclasses.dataclass
class Entry:
    """A central-directory entry: enough to find the record's local header and data."""

    name: str
    flags: int
    size: int
    local_at: int
    central_at: int


def central_entries(read: Callable[[int, int], bytes], size: int) -> list[Entry]:
    """Every entry of the zip archive of `size` bytes that `read(pos, n)` reads."""
    eocd = size - 22
    sig, _, _, _, count, _, cd_offset, _ = struct.unpack("<IHHHHIIH", read(eocd, 22))
    if sig != _EOCD_SIG:
        raise UnsupportedArchive("no end-of-central-directory record at the end")
    if size >= 42 and struct.unpack("<I", read(eocd - 20, 4))[0] == _ZIP64_LOCATOR_SIG:
        _, _, zip64_at, _ = struct.unpack("<IIQI", read(eocd - 20, 20))
        fields = struct.unpack("<IQHHIIQQQQ", read(zip64_at, 56))
        if fields[0] != _ZIP64_EOCD_SIG:
            raise UnsupportedArchive("bad zip64 end-of-central-directory record")
        count, cd_offset = fields[7], fields[9]
    entries = []
    pos = cd_offset
    for _ in range(count):
        head = read(pos, 46)
        (sig, _, _, flags, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _, local_at) = (
            struct.unpack("<IHHHHHHIIIHHHHHII", head)
        )
        if sig != _CENTRAL_SIG or method != 0:
            raise UnsupportedArchive("a record that is not stored uncompressed")
        name = read(pos + 46, name_len).decode("utf-8")
        extra = read(pos + 46 + name_len, extra_len)
        big = [v for v in (usize, csize, local_at) if v == _U32_MAX]
        if big:
            values = _zip64_values(extra, len(big))
            if len(values) != len(big):
                raise UnsupportedArchive(f"{name}: zip64 sizes missing")
            it = iter(values)
            usize = next(it) if usize == _U32_MAX else usize
            csize = next(it) if csize == _U32_MAX else csize
            local_at = next(it) if local_at == _U32_MAX else local_at
        if csize != usize:
            raise UnsupportedArchive(f"{name}: compressed")
        entries.append(Entry(name, flags, usize, local_at, pos))
        pos += 46 + name_len + extra_len + comment_len
    return entries


def _data_start(read: Callable[[int, int], bytes], entry: Entry) -> int:
    local = read(entry.local_at, 30)
    if struct.unpack_from("<I", local)[0] != _LOCAL_SIG:
        raise UnsupportedArchive(f"{entry.name}: no local header at {entry.local_at}")
    local_name_len, local_extra_len = struct.unpack_from("<HH", local, 26)
    return entry.local_at + 30 + local_name_len + local_extra_len


@dataclasses.dataclass
class Record:
    """A record of the archive: where its data lies and where its CRC-32 fields are."""

    name: str
    data_start: int
    size: int
    descriptor_crc_at: int | None
    central_crc_at: int


def records(read: Callable[[int, int], bytes], size: int) -> list[Record]:
    """Every record of the archive of `size` bytes that `read(pos, n)` reads, from its central directory."""
    found = []
    for entry in central_entries(read, size):
        data_start = _data_start(read, entry)
        descriptor: int | None = data_start + entry.size
        if not entry.flags & 0x8:  # no data descriptor: only empty records (their CRC, 0, is already right)
            if entry.size:
                raise UnsupportedArchive(f"{entry.name}: data without a data descriptor")
            descriptor = None
        elif struct.unpack("<I", read(descriptor, 4))[0] != _DESCRIPTOR_SIG:
            raise UnsupportedArchive(f"{entry.name}: no data descriptor after the data")
        found.append(
            Record(
                entry.name,
                data_start,
                entry.size,
                None if descriptor is None else descriptor + 4,
                entry.central_at + 16,
            )
        )
    return found


@dataclasses.dataclass
class DataRecord:
    """Where a tensor item's raw bytes lie, and which bytes said so."""

    start: int  # offset of the data in the archive
    size: int
    # (start, end) ranges of the archive whose bytes located the data (the record's local
    # header; the central directory and end records): a reader that verifies only part of
    # the archive must verify these too, or a damaged header could shift what it reads.
    parsed: list[tuple[int, int]]


def tensor_data_record(read: Callable[[int, int], bytes], size: int) -> DataRecord | None:
    """The one tensor data record (`*/data/<key>`) of a torch.save archive of `size` bytes
    read by `read(pos, n)`; None if it has not exactly one, stored uncompressed (the reader
    then decodes the item with torch.load)."""
    try:
        parsed_from = [size]

        def tracked(pos: int, n: int) -> bytes:
            parsed_from[0] = min(parsed_from[0], pos)
            return read(pos, n)

        entries = [e for e in central_entries(tracked, size) if "/data/" in e.name and "/." not in e.name]
        if len(entries) != 1:
            return None
        start = _data_start(read, entries[0])
        return DataRecord(start, entries[0].size, [(entries[0].local_at, start), (parsed_from[0], size)])
    except (UnsupportedArchive, struct.error, UnicodeDecodeError, EOFError):
        return None


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where a whole torch.save'd tensor item held in memory keeps its header and its data."""

    pickle: bytes  # the `*/data.pkl` record: dtype, shape, strides (see item_header)
    data_start: int  # offset of the one `*/data/<key>` record's bytes in the item
    data_size: int


def tensor_layout(item: memoryview) -> TensorLayout | None:
    """The layout of a whole torch.save archive in memory from one pass over its central
    directory (no torch.load: that costs ~1 ms an item, most of a load of small tensors);
    None unless it has exactly one data.pkl and one tensor data record, both stored
    uncompressed, and no zip64 fields (small items have none: the generic path reads those)."""
    size = item.nbytes
    try:
        sig, _, _, _, count, _, cd_offset, _ = struct.unpack_from("<IHHHHIIH", item, size - 22)
        if sig != _EOCD_SIG or cd_offset == _U32_MAX or size < 22:
            return None
        pickle_at = data_at = None
        pos = cd_offset
        for _ in range(count):
            (sig, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _, local_at) = (
                struct.unpack_from("<IHHHHHHIIIHHHHHII", item, pos)
            )
            if sig != _CENTRAL_SIG or method != 0 or csize != usize or _U32_MAX in (usize, local_at):
                return None
            name = item[pos + 46 : pos + 46 + name_len].tobytes()
            if name.endswith(b"/data.pkl"):
                if pickle_at is not None:
                    return None
                pickle_at = (local_at, usize)
            elif b"/data/" in name and b"/." not in name:
                if data_at is not None:
                    return None
                data_at = (local_at, usize)
            pos += 46 + name_len + extra_len + comment_len
        if pickle_at is None or data_at is None or pickle_at[1] > 1 << 16:
            return None
        starts = []
        for local_at, n in (pickle_at, data_at):
            (sig,) = struct.unpack_from("<I", item, local_at)
            name_len, extra_len = struct.unpack_from("<HH", item, local_at + 26)
            start = local_at + 30 + name_len + extra_len
            if sig != _LOCAL_SIG or start + n > size:
                return None
            starts.append(start)
        return TensorLayout(item[starts[0] : starts[0] + pickle_at[1]].tobytes(), starts[1], data_at[1])
    except struct.error:
        return None


def tensor_pickle(read: Callable[[int, int], bytes], size: int, limit: int = 1 << 16) -> bytes | None:
    """The bytes of the `*/data.pkl` record of a torch.save archive (what says the tensor's
    dtype, shape and strides), or None when there is no such record, it is not stored
    uncompressed or it is larger than `limit` (a single tensor's is a few hundred bytes)."""
    try:
        entries = [e for e in central_entries(read, size) if e.name.endswith("/data.pkl")]
        if len(entries) != 1 or entries[0].size > limit:
            return None
        return read(_data_start(read, entries[0]), entries[0].size)
    except (UnsupportedArchive, struct.error, UnicodeDecodeError, EOFError):
        return None
