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

Copies and read-once (see `copies` and `read_schedule`): each file is read from the first of
this rank's copies that holds it intact, and items several ranks need are read by one rank
and handed to the others (`shared_reads`, through the transport `ckptlib.loading.read_exchange`
injects as `exchange`).
"""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import progress
from ckptlib.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from ckptlib.format.items.checksum import crc32
from ckptlib.format.items.item_decoder import DeclaredChunks
from ckptlib.format.items.ranged_io import _MAX_SPAN, _coalesce, _MemReader, _pread_into
from ckptlib.format.native import plan_codec
from ckptlib.format.native.file_names import item_name, whose
from ckptlib.format.native.manifest import METADATA_NAME, Manifest, check_name
from ckptlib.format.native.safe_pickle import load_object
from ckptlib.format.native.stream_transforms import Transforms, decoded_limit, descriptors_of
from ckptlib.format.read import read_schedule, shared_reads
from ckptlib.format.read.copies import Copies, read_over_copies
from ckptlib.format.read.direct_reads import DirectReads, _narrowed, _resolve_target
from ckptlib.format.read.load_planner import SafeLoadPlanner
from ckptlib.format.read.planned_reader import PlannedReader
from ckptlib.storage.base import Storage, SupportsDirectReads
from ckptlib.storage.local import open_regular

# Items at least this large are read through the zero-copy path (their layout comes from a
# zip-directory parse, or a metadata-only torch.load of the item; ~0.1-1 ms); smaller ones
# are read whole and decoded with torch.load.
_DIRECT_MIN = 1 << 20

Consume = Callable[[Any, Any, memoryview], None]  # (request, storage record, verified item bytes)


class CkptReader(DirectReads, PlannedReader):
    """Reads exactly the byte ranges this rank's load plan needs and verifies their CRCs."""

    def __init__(
        self,
        storage: Storage,
        metadata: Metadata,
        manifest: Manifest | None,
        *,
        verify: bool = True,
        copies: Copies | None = None,
        trusted: bool = False,
        transforms: Transforms | None = None,
    ):
        super().__init__(metadata)
        self.chunks = DeclaredChunks(metadata)  # what .metadata declares, and decodings that rely on it
        self.storage = storage  # names the checkpoint; during a read, the copy being read
        self.manifest = manifest
        self.verify = verify and manifest is not None
        self.rank = 0
        self._verified: dict[str, set[int]] = {}  # file -> blocks the current load verified
        self.plain = copies is None  # a plain load: one copy, today's errors as they are
        self.copies = copies if copies is not None else Copies.single(storage)
        self.excluded: frozenset[tuple[str, str]] = frozenset()  # (copy key, file) that failed on some rank
        self.tried: dict[str, list[tuple[str, str, str]]] = {}  # file -> (label, uri, problem) of failed copies
        # (copy key, file) -> (label, uri, problem): every copy this rank found unusable, fallen back from or not
        self.unusable: dict[tuple[str, str], tuple[str, str, str]] = {}
        self.exchange: shared_reads.Transport | None = None  # set by ckptlib.loading.read_exchange
        self.read_once = True
        self.bytes_by_source: dict[str, int] = {}
        self.bytes_received = 0
        self.role: read_schedule.RankRole | None = None  # this rank's part of the last load's reads
        self._done: set[int] = set()  # id() of the requests the current attempt applied
        # Objects are unpickled with weights_only here unless `trusted`, whatever the planner
        # does with them (DCP's own planner unpickles them with weights_only=False).
        self.trusted = trusted
        self.transforms = transforms or Transforms()  # DCP extensions (zstd...) items are stored with

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
                f"{where}: checksum mismatch in {self.item_name(name, off)} at offset {off} (length {len(data)})"
                f"{whose(name)}",
                path=where,
            )

    def item_name(self, name: str, offset: int) -> str:
        """The item of file `name` at `offset` as a user knows it (`file_names.item_name`)."""
        return item_name(getattr(self, "storage_data", None), name, offset)

    # -- reading ------------------------------------------------------------------------
    def _local_file(self, name: str) -> str | None:
        """The shard file's path when the storage is a plain local directory (the zero-copy
        path reads it with preadv); None for other backends, which go through `storage.read`."""
        storage = self.storage
        if isinstance(storage, SupportsDirectReads) and hasattr(os, "preadv"):
            return storage.direct_read_path(name)
        return None

    def _read_spans(self, name: str, reqs: list[Any], crcs, consume: Consume, gap: int | None = None) -> None:
        """Any backend: coalesced ranged reads (few round trips on S3), one span in memory at a
        time; `gap`: the most bytes between two items read through rather than skipped."""
        where = f"{self.storage.uri}/{name}"
        spans = [(info.offset, info.length) for _, info in reqs]
        spans = _coalesce(spans, max_span=_MAX_SPAN) if gap is None else _coalesce(spans, _MAX_SPAN, gap)
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
            progress.advance(length)
            for req, info in by_span[(off, length)]:
                start = info.offset - off
                data = blob[start : start + info.length]
                self._check_item(name, crcs, info.offset, data)
                consume(req, info, data)
            del blob

    def _partial(self, req, info) -> bool:
        """Whether a large tensor request needs only part of its stored chunk (a resharded load)."""
        if req.type == LoadItemType.BYTE_IO or info.length < _DIRECT_MIN or descriptors_of(info):
            return False
        found = self.chunks.declared(req.storage_index.fqn, req.storage_index.offset)
        return found is not None and tuple(req.lengths) != tuple(found[1])

    def _read_remote(self, name: str, reqs: list[Any], crcs, planner: LoadPlanner, gap: int | None = None) -> None:
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
            expected = _recorded_crc(crcs, info, where, name)
            try:
                done = self._read_tensor_direct(read_into, name, req, info, expected, planner)
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
            if not done:
                rest.append((req, info))
        if rest:
            self._read_spans(name, rest, crcs, lambda req, info, data: self._apply(name, req, info, data, planner), gap)

    def _read_local(self, name: str, path: str, reqs: list[Any], crcs, planner: LoadPlanner, consume: Consume):
        """A local file: large tensor items straight into their destination (`DirectReads`),
        the rest whole into memory and handed to `consume`."""
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
                expected = _recorded_crc(crcs, info, where, name)
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
                progress.advance(got)
                if got != info.length:
                    raise CheckpointCorruptError(
                        f"{where}: shard file is truncated{whose(name)}: {path}: wanted {info.length} bytes at "
                        f"offset {info.offset}, file holds {info.offset + got}",
                        path=where,
                    )
                self._check_item(name, crcs, info.offset, data)
                consume(req, info, data)
        finally:
            os.close(fd)

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
            self._done.add(id(req))
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
        self._done.add(id(req))

    # -- copies and shared reads -------------------------------------------------------------
    def _read_file(self, name: str, reqs: list[Any], planner: LoadPlanner) -> None:
        """This rank's requests of file `name`, from the first of its copies that serves each intact."""

        def attempt(pending: list[Any]) -> None:
            crcs = self._item_crcs(name) if self.verify else None
            path = self._local_file(name)
            if path is not None:
                self._read_local(
                    name,
                    path,
                    pending,
                    crcs,
                    planner,
                    lambda req, info, data: self._apply(name, req, info, data, planner),
                )
            else:  # not through the gaps between this rank's items where other ranks read
                tight = self.role is not None and name in self.role.tight
                self._read_remote(name, pending, crcs, planner, 0 if tight else None)

        self._done = set()
        read_over_copies(self, name, reqs, attempt, lambda entry: id(entry[0]) in self._done)

    def fetch_block(self, items: tuple[read_schedule.ItemKey, ...]) -> memoryview:
        """The bytes of adjacent stored items of one file, read whole (for this rank and others)
        into one buffer, every item verified; a bad copy is left for the next one, for the items
        not yet verified."""
        name, start, length = read_schedule.block_span((0, (), items))
        buf = memoryview(bytearray(length))
        verified: set[read_schedule.ItemKey] = set()

        def attempt(pending: list[read_schedule.ItemKey]) -> None:
            crcs = self._item_crcs(name) if self.verify else None
            lo, hi = pending[0][1], pending[-1][1] + pending[-1][2]
            self._read_range(name, lo, buf[lo - start : hi - start])
            for key in pending:
                self._check_item(name, crcs, key[1], buf[key[1] - start : key[1] - start + key[2]])
                verified.add(key)

        read_over_copies(self, name, list(items), attempt, lambda key: key in verified)
        return buf

    def _read_range(self, name: str, offset: int, view: memoryview) -> None:
        """File bytes [offset, offset + len(view)) into `view`, from the copy being read."""
        where = f"{self.storage.uri}/{name}"
        path = self._local_file(name)
        try:
            if path is None:  # in pieces of at most _MAX_SPAN: one piece's bytes in memory twice
                got = 0
                while got < view.nbytes:
                    data = self.storage.read(name, offset + got, min(_MAX_SPAN, view.nbytes - got))  # EOFError if short
                    view[got : got + len(data)] = data
                    got += len(data)
                    if not data:
                        break
            else:
                fd, _ = open_regular(path)
                try:
                    got = _pread_into(fd, view, offset)
                finally:
                    os.close(fd)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
        except EOFError as exc:
            raise CheckpointCorruptError(f"{where}: shard file is truncated{whose(name)}: {exc}", path=where) from exc
        self.bytes_read += got
        progress.advance(got)
        if got != view.nbytes:
            raise CheckpointCorruptError(
                f"{where}: shard file is truncated{whose(name)}: wanted {view.nbytes} bytes at offset {offset}, "
                f"got {got}",
                path=where,
            )

    def check_received(self, name: str, offset: int, data: memoryview) -> None:
        """Verify an item another rank read for this one, as if this rank had read it."""
        self._check_item(name, self._item_crcs(name) if self.verify else None, offset, data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        costs, default = self.copies.access(
            lambda: {info.relative_path for info in self.metadata.storage_data.values()}, self.excluded
        )
        plan.storage_data = read_schedule.LocalReads(
            costs, default, self.copies.labels, self.read_once, self.exchange is not None
        )
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        roles = read_schedule.plan_roles(plans, self.storage_data, self.chunks.declared, self.tried)
        return [
            plan_codec.compact_load_plan(LoadPlan(items=plan.items, storage_data=role, planner_data=plan.planner_data))
            for plan, role in zip(plans, roles)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        role = plan.storage_data if isinstance(plan.storage_data, read_schedule.RankRole) else None
        self.role = role
        shared = role.shared if role is not None else frozenset()
        by_file: dict[str, list[Any]] = defaultdict(list)
        wanted: dict[read_schedule.ItemKey, list[Any]] = defaultdict(list)
        held: list[BaseException] = []  # raised after the shared reads: no peer is left waiting
        for req in plan.items:
            try:
                info = self.storage_data[req.storage_index]
                self.transforms.check_readable((info,), self.storage.uri)  # UnsupportedError, never "corrupt"
                name = check_name(info.relative_path, f"{self.storage.uri}/{METADATA_NAME}", "storage record")
            except Exception as exc:  # noqa: BLE001 - held, see above
                held.append(exc)
                continue
            key = (name, info.offset, info.length)
            if key in shared:
                wanted[key].append((req, info))
            else:
                by_file[name].append((req, info))

        self._verified = {}
        try:
            if role is not None and role.rounds:
                if self.exchange is None:
                    raise CheckpointError(
                        f"{self.storage.uri}: this load shares reads between ranks, but this rank's reader has no "
                        "exchange (load through ckptlib.load)",
                        path=self.storage.uri,
                    )
                shared_reads.read_shared(self, role, wanted, planner, self.exchange)
            if held:
                raise held[0]
            for name, reqs in by_file.items():
                self._read_file(name, reqs, planner)
        except (KeyboardInterrupt, SystemExit) as exc:  # DCP gathers Exceptions only: carried
            raise _dist.InterruptedCollective(exc) from None
        finally:
            self.__dict__.pop("_scratch_buf", None)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _recorded_crc(crcs: dict | None, info: Any, where: str, name: str) -> Any:
    """The manifest's (length, crc) of the item at `info.offset` (None when not verifying);
    an item the manifest does not record, or records with another length, is corrupt."""
    if crcs is None:
        return None
    expected = crcs.get(info.offset)
    if expected is None or expected[0] != info.length:
        raise CheckpointCorruptError(
            f"{where}: item at offset {info.offset} is not recorded in the manifest{whose(name)}", path=where
        )
    return expected
