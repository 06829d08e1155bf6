"""DCP StorageReader over a ckptlib Storage: reads DCP's file layout (see `dcp_writer`)
and verifies every item a rank reads against the manifest.

Errors name the file and, for shard files, the rank that wrote it; DCP adds the rank that
failed to read it (`_torch.dcp_shims.dcp_failures`).

Performance (see docs/benchmarks.md): `CkptReader._read_tensor_direct` reads a tensor
item's data record straight into the destination tensor and checksums it there; a
resharded load reads only the rows it needs (verified: rounded out to the file's checksum
blocks, plus the blocks of the zip records that located them). Smaller items are read whole
and, when their own header says what `.metadata` declares, decoded from one parse of their
zip directory instead of torch.load (`item_decoder`).
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .._torch import serialization
from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from ..storage import Storage, SupportsDirectReads
from ..storage.local import open_regular
from .block_checks import _CRC_CHUNK, _BlockCheck, _ItemCheck
from .checksum import crc32
from .file_names import whose
from .item_decoder import DeclaredChunks
from .load_planner import SafeLoadPlanner
from .manifest import METADATA_NAME, Manifest, check_name
from .planned_reader import PlannedReader
from .ranged_io import (
    _MAX_SPAN,
    ReadInto,
    _byte_view,
    _coalesce,
    _coalesce_ranges,
    _MemReader,
    _pread_into,
    _Window,
)
from .safe_pickle import load_object
from .stream_transforms import Transforms, decoded_limit, descriptors_of

# Items at least this large are read through the zero-copy path (their layout comes from a
# zip-directory parse, or a metadata-only torch.load of the item; ~0.1-1 ms); smaller ones
# are read whole and decoded with torch.load.
_DIRECT_MIN = 1 << 20
# Chunk of the streaming (unverified) reads.
_CHUNK = 4 << 20


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


class CkptReader(PlannedReader):
    """Reads exactly the byte ranges this rank's load plan needs and verifies their CRCs."""

    def __init__(
        self,
        storage: Storage,
        metadata: Metadata,
        manifest: Manifest | None,
        *,
        verify: bool = True,
        trusted: bool = False,
        transforms: Transforms | None = None,
    ):
        super().__init__(metadata)
        self.chunks = DeclaredChunks(metadata)  # what .metadata declares, and decodings that rely on it
        self.storage = storage
        self.manifest = manifest
        self.verify = verify and manifest is not None
        # Objects are unpickled with weights_only here unless `trusted`, whatever the planner
        # does with them (DCP's own planner unpickles them with weights_only=False).
        self.trusted = trusted
        self.transforms = transforms or Transforms()  # DCP extensions (zstd...) items are stored with
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
        if isinstance(storage, SupportsDirectReads) and hasattr(os, "preadv"):
            return storage.direct_read_path(name)
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
                raise CheckpointCorruptError(
                    f"{where}: shard file is truncated{whose(name)}: {exc}", path=where
                ) from exc
            self.bytes_read += length
            for req, info in by_span[(off, length)]:
                start = info.offset - off
                data = blob[start : start + info.length]
                self._check_item(name, crcs, info.offset, data)
                self._apply(name, req, info, data, planner)
            del blob

    def _partial(self, req, info) -> bool:
        """Whether a large tensor request needs only part of its stored chunk (a resharded load)."""
        if req.type == LoadItemType.BYTE_IO or info.length < _DIRECT_MIN or descriptors_of(info):
            return False
        found = self.chunks.declared(req.storage_index.fqn, req.storage_index.offset)
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
                        f"{where}: item at offset {info.offset} is not recorded in the manifest{whose(name)}",
                        path=where,
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
            fd, size = open_regular(path)  # a FIFO or device in its place: NotARegularFileError
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
        try:
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
                    and not descriptors_of(info)
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
            layout = self.chunks.ckptlib_layout(read_into, info, req) if self.manifest is not None else None
            if layout is None:
                if fd is None:
                    return False
                meta = torch.load(_Window(fd, info.offset, info.length), map_location="meta", weights_only=True)
                # torch.load parsed the whole archive: only the item's CRC verifies that
                layout = meta, serialization.meta_storage_offset(meta), [(0, info.length)]
            meta, record, parsed = layout
            declared = self.chunks.declared(req.storage_index.fqn, req.storage_index.offset)
            if (
                (declared is not None and (tuple(meta.shape) != declared[1] or meta.dtype != declared[0]))
                or type(meta) not in (torch.Tensor, torch.nn.Parameter)
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
        if target.device.type == "cpu" and target.is_contiguous() and target.dtype == meta.dtype and region is sub:
            dest = target
        else:
            dest = torch.empty(region.size(), dtype=meta.dtype)
        begin = record + first * size
        end = begin + count * size
        view = _byte_view(dest)
        check = None if expected is None else self._check_for(name, info, begin, end, expected[1], parsed)
        if check is not None and not any(
            lo <= info.offset + begin and info.offset + end <= hi for lo, hi in check.ranges
        ):
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
        """Hand one verified item (its bytes in memory, as stored) to the planner."""
        where = f"{self.storage.uri}/{name}"
        descriptors = descriptors_of(info)
        if descriptors:
            declared = self.chunks.declared(req.storage_index.fqn, req.storage_index.offset)
            nbytes = None if declared is None else math.prod(declared[1]) * declared[0].itemsize
            data = self.transforms.decode(data, descriptors, decoded_limit(nbytes), f"{where} (item at {info.offset})")
        if req.type == LoadItemType.BYTE_IO:
            try:
                if not self.trusted and not isinstance(planner, SafeLoadPlanner):
                    load_object(data.tobytes(), f"object {req.dest_index.fqn!r}")  # refused before the planner sees it
                planner.load_bytes(req, io.BytesIO(data.tobytes()))
            except UnsafeCheckpointError as exc:
                if exc.path is None:
                    exc.path = where
                    exc.message = f"{where}{whose(name)}: {exc.message}"
                    exc.args = (exc.message,)
                raise
            return
        try:
            tensor = self.chunks.decode_plain(req, data)
            if tensor is None:
                tensor = torch.load(_MemReader(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointCorruptError(
                f"{where}: cannot decode tensor {req.storage_index.fqn} at offset {info.offset}{whose(name)}: {exc}",
                path=where,
            ) from exc
        fqn = req.storage_index.fqn
        declared = self.chunks.declared(fqn, req.storage_index.offset)
        stored = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else None
        if stored is None or (declared is not None and stored != (declared[1], declared[0])):
            what = f"shape {stored[0]} and dtype {stored[1]}" if stored else f"a {type(tensor).__name__}"
            want = f"shape {declared[1]} and dtype {declared[0]}" if declared else "a tensor"
            raise CheckpointCorruptError(
                f"{where}: {fqn}: the stored item at offset {info.offset} holds {what}, but {METADATA_NAME} "
                f"declares {want}{whose(name)}",
                path=where,
            )
        try:
            tensor = _narrowed(tensor, req)
        except (RuntimeError, IndexError) as exc:
            raise CheckpointCorruptError(
                f"{where}: {fqn}: the load asks for part {list(req.storage_offsets)}+{list(req.lengths)} of a stored "
                f"chunk of shape {tuple(tensor.shape)}{whose(name)}: {exc}",
                path=where,
            ) from exc
        target = _resolve_target(planner, req, tensor, where)
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_file: dict[str, list[Any]] = defaultdict(list)
        self.transforms.check_readable((self.storage_data[req.storage_index] for req in plan.items), self.storage.uri)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
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
