"""DCP StorageWriter/StorageReader over a ckptlib Storage, in DCP's own file layout.

Files are `__{rank}_0.distcp` (each item a `torch.save` blob, back to back) and a pickled
`.metadata` whose storage records are DCP's `_StorageInfo`, so plain `dcp.load` with a
`FileSystemReader` reads what we write. On top of DCP we checksum every item as it is
written and verify every item a rank reads against the manifest.

`.metadata` is marked as ckptlib's (`storage_meta.modules` holds "ckptlib"), so a ckptlib
checkpoint whose manifest is gone is refused instead of loading unverified as plain DCP.
Errors name the file and, for shard files, the rank that wrote it; DCP adds the rank that
failed to read it (`checkpoint._unwrap_dcp_error`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import re
import sys
import zlib
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from .. import compat
from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from ..storage import Storage
from ..storage.local import LocalStorage
from . import item_encoder
from .checksum import crc32, crc32_combine
from .manifest import METADATA_MARKER, METADATA_NAME, FileRecord, Manifest, check_name
from .safe_pickle import safe_loads

_LOCAL_READ = LocalStorage.read  # as imported, before anything could patch it
_SHARD_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def whose(name: str | None) -> str:
    """" (rank 1's shard)" for a DCP shard file name, "" for any other name."""
    match = _SHARD_FILE_RE.match(name or "")
    return f" (rank {int(match.group(1))}'s shard)" if match else ""


def describe_file(name: str) -> str:
    """`name`, plus whose shard it is when it is a DCP shard file: '__1_0.distcp (rank 1's shard)'."""
    return f"{name}{whose(name)}"


def is_ckptlib_metadata(metadata: Any) -> bool:
    """Whether `.metadata` was written by ckptlib's CkptWriter (which also writes a manifest)."""
    modules = getattr(getattr(metadata, "storage_meta", None), "modules", None)
    return isinstance(modules, (list, tuple)) and METADATA_MARKER in modules

# Ranges closer than this are fetched with one read (helps S3; harmless locally).
_COALESCE_GAP = 1 << 20


def _shard_file_name(prefix: str) -> str:
    return f"{prefix}0.distcp"


