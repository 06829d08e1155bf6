"""The storage reads a load will make, rank by rank, predicted from its read items and the
checkpoint's metadata (`ckpt plan`): no tensor byte is read.

It follows the readers' own rules: which items several ranks need and are read by one rank
and sent to the others (`format.read_schedule.predict_reads`, the pure function the load's
coordinator runs, here on the predicted plans), how `format.dcp_reader.CkptReader` reads the rest (local files: large
tensor items straight into place, just the rows a reshard needs, verified by the file's
checksum blocks around them; the others whole; object stores: the partial reads the same way,
everything else in coalesced ranged reads) and what `ForeignReader` reads of torch.save,
v0 and safetensors sources (each piece's bytes; `foreign_bytes`: what they need, once).
Where a large item's data starts inside it comes from torch.save's archive of a tensor of
that dtype and shape (`item_layout`, made from an untouched allocation: no data is written or
read). A read is (file, offset, length, kind):
``item`` (a stored item whole), ``rows`` (part of one), ``verify`` (checksum-block bytes around
rows) and ``locate`` (the item's zip records that say where its data is; not counted in a
load's `storage_bytes_read`, but requests on an object store).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from ckptlib._torch import serialization
from ckptlib.format.items import zip_directory
from ckptlib.format.items.block_checks import _CRC_CHUNK  # verified local reads go in pieces of this size
from ckptlib.format.items.item_decoder import DeclaredChunks
from ckptlib.format.items.ranged_io import _COALESCE_GAP, _MAX_SPAN, _TAIL, _coalesce, _coalesce_ranges
from ckptlib.format.read import read_schedule
from ckptlib.format.read.dcp_reader import _DIRECT_MIN  # items from this size are read in place
from ckptlib.format.read.direct_reads import _CHUNK  # unverified local reads go in pieces of this size

_SMALL_WRITE = 1 << 16


@dataclasses.dataclass(frozen=True)
class Read:
    file: str
    offset: int
    length: int
    kind: str  # "item", "rows", "verify" or "locate"


@dataclasses.dataclass(frozen=True)
class ItemLayout:
    """Where a torch.save archive of one tensor keeps its records (offsets in the item)."""

    size: int
    data_start: int
    data_header: int  # the data record's local header
    pickle_header: int
    pickle_start: int
    pickle_size: int
    directory: int  # the first byte of the central directory (and end records)


class _Sink:
    """A write-only buffer torch.save writes into: small writes kept, large ones (the tensor's
    bytes, handed over as views of the untouched allocation) only counted."""

    def __init__(self):
        self.pieces: list[tuple[int, bytes | None, int]] = []
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        n = view.nbytes
        self.pieces.append((self.size, bytes(view.cast("B")) if n <= _SMALL_WRITE else None, n))
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def read(self, pos: int, n: int) -> bytes:
        out = bytearray()
        for start, data, length in self.pieces:
            lo, hi = max(pos, start), min(pos + n, start + length)
            if lo >= hi:
                continue
            if data is None:
                raise EOFError(f"bytes {lo}..{hi} are the tensor's data")
            out += data[lo - start : hi - start]
        if len(out) != n:
            raise EOFError(f"bytes {pos}..{pos + n} lie outside the archive")
        return bytes(out)


@functools.lru_cache(maxsize=4096)
def item_layout(dtype: torch.dtype, shape: tuple[int, ...]) -> ItemLayout | None:
    """The archive layout torch.save gives a contiguous tensor of `dtype` and `shape` (None when
    this torch cannot write it without touching the data, or the allocation fails)."""
    try:
        tensor = torch.empty(shape, dtype=dtype)  # pages never touched: no memory is used
    except RuntimeError:
        return None
    sink = _Sink()
    if not serialization.torch_save_without_zip_crc(tensor, sink):
        return None
    try:
        record = zip_directory.tensor_data_record(sink.read, sink.size)
        entries = zip_directory.central_entries(sink.read, sink.size)
    except (zip_directory.UnsupportedArchive, EOFError):
        return None
    pickles = [e for e in entries if e.name.endswith("/data.pkl")]
    if record is None or len(pickles) != 1:
        return None
    header = sink.read(pickles[0].local_at, 30)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return ItemLayout(
        sink.size,
        record.start,
        record.parsed[0][0],
        pickles[0].local_at,
        pickles[0].local_at + 30 + name_len + extra_len,
        pickles[0].size,
        record.parsed[1][0],
    )


@dataclasses.dataclass
class RankReads:
    """One rank's part of a load, as predicted."""

    rank: int
    reads: list[Read] = dataclasses.field(default_factory=list)
    items_needed: int = 0  # stored items this rank's load needs
    items_read: int = 0  # stored items it reads from storage (for itself and others)
    bytes_received: int = 0
    bytes_sent: int = 0
    transient_bytes: int = 0  # the largest buffer the load holds at once beyond the state
    exact: bool = True  # False where an item's layout could not be computed (then an estimate)

    @property
    def storage_bytes(self) -> int:
        """What `LoadResult.storage_bytes_read` counts: every read but the locating ones."""
        return sum(r.length for r in self.reads if r.kind != "locate")

    def hold(self, nbytes: int) -> None:
        self.transient_bytes = max(self.transient_bytes, nbytes)


