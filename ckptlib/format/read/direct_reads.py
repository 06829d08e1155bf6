"""Zero-copy reads of large tensor items: a stored item's data record read straight into the
destination tensor and checksummed there, or, for a resharded load, just the rows a rank needs,
verified by the file's checksum blocks around them (see `dcp_reader`)."""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from ckptlib._runtime import progress
from ckptlib._torch import serialization
from ckptlib.errors import CheckpointCorruptError
from ckptlib.format.items.block_checks import _CRC_CHUNK, _BlockCheck, _ItemCheck
from ckptlib.format.items.ranged_io import _MAX_SPAN, ReadInto, _byte_view, _coalesce_ranges, _pread_into, _Window
from ckptlib.format.native.file_names import whose

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


class DirectReads:
    """The zero-copy read path of `dcp_reader.CkptReader` (a mixin: it uses the reader's storage,
    manifest, declared chunks and byte counter)."""

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
            progress.advance(n)
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
                    progress.advance(n)
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
                f"{where}: checksum mismatch in {self.item_name(name, info.offset)} at offset {info.offset} "
                f"(length {info.length}){whose(name)}{failure}",
                path=where,
            )
        if dest is not target:
            if region is not sub:
                dest = _narrowed(dest, req)
            target.copy_(dest)
        planner.commit_tensor(req, target)
        self._done.add(id(req))
        return True