def _tensor_for_save(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()  # a view would otherwise save its whole storage
    return tensor


# --------------------------------------------------------------------------- fast paths
# Performance notes (measured on the 2-core dev box, see docs/benchmarks.md):
# - CRC-32 comes from `checksum` (zlib-ng when installed, ~14 GiB/s; zlib ~1.1 GiB/s).
# - The writer encodes each tensor item with `item_encoder`: torch.save's exact bytes, with
#   torch's own zip CRC pass (~4 GiB/s) replaced by the zlib-ng pass that the manifest needs
#   anyway. Where that is unavailable it runs torch.save straight into the shard stream
#   through `_CrcSink` (identical bytes to torch.save into a BytesIO, which is what plain DCP
#   writes), instead of into a BytesIO that is then copied.
# - The reader (`CkptReader._read_tensor_direct`) reads a tensor item's data record straight
#   into the destination tensor and checksums it there; a resharded load reads only the rows
#   it needs (verified: rounded out to the file's checksum blocks, plus the blocks of the zip
#   records that located them).
# Items at least this large are read through the zero-copy path (their layout comes from a
# zip-directory parse, or a metadata-only torch.load of the item; ~0.1-1 ms); smaller ones
# are read whole and decoded with torch.load.
_DIRECT_MIN = 1 << 20
# Chunk of the streaming reads; of verified reads, small enough to be checksummed while
# it is still in the reading core's L2 cache (1 MiB a core on the dev box).
_CHUNK = 4 << 20
_CRC_CHUNK = 512 << 10
# Checksum blocks of shard files (`block_size_for`).
_MIN_BLOCK = 1 << 20
_MAX_BLOCKS = 1024
# Upper bound of one coalesced ranged read on backends without a local file (S3).
_MAX_SPAN = 64 << 20


class _ItemCheck:
    """Verifies one whole item: feed it every byte of [start, start + length) in order."""

    def __init__(self, start: int, length: int, expected: int):
        self.ranges = [(start, start + length)]
        self.expected = expected
        self.crc = 0

    def seek(self, pos: int) -> None:
        pass

    def feed(self, chunk: memoryview) -> None:
        self.crc = crc32(chunk, self.crc)

    def failure(self) -> str | None:
        return None if self.crc == self.expected else ""


class _BlockCheck:
    """Verifies the file blocks in `ranges` (block-aligned, sorted, disjoint (lo, hi) byte
    ranges): `seek` to each range's start and feed it that range's bytes in order; a block's
    CRC is compared as soon as its last byte arrives."""

    def __init__(self, ranges: list[tuple[int, int]], block_size: int, blocks: list[int], file_size: int):
        self.ranges = ranges
        self.block_size, self.blocks, self.file_size = block_size, blocks, file_size
        self.pos, self.crc = ranges[0][0], 0
        self.bad: int | None = None

    def seek(self, pos: int) -> None:
        self.pos, self.crc = pos, 0

    def feed(self, chunk: memoryview) -> None:
        done, n = 0, chunk.nbytes
        while done < n:
            take = min(self.block_size - self.pos % self.block_size, n - done)
            self.crc = crc32(chunk[done : done + take], self.crc)
            self.pos += take
            done += take
            if self.pos % self.block_size == 0 or self.pos == self.file_size:
                index = (self.pos - 1) // self.block_size
                if self.crc != self.blocks[index] and self.bad is None:
                    self.bad = index
                self.crc = 0

    def failure(self) -> str | None:
        if self.bad is None:
            return None
        lo = self.bad * self.block_size
        hi = min(lo + self.block_size, self.file_size)
        return f": file block {self.bad} (bytes {lo}..{hi}) does not match its checksum"


def block_size_for(planned_bytes: int) -> int:
    """The checksum block size of a shard file expected to hold `planned_bytes`: 1 MiB, or
    more for files over 1 GiB so no file records more than ~1024 block CRCs (the manifest
    stays small); 0 (no blocks) without a fast crc32_combine."""
    if crc32_combine is None:
        return 0
    size = _MIN_BLOCK
    while planned_bytes > size * _MAX_BLOCKS:
        size *= 2
    return size


class _CrcSink:
    """What the items are written through: forwards to the shard stream and keeps, in one
    pass over the bytes, the CRC-32 of the current item, of the file, and of each block of
    the file (`block_size`; 0: no blocks)."""

    def __init__(self, stream, block_size: int = 0):
        self.stream = stream
        self.pos = 0
        self.file_crc = 0
        self.item_crc = 0
        self.block_size = block_size if crc32_combine is not None else 0
        self.blocks: list[int] = []
        self._block_crc = 0

    def write(self, data, crc: int | None = None) -> int:
        """Write `data`; `crc`, when known, is its CRC-32 (saves computing it again)."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._account(view, crc)
        self.stream.write(view)
        return view.nbytes

    def _account(self, view: memoryview, crc: int | None) -> None:
        n = view.nbytes
        if crc32_combine is None:  # pragma: no cover - without zlib-ng: running CRCs, two passes
            self.item_crc = crc32(view, self.item_crc)
            self.file_crc = crc32(view, self.file_crc)
            self.pos += n
            return
        if not self.block_size:
            self.item_crc = crc32_combine(self.item_crc, crc32(view) if crc is None else crc, n)
            self.pos += n
            return
        done = 0
        while done < n:
            take = min(self.block_size - self.pos % self.block_size, n - done)
            piece = crc if crc is not None and take == n else crc32(view[done : done + take])
            self.item_crc = crc32_combine(self.item_crc, piece, take)
            self._block_crc = crc32_combine(self._block_crc, piece, take)
            self.pos += take
            done += take
            if self.pos % self.block_size == 0:
                self.blocks.append(self._block_crc)
                self._block_crc = 0

    def write_encoded(self, item: item_encoder.EncodedItem) -> None:
        """Write an item whose pieces' CRCs are already known."""
        for chunk, crc in zip(item.chunks, item.crcs):
            self.write(chunk, crc)

    def end_item(self, length: int) -> None:
        """Fold the finished item's CRC into the file's (one pass over the bytes, not two)."""
        if crc32_combine is not None:
            self.file_crc = crc32_combine(self.file_crc, self.item_crc, length)

    def end_file(self) -> None:
        if self.block_size and self.pos % self.block_size:
            self.blocks.append(self._block_crc)  # the last, short block
            self._block_crc = 0

    def flush(self) -> None:
        pass


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


_TOTAL_BYTES_ATTR = "_ckptlib_total_bytes"


def checkpoint_bytes(metadata: Metadata) -> int | None:
    """The committed checkpoint's size (every file), from the Metadata dcp.save returned."""
    return getattr(metadata, _TOTAL_BYTES_ATTR, None)


@dataclasses.dataclass(frozen=True)
class _WithFileRecord:
    """A rank's first WriteResult.storage_data, carrying its shard's FileRecord to the
    coordinator's `finish` inside DCP's own gather (unwrapped there, never in `.metadata`)."""

    info: Any
    name: str
    record: FileRecord


class CkptWriter(StorageWriter):
    """Writes one shard file per rank through `storage` and records item checksums.

    `prepare()` runs on the coordinator before any rank writes (inside DCP's planning round),
    `commit(file_records)` on the coordinator after `.metadata` is written (inside DCP's final
    round), so neither costs a collective of its own; DCP raises their errors on every rank.
    After `finish`, the coordinator's `file_records` holds every file of the checkpoint.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prepare: Callable[[], None] | None = None,
        commit: Callable[[dict[str, FileRecord]], Any] | None = None,
    ):
        super().__init__()
        self.storage = storage
        self.is_coordinator = False
        self.file_records: dict[str, FileRecord] = {}
        self._prepare = prepare
        self._commit = commit

    def reset(self, checkpoint_id=None) -> None:
        self.file_records = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._prepare is not None:
            self._prepare()
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = _shard_file_name(plan.storage_data)
        storage_info = compat.storage_info_cls()
        results: list[WriteResult] = []
        items: list[tuple[int, int, int]] = []
        file_crc = 0
        offset = 0
        ordered: list[WriteItem] = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        ordered += [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        planned = sum(
            math.prod(wi.tensor_data.chunk.sizes) * wi.tensor_data.properties.dtype.itemsize  # this rank's chunk
            for wi in ordered
            if wi.tensor_data is not None
        )
        with self.storage.open_writer(name) as stream:
            sink = _CrcSink(stream, block_size_for(planned))
            for item in ordered:
                data = planner.resolve_data(item)
                sink.item_crc = 0
                if isinstance(data, io.BytesIO):
                    sink.write(data.getbuffer())
                else:
                    tensor = _tensor_for_save(data)
                    encoded = item_encoder.encode(tensor, sink.pos, sink.block_size)
                    if encoded is not None:
                        sink.write_encoded(encoded)
                    else:  # straight into the stream: identical bytes to torch.save into a BytesIO
                        torch.save(tensor, sink)
                    del tensor, encoded
                del data  # never hold this item while the planner resolves the next one
                length = sink.pos - offset
                sink.end_item(length)
                items.append((offset, length, sink.item_crc))
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, offset, length))
                )
                offset = sink.pos
            sink.end_file()
            file_crc = sink.file_crc
        record = FileRecord(size=offset, crc32=file_crc, items=items, block_size=sink.block_size, blocks=sink.blocks)
        self.file_records[name] = record
        if results:
            first = results[0]
            results[0] = dataclasses.replace(first, storage_data=_WithFileRecord(first.storage_data, name, record))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: dict[str, FileRecord] = {}
        storage_data = {}
        for rank, per_rank in enumerate(results):
            for wr in per_rank:
                info = wr.storage_data
                if isinstance(info, _WithFileRecord):
                    records[info.name] = info.record
                    info = info.info
                storage_data[wr.index] = info
            if not per_rank:  # a rank with nothing to save still wrote its (empty) shard file
                records[_shard_file_name(f"__{rank}_")] = FileRecord(size=0, crc32=0, items=[])
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        self.storage.write(METADATA_NAME, blob, durable=False)  # `commit` syncs it with the shards
        records[METADATA_NAME] = FileRecord(size=len(blob), crc32=zlib.crc32(blob), items=[(0, len(blob), zlib.crc32(blob))])
        self.file_records = records
        # DCP hands this object (pickled) back to every rank from dcp.save: the checkpoint's
        # size then needs no collective of its own (`checkpoint_bytes`). Set after the blob
        # was written, so it is not in `.metadata`.
        setattr(metadata, _TOTAL_BYTES_ATTR, sum(r.size for r in records.values()))
        if self._commit is not None:
            self._commit(records)

    def storage_meta(self) -> StorageMeta | None:
        meta = StorageMeta(checkpoint_id=self.storage.uri)
        # An attribute, not a constructor argument: torch versions whose StorageMeta lacks the
        # `modules` field still pickle and unpickle it (in __dict__), and plain dcp.load ignores it.
        meta.modules = [*(getattr(meta, "modules", None) or []), METADATA_MARKER]
        return meta

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def read_metadata(storage: Storage, manifest: Manifest | None, *, verify: bool = True) -> Metadata:
    """Read and safely unpickle `.metadata`, checking it against the manifest first."""
    where = f"{storage.uri}/{METADATA_NAME}"
    try:
        blob = storage.read(METADATA_NAME)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where}: DCP metadata file is missing", path=where) from exc
    if manifest is not None and verify:
        record = manifest.files.get(METADATA_NAME)
        if record is None:
            raise CheckpointCorruptError(f"{where}: not listed in the manifest", path=where)
        if len(blob) != record.size or zlib.crc32(blob) != record.crc32:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch (size {len(blob)} vs {record.size} in the manifest)", path=where
            )
    metadata = safe_loads(blob, where)
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: holds {type(metadata).__name__}, not DCP Metadata", path=where)
    return metadata


def _coalesce_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (lo, hi) ranges with overlapping or touching ones merged."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _coalesce(spans: list[tuple[int, int]], max_span: int | None = None) -> list[tuple[int, int]]:
    """Merge (offset, length) spans, sorted, that lie within _COALESCE_GAP of each other (into
    spans of at most `max_span` bytes, unless a single item is larger)."""
    merged: list[list[int]] = []
    for off, length in sorted(spans):
        if (
            merged
            and off <= merged[-1][0] + merged[-1][1] + _COALESCE_GAP
            and (max_span is None or max(merged[-1][0] + merged[-1][1], off + length) - merged[-1][0] <= max_span)
        ):
            end = max(merged[-1][0] + merged[-1][1], off + length)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([off, length])
    return [(a, b) for a, b in merged]


def _narrowed(tensor: torch.Tensor, req) -> torch.Tensor:
    """The part of a stored chunk that a read request asks for."""
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _resolve_target(planner: LoadPlanner, req, stored: torch.Tensor, where: str) -> torch.Tensor:
    """The planner's destination for `req`, which must have the shape of the `stored` part."""
    target = planner.resolve_tensor(req).detach()
    if target.size() != stored.size():
        raise CheckpointCorruptError(
            f"{where}: {req.storage_index.fqn}: stored chunk has shape {tuple(stored.size())}, "
            f"expected {tuple(target.size())}",
            path=where,
        )
    return target


class PlannedReader(StorageReader):
    """A StorageReader whose DCP metadata is known before the load starts (read once on rank 0
    and broadcast): the planning hooks pass plans through; subclasses implement read_data."""

    def __init__(self, metadata: Metadata):
        super().__init__()
        self.metadata = metadata
        self.storage_data: dict[MetadataIndex, Any] = metadata.storage_data
        self.bytes_read = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class CkptReader(PlannedReader):
    """Reads exactly the byte ranges this rank's load plan needs and verifies their CRCs."""

    def __init__(self, storage: Storage, metadata: Metadata, manifest: Manifest | None, *, verify: bool = True):
        super().__init__(metadata)
        self.storage = storage
        self.manifest = manifest
        self.verify = verify and manifest is not None
        self.rank = 0
        self._verified: dict[str, set[int]] = {}  # file -> blocks the current load verified

    def _item_crcs(self, name: str) -> dict[int, tuple[int, int]]:
        assert self.manifest is not None
        record = self.manifest.files.get(name)
        if record is None:
            where = f"{self.storage.uri}/{name}"
            raise CheckpointCorruptError(
                f"{where}: referenced by .metadata but not listed in the manifest{whose(name)}", path=where
            )
        return {off: (length, crc) for off, length, crc in record.items}

    def _check_item(self, name: str, crcs: dict[int, tuple[int, int]] | None, off: int, data: memoryview) -> None:
        if crcs is None:
            return
        expected = crcs.get(off)
        where = f"{self.storage.uri}/{name}"
        if expected is None or expected[0] != len(data):
            raise CheckpointCorruptError(
                f"{where}: item at offset {off} is not recorded in the manifest{whose(name)}", path=where
            )
        if crc32(data) != expected[1]:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch in item at offset {off} (length {len(data)}){whose(name)}", path=where
            )

    # -- reading ------------------------------------------------------------------------
    def _local_file(self, name: str) -> str | None:
        """The shard file's path when the storage is a plain local directory (the zero-copy
        path reads it with preadv); None for other backends, which go through `storage.read`."""
        storage = self.storage
        # A storage whose read() was replaced (fault injection, instrumentation) is read through it.
        if isinstance(storage, LocalStorage) and type(storage).read is _LOCAL_READ and hasattr(os, "preadv"):
            return storage.local_path(name)
        return None

    def _read_spans(self, name: str, reqs: list[Any], crcs, planner: LoadPlanner) -> None:
        """Any backend: coalesced ranged reads (few round trips on S3), one span in memory at a time."""
        where = f"{self.storage.uri}/{name}"
        spans = _coalesce([(info.offset, info.length) for _, info in reqs], max_span=_MAX_SPAN)
        by_span: dict[tuple[int, int], list[Any]] = defaultdict(list)
        for req, info in reqs:
            span = next(s for s in spans if s[0] <= info.offset and info.offset + info.length <= s[0] + s[1])
            by_span[span].append((req, info))
        for off, length in spans:
            try:
                blob = memoryview(self.storage.read(name, off, length))
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
            except EOFError as exc:
                raise CheckpointCorruptError(f"{where}: shard file is truncated{whose(name)}: {exc}", path=where) from exc
            self.bytes_read += length
            for req, info in by_span[(off, length)]:
                start = info.offset - off
                data = blob[start : start + info.length]
                self._check_item(name, crcs, info.offset, data)
                self._apply(name, req, info, data, planner)
            del blob

    def _partial(self, req, info) -> bool:
        """Whether a large tensor request needs only part of its stored chunk (a resharded load)."""
        if req.type == LoadItemType.BYTE_IO or info.length < _DIRECT_MIN:
            return False
        found = self._chunk_sizes(req.storage_index.fqn, req.storage_index.offset)
        return found is not None and tuple(req.lengths) != tuple(found[1])

    def _read_remote(self, name: str, reqs: list[Any], crcs, planner: LoadPlanner) -> None:
        """Object stores: a request for part of a large stored chunk reads just its rows (and,
        verified, the blocks around them) with ranged reads; everything else goes through
        coalesced whole-item reads (`_read_spans`)."""
        record = self.manifest.files.get(name) if self.manifest is not None else None
        direct_ok = record is not None and (crcs is None or record.block_size > 0)
        rest = []
        read_into = self._remote_read_into(name)
        where = f"{self.storage.uri}/{name}"
        for req, info in reqs:
            if not (direct_ok and self._partial(req, info)):
                rest.append((req, info))
                continue
            expected = None
            if crcs is not None:
                expected = crcs.get(info.offset)
                if expected is None or expected[0] != info.length:
                    raise CheckpointCorruptError(
                        f"{where}: item at offset {info.offset} is not recorded in the manifest{whose(name)}", path=where
                    )
            try:
                done = self._read_tensor_direct(read_into, name, req, info, expected, planner)
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
            if not done:
                rest.append((req, info))
        if rest:
            self._read_spans(name, rest, crcs, planner)

    def _read_local(self, name: str, path: str, reqs: list[Any], crcs, planner: LoadPlanner) -> None:
        where = f"{self.storage.uri}/{name}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
        try:
            size = os.fstat(fd).st_size
            for req, info in sorted(reqs, key=lambda r: r[1].offset):
                if info.offset + info.length > size:
                    raise CheckpointCorruptError(
                        f"{where}: shard file is truncated{whose(name)}: {path}: wanted {info.length} bytes at "
                        f"offset {info.offset}, file holds {size}",
                        path=where,
                    )
                expected = None
                if crcs is not None:
                    expected = crcs.get(info.offset)
                    if expected is None or expected[0] != info.length:
                        raise CheckpointCorruptError(
                            f"{where}: item at offset {info.offset} is not recorded in the manifest{whose(name)}",
                            path=where,
                        )
                if (
                    req.type != LoadItemType.BYTE_IO
                    and info.length >= _DIRECT_MIN
                    and self._read_local_tensor(fd, name, req, info, expected, planner)
                ):
                    continue
                data = memoryview(bytearray(info.length))
                got = _pread_into(fd, data, info.offset)
                self.bytes_read += got
                if got != info.length:
                    raise CheckpointCorruptError(
                        f"{where}: shard file is truncated{whose(name)}: {path}: wanted {info.length} bytes at "
                        f"offset {info.offset}, file holds {info.offset + got}",
                        path=where,
                    )
                self._check_item(name, crcs, info.offset, data)
                self._apply(name, req, info, data, planner)
        finally:
            os.close(fd)

    def _scratch(self, size: int = _CRC_CHUNK) -> memoryview:
        buf = getattr(self, "_scratch_buf", None)
        if buf is None or buf.nbytes < size:
            buf = self._scratch_buf = memoryview(bytearray(size))
        return buf

    def _feed_range(self, read_into: ReadInto, start: int, end: int, check, chunk: int = _CRC_CHUNK) -> None:
        """Feed file bytes [start, end) to `check`, read in `chunk`-sized pieces into scratch."""
        if end <= start:
            return
        scratch = self._scratch(min(chunk, end - start))
        pos = start
        while pos < end:
            n = read_into(scratch[: min(scratch.nbytes, end - pos)], pos)
            if n <= 0:
                raise EOFError(f"short read at offset {pos}")
            check.feed(scratch[:n])
            self.bytes_read += n
            pos += n

    def _check_for(self, name: str, info, begin: int, end: int, item_crc: int, parsed: list[tuple[int, int]]):
        """How to verify a read of item bytes [begin, end) located by the item bytes in
        `parsed`: by the file blocks that cover both, when the manifest has block CRCs and
        that reads fewer bytes than the item (a resharded load needing part of a stored
        chunk), else by the whole item's CRC."""
        record = self.manifest.files.get(name) if self.manifest is not None else None
        bs = record.block_size if record is not None else 0
        if bs:

            def blocks_of(a: int, b: int) -> range:
                return range((info.offset + a) // bs, -(-(info.offset + b) // bs)) if b > a else range(0)

            # The rows' blocks always; the locating bytes' blocks unless this load verified
            # them already (an item's zip directory and the next item's header often share one).
            wanted = set(blocks_of(begin, end))
            for a, b in parsed:
                wanted.update(i for i in blocks_of(a, b) if i not in self._verified.get(name, ()))
            ranges = _coalesce_ranges([(i * bs, min((i + 1) * bs, record.size)) for i in wanted])
            if sum(b - a for a, b in ranges) < info.length:
                return _BlockCheck(ranges, bs, record.blocks, record.size)
        return _ItemCheck(info.offset, info.length, item_crc)

    def _chunk_sizes(self, fqn: str, offsets) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """dtype and size of the stored chunk of `fqn` at `offsets`, from `.metadata`."""
        cache = self.__dict__.setdefault("_chunks", {})
        if fqn not in cache:
            md = self.metadata.state_dict_metadata.get(fqn)
            chunks = getattr(md, "chunks", None)
            if chunks is None:
                cache[fqn] = None
            else:
                cache[fqn] = (md.properties.dtype, {tuple(c.offsets): tuple(c.sizes) for c in chunks})
        found = cache[fqn]
        if found is None:
            return None
        sizes = found[1].get(tuple(offsets))
        return None if sizes is None else (found[0], sizes)

    def _ckptlib_layout(self, read_into: ReadInto, info, req) -> tuple[torch.Tensor, int, list] | None:
        """(meta tensor, offset of its data record in the item, the item ranges whose bytes
        said so) without unpickling anything.

        CkptWriter saves every tensor item contiguous and with its own storage, so shape and
        dtype are those of the chunk in `.metadata`, and the data is the item's only
        `*/data/<key>` zip record, which must be stored uncompressed and exactly that large.
        Anything else: None, and the caller decodes the item's header with torch.load (a
        metadata-only load costs ~1 ms an item, this two reads and ~30 us)."""
        found = self._chunk_sizes(req.storage_index.fqn, req.storage_index.offset)
        if found is None:
            return None
        dtype, sizes = found
        record = item_encoder.tensor_data_record(_cached_tail_reader(read_into, info.offset, info.length), info.length)
        meta = torch.empty(sizes, dtype=dtype, device="meta")
        if record is None or record.size != meta.numel() * meta.element_size():
            return None
        return meta, record.start, record.parsed

    def _read_local_tensor(self, fd: int, name: str, req, info, expected, planner: LoadPlanner) -> bool:
        """Read one tensor item of a local shard file without intermediate copies (see
        `_read_tensor_direct`), decoding a non-ckptlib item's header with a metadata-only
        torch.load."""

        def read_into(view: memoryview, offset: int) -> int:
            return _pread_into(fd, view, offset)

        return self._read_tensor_direct(read_into, name, req, info, expected, planner, fd=fd)

    def _remote_read_into(self, name: str) -> ReadInto:
        def read_into(view: memoryview, offset: int) -> int:
            data = self.storage.read(name, offset, view.nbytes)  # EOFError when the file is short
            view[: len(data)] = data
            return len(data)

        return read_into

    def _read_tensor_direct(
        self, read_into: ReadInto, name: str, req, info, expected, planner: LoadPlanner, *, fd: int | None = None
    ) -> bool:
        """Read one tensor item straight into its destination: find its data record (the
        zip directory, or for other items a metadata-only torch.load of a local file `fd`),
        read the rows the request needs, and verify them by the item's CRC or, when that
        reads less, the file blocks that cover them (the rest of the item is not read).
        Local files are read in L2-sized chunks checksummed as they land; remote ones in
        large ranged reads. Returns False to leave an item of an unexpected shape to the
        generic path (which reports what is wrong with it)."""
        where = f"{self.storage.uri}/{name}"
        try:
            layout = self._ckptlib_layout(read_into, info, req) if self.manifest is not None else None
            if layout is None:
                if fd is None:
                    return False
                meta = torch.load(_Window(fd, info.offset, info.length), map_location="meta", weights_only=True)
                # torch.load parsed the whole archive: only the item's CRC verifies that
                layout = meta, getattr(meta.untyped_storage(), "_checkpoint_offset", None), [(0, info.length)]
            meta, record, parsed = layout
            if (
                type(meta) not in (torch.Tensor, torch.nn.Parameter)
                or meta.layout != torch.strided
                or not meta.is_contiguous()
                or not isinstance(record, int)
                or record < 0
                or record + meta.untyped_storage().nbytes() > info.length
                or sys.byteorder != "little"  # torch.save writes native order; ours is little-endian
            ):
                return False
            sub = _narrowed(meta, req)
        except Exception:  # noqa: BLE001 - the generic path decodes it again and reports
            return False
        target = _resolve_target(planner, req, sub, where)
        size = meta.element_size()
        if sub.is_contiguous():  # the whole item, or whole rows of it
            first, count, region = sub.storage_offset(), sub.numel(), sub
        else:  # e.g. a column block: read the stored tensor whole, narrow after
            first, count, region = meta.storage_offset(), meta.numel(), meta
        if (
            target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == meta.dtype
            and region is sub
        ):
            dest = target
        else:
            dest = torch.empty(region.size(), dtype=meta.dtype)
        begin = record + first * size
        end = begin + count * size
        view = _byte_view(dest)
        check = None if expected is None else self._check_for(name, info, begin, end, expected[1], parsed)
        if check is not None and not any(lo <= info.offset + begin and info.offset + end <= hi for lo, hi in check.ranges):
            check = _ItemCheck(info.offset, info.length, expected[1])  # (cannot happen: the rows' cover is a range)
        try:
            # Locally, each chunk is checksummed right after it lands, while it is still in
            # this core's L2 cache: measured here, that costs a third of checksumming from
            # memory, and less than a helper thread overlapping it (whose core does not have
            # the chunk). Remotely, few large reads (each may fan out to parallel GETs).
            if fd is None:
                chunk_size = edge_chunk = _MAX_SPAN
            else:
                chunk_size, edge_chunk = (_CHUNK if check is None else _CRC_CHUNK), _CRC_CHUNK
            rows_lo, rows_hi = info.offset + begin, info.offset + end

            def read_rows() -> None:
                pos = 0
                while pos < view.nbytes:
                    chunk = view[pos : pos + chunk_size]
                    n = read_into(chunk, rows_lo + pos)
                    self.bytes_read += n
                    if n != chunk.nbytes:
                        raise EOFError(f"short read at offset {rows_lo + pos}")
                    if check is not None:
                        check.feed(chunk)
                    pos += n

            if check is None:
                read_rows()
            else:
                for lo, hi in check.ranges:  # the rows lie inside one of them
                    check.seek(lo)
                    if lo <= rows_lo and rows_hi <= hi:
                        self._feed_range(read_into, lo, rows_lo, check, edge_chunk)
                        read_rows()
                        self._feed_range(read_into, rows_hi, hi, check, edge_chunk)
                    else:
                        self._feed_range(read_into, lo, hi, check, edge_chunk)
        except EOFError as exc:
            raise CheckpointCorruptError(f"{where}: shard file is truncated{whose(name)}: {exc}", path=where) from exc
        failure = None if check is None else check.failure()
        if failure is None and isinstance(check, _BlockCheck):
            done = self._verified.setdefault(name, set())
            for lo, hi in check.ranges:
                done.update(range(lo // check.block_size, -(-hi // check.block_size)))
        if failure is not None:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch in item at offset {info.offset} (length {info.length}){whose(name)}"
                f"{failure}",
                path=where,
            )
        if dest is not target:
            if region is not sub:
                dest = _narrowed(dest, req)
            target.copy_(dest)
        planner.commit_tensor(req, target)
        return True

    def _apply(self, name: str, req, info, data: memoryview, planner: LoadPlanner) -> None:
        """Hand one verified item (its bytes in memory) to the planner."""
        where = f"{self.storage.uri}/{name}"
        if req.type == LoadItemType.BYTE_IO:
            try:
                planner.load_bytes(req, io.BytesIO(data.tobytes()))
            except UnsafeCheckpointError as exc:
                if exc.path is None:
                    exc.path = where
                    exc.message = f"{where}{whose(name)}: {exc.message}"
                    exc.args = (exc.message,)
                raise
            return
        try:
            tensor = torch.load(_MemReader(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointCorruptError(
                f"{where}: cannot decode tensor {req.storage_index.fqn} at offset {info.offset}"
                f"{whose(name)}: {exc}",
                path=where,
            ) from exc
        tensor = _narrowed(tensor, req)
        target = _resolve_target(planner, req, tensor, where)
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_file: dict[str, list[Any]] = defaultdict(list)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointCorruptError(
                    f"{self.storage.uri}/{info.relative_path}: stored with DCP extensions "
                    f"{list(info.transform_descriptors)}, which ckptlib does not read",
                    path=self.storage.uri,
                )
            by_file[check_name(info.relative_path, f"{self.storage.uri}/{METADATA_NAME}", "storage record")].append(
                (req, info)
            )

        self._verified = {}
        try:
            for name, reqs in by_file.items():
                crcs = self._item_crcs(name) if self.verify else None
                path = self._local_file(name)
                if path is not None:
                    self._read_local(name, path, reqs, crcs, planner)
                else:
                    self._read_remote(name, reqs, crcs, planner)
        finally:
            self.__dict__.pop("_scratch_buf", None)
        fut: Future = Future()
        fut.set_result(None)
        return fut


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor objects are unpickled with weights_only."""

    def __init__(self, *, trusted: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.trusted = trusted

    def create_local_plan(self):
        # DCP takes a rank that asks for fewer keys than the checkpoint holds for a reader of
        # a pre-2.4 checkpoint and re-flattens its state the 2.3 way, which then misses
        # keys such as "optim.param_groups". A rank whose shard of a parameter is empty asks
        # for fewer keys legitimately (FSDP1 gives it no optimizer state for that parameter):
        # when every key this rank asks for is in the checkpoint, plan with those keys.
        if self.flatten_state_dict and self.metadata is not None:
            if set(self.state_dict) <= set(self.metadata.state_dict_metadata):
                return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        if self.trusted:
            return super().load_bytes(read_item, value)
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is many lines of advice; keep the global it refused.
            text = str(exc)
            found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            if found:
                detail = f"it names the global {found.group(1)}"
            else:
                found = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
                detail = (found.group(1) if found else (text.strip().splitlines() or [""])[0])[:200]
            raise UnsafeCheckpointError(
                f"object {read_item.dest_index.fqn!r} needs arbitrary unpickling ({detail}), which weights_only "
                "loading refuses; pass trusted=True only if you trust this checkpoint's author"
            ) from exc
        if self.flatten_state_dict:
            compat.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