@dataclasses.dataclass
class Target:
    """Where the reads go and how they are made."""

    local: bool  # a local directory read with preadv (else ranged reads of an object store)
    verify: bool
    block_sizes: dict[str, int]  # file -> its checksum block size (0: none)
    file_sizes: dict[str, int]
    has_manifest: bool


def _block_ranges(target: Target, name: str, start: int, rows: tuple[int, int], parsed, verified: set[int]):
    bs = target.block_sizes.get(name, 0)

    def blocks(a: int, b: int) -> range:
        return range((start + a) // bs, -(-(start + b) // bs)) if b > a else range(0)

    wanted = set(blocks(*rows))
    for a, b in parsed:
        wanted.update(i for i in blocks(a, b) if i not in verified)
    size = target.file_sizes[name]
    return _coalesce_ranges([(i * bs, min((i + 1) * bs, size)) for i in wanted])


def _pieces(out: RankReads, name: str, lo: int, hi: int, chunk: int, kind: str) -> None:
    for pos in range(lo, hi, chunk):
        out.reads.append(Read(name, pos, min(chunk, hi - pos), kind))


def _direct(out: RankReads, target: Target, name: str, req, info, declared, verified: set[int]) -> bool:
    """A large tensor item read in place (`direct_reads._read_tensor_direct`); False where the
    reader would fall back to reading it whole."""
    found = declared(req.storage_index.fqn, req.storage_index.offset)
    if found is None:
        return False
    dtype, sizes = found
    layout = item_layout(dtype, tuple(sizes))
    if layout is None or (target.has_manifest and layout.size != info.length):
        out.exact = False
        if layout is None:
            return False
    meta = torch.empty(sizes, dtype=dtype, device="meta")
    sub = meta
    for dim, (first, length) in enumerate(zip(req.storage_offsets, req.lengths)):
        sub = sub.narrow(dim, first, length)
    region = sub if sub.is_contiguous() else meta
    size = meta.element_size()
    begin = layout.data_start + region.storage_offset() * size
    end = begin + region.numel() * size
    base = info.offset
    if target.has_manifest:  # the zip records that locate the data: a tail read, then what lies before it
        tail = max(0, info.length - _TAIL)
        out.reads.append(Read(name, base + tail, info.length - tail, "locate"))
        for pos, n in ((layout.data_header, 30), (layout.pickle_header, 30), (layout.pickle_start, layout.pickle_size)):
            if pos < tail:
                out.reads.append(Read(name, base + pos, n, "locate"))
    if region is not sub or not _lands_in_place(req):
        out.hold(region.numel() * size)
    rows_lo, rows_hi = base + begin, base + end
    local, remote_chunk = target.local, _MAX_SPAN
    if not (target.verify and target.has_manifest):
        _pieces(out, name, rows_lo, rows_hi, _CHUNK if local else remote_chunk, "rows")
        return True
    parsed = [(layout.data_header, layout.data_start), (layout.directory, layout.size)]
    ranges = _block_ranges(target, name, base, (begin, end), parsed, verified) if target.block_sizes.get(name) else []
    if not ranges or sum(b - a for a, b in ranges) >= info.length:
        ranges = [(base, base + info.length)]  # the whole item's checksum instead
    else:
        bs = target.block_sizes[name]
        for lo, hi in ranges:
            verified.update(range(lo // bs, -(-hi // bs)))
    edge = _CRC_CHUNK if local else remote_chunk
    for lo, hi in ranges:
        if lo <= rows_lo and rows_hi <= hi:
            _pieces(out, name, lo, rows_lo, edge, "verify")
            _pieces(out, name, rows_lo, rows_hi, _CRC_CHUNK if local else remote_chunk, "rows")
            _pieces(out, name, rows_hi, hi, edge, "verify")
        else:
            _pieces(out, name, lo, hi, edge, "verify")
    return True


def _lands_in_place(req) -> bool:
    """Whether the destination of a read is one contiguous piece of the rank's tensor: the read
    covers whole rows of it (DCP's destination views narrow the first dim only then)."""
    return all(o == 0 for o in list(req.dest_offsets)[1:])


def _spans(out: RankReads, name: str, entries: Sequence[tuple[int, int]], *, hold_all: bool, gap: int) -> None:
    """Coalesced ranged reads of whole items (`dcp_reader._read_spans`): items at most `gap`
    bytes apart are read in one range, gap included."""
    spans = _coalesce(list(entries), _MAX_SPAN, gap)
    for off, length in spans:
        out.reads.append(Read(name, off, length, "item"))
    out.hold(sum(length for _, length in spans) if hold_all else max((n for _, n in spans), default=0))


def ckpt_reads(
    plans: Sequence[LoadPlan],
    storage_data: dict,
    declared: DeclaredChunks,
    target: Target,
    *,
    read_once: bool,
    on_rank: Callable[[], None] | None = None,
) -> tuple[list[RankReads], read_schedule.ReadSchedule]:
    """Every rank's reads of a ckptlib or DCP checkpoint (see the module) and the schedule of its
    shared items (`read_schedule.predict_reads`: what the load's coordinator computes)."""
    schedule = read_schedule.predict_reads(plans, declared.metadata, read_once=read_once)
    roles = schedule.roles()
    out = []
    for rank, (plan, role) in enumerate(zip(plans, roles)):
        reads = RankReads(rank)
        keys = set()
        by_file: dict[str, list] = defaultdict(list)
        for req in plan.items:
            info = storage_data[req.storage_index]
            key = (info.relative_path, info.offset, info.length)
            keys.add(key)
            if key not in role.shared:
                by_file[info.relative_path].append((req, info))
        reads.items_needed = len(keys)
        for part in role.rounds:
            held = 0
            for block in part.out:  # a block is read whole, in one range (`CkptReader.fetch_block`)
                name, offset, length = read_schedule.block_span(block)
                reads.items_read += len(block[2])
                if target.local:
                    reads.reads.append(Read(name, offset, length, "item"))
                else:  # in pieces of at most _MAX_SPAN
                    for start in range(offset, offset + length, _MAX_SPAN):
                        reads.reads.append(Read(name, start, min(_MAX_SPAN, offset + length - start), "item"))
                held += length
                reads.bytes_sent += length * len(block[1])
            received = sum(read_schedule.block_span(block)[2] for block in part.into)
            reads.bytes_received += received
            reads.hold(held + received)
        for name, entries in by_file.items():
            _own_file(reads, target, name, entries, declared, gap=0 if name in role.tight else _COALESCE_GAP)
        out.append(reads)
        if on_rank is not None:
            on_rank()
    return out, schedule


def _own_file(reads: RankReads, target: Target, name: str, entries: list, declared: DeclaredChunks, gap: int) -> None:
    """The items of one file a rank reads for itself (`CkptReader._read_file`); on an object
    store, ranged reads through gaps of at most `gap` bytes (none where other ranks read the
    items between this rank's)."""
    verified: set[int] = set()
    reads.items_read += len({(info.offset, info.length) for _, info in entries})
    ordered = sorted(entries, key=lambda e: e[1].offset)
    if target.local:
        for req, info in ordered:
            if req.type != LoadItemType.BYTE_IO and info.length >= _DIRECT_MIN:
                if _direct(reads, target, name, req, info, declared.declared, verified):
                    continue
            reads.reads.append(Read(name, info.offset, info.length, "item"))
            reads.hold(info.length)
        return
    direct_ok = target.has_manifest and (not target.verify or target.block_sizes.get(name, 0) > 0)
    rest = []
    for req, info in ordered:
        found = declared.declared(req.storage_index.fqn, req.storage_index.offset)
        partial = (
            req.type != LoadItemType.BYTE_IO
            and info.length >= _DIRECT_MIN
            and found is not None
            and tuple(req.lengths) != tuple(found[1])
        )
        if not (direct_ok and partial and _direct(reads, target, name, req, info, declared.declared, verified)):
            rest.append((info.offset, info.length))
    if rest:
        _spans(reads, name, rest, hold_all=False, gap=gap)


def foreign_reads(
    plans: Sequence[LoadPlan], storage_data: dict, source_info: Any, on_rank: Callable[[], None] | None = None
) -> list[RankReads]:
    """What `source.ForeignReader` reads: each read item's piece (safetensors: one ranged read of
    its rows; torch.save and v0: the pages of a memory-mapped file it copies from)."""
    out = []
    for rank, plan in enumerate(plans):
        reads = RankReads(rank)
        pieces = set()
        for req in plan.items:
            loc = storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                continue
            md = source_info.metadata.state_dict_metadata[req.storage_index.fqn]
            begin = getattr(loc, "begin", None)
            if begin is not None:  # safetensors: whole rows [first, first + n)
                first, length = _rows(req, list(md.size), md.properties.dtype.itemsize, loc)
                reads.reads.append(Read(loc.file, begin + first, length, "rows"))
            else:
                length = math.prod(req.lengths) * md.properties.dtype.itemsize
                reads.reads.append(Read(loc.file, -1, length, "rows"))  # -1: a mapped file's pages
            pieces.add(req.storage_index)
            reads.hold(length)
        reads.items_needed = reads.items_read = len(pieces)
        out.append(reads)
        if on_rank is not None:
            on_rank()
    return out


def _rows(req, size: list[int], itemsize: int, loc) -> tuple[int, int]:
    """(offset in the tensor's data, length) of the rows a safetensors read item reads."""
    if not size:
        return 0, loc.end - loc.begin
    row = math.prod(size[1:]) * itemsize
    return req.storage_offsets[0] * row, req.lengths[0] * row


def foreign_bytes(plans: Sequence[LoadPlan], metadata: Any) -> tuple[int, int]:
    """(bytes some rank reads, each once; the stored tensor pieces' bytes) of a foreign source:
    safetensors by the union of the byte ranges read in each file, mapped files (torch.save,
    v0) by the union of the elements read of each stored piece."""
    sdm, storage_data = metadata.state_dict_metadata, metadata.storage_data
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    boxes: dict[Any, list] = defaultdict(list)
    for plan in plans:
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                continue
            loc = storage_data[req.storage_index]
            md = sdm[req.storage_index.fqn]
            if getattr(loc, "begin", None) is not None:
                first, length = _rows(req, list(md.size), md.properties.dtype.itemsize, loc)
                if length:
                    ranges[loc.file].append((loc.begin + first, loc.begin + first + length))
            else:
                boxes[req.storage_index].append((tuple(req.storage_offsets), tuple(req.lengths)))
    needed = sum(b - a for spans in ranges.values() for a, b in _coalesce_ranges(spans))
    for index, found in boxes.items():
        needed += _union_volume(found) * sdm[index.fqn].properties.dtype.itemsize
    stored = 0
    for index, loc in storage_data.items():
        md = sdm[index.fqn]
        if getattr(loc, "begin", None) is not None:
            stored += loc.end - loc.begin
        elif hasattr(md, "chunks"):
            sizes = [c.sizes for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())]
            stored += math.prod(sizes[0]) * md.properties.dtype.itemsize if sizes else 0
    return needed, stored


def _union_volume(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """The elements covered by boxes (offsets, lengths), each once (a grid of their edges)."""
    boxes = [(o, n) for o, n in boxes if all(n)]
    if not boxes:
        return 0
    edges = [sorted({o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes}) for d in range(len(boxes[0][0]))]
    covered = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for offsets, lengths in boxes:
        where = tuple(slice(e.index(o), e.index(o + n)) for e, o, n in zip(edges, offsets, lengths))
        covered[where] = True
    widths = [np.diff(np.array(e, dtype=np.int64)) for e in edges]
    if not widths:  # a 0-d tensor
        return 1
    cells = functools.reduce(np.multiply.outer, widths)
    return int(cells[covered].sum())


def requests(reads: Sequence[Read], read_chunk_size: int, max_concurrency: int) -> int:
    """The GETs an object store answers for `reads` (`storage.prefixed.PrefixedObjects.read`: a
    range over twice the chunk size is split into chunk-sized GETs)."""
    total = 0
    for r in reads:
        if r.length > 2 * read_chunk_size and max_concurrency > 1:
            total += -(-r.length // read_chunk_size)
        else:
            total += 1
    return total


__all__ = [
    "ItemLayout",
    "Read",
    "RankReads",
    "Target",
    "ckpt_reads",
    "foreign_bytes",
    "foreign_reads",
    "item_layout",
    "requests",
]
