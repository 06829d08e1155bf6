"""DCP StorageWriter over a ckptlib Storage, in DCP's own file layout.

Files are `__{rank}_0.distcp` (each item a `torch.save` blob, back to back) and a pickled
`.metadata` whose storage records are DCP's `_StorageInfo`, so plain `dcp.load` with a
`FileSystemReader` reads what we write. Every item is checksummed as it is written (the
manifest's file records), and `.metadata` is marked as ckptlib's (`storage_meta.modules`
holds "ckptlib"), so a ckptlib checkpoint whose manifest is gone is refused instead of
loading unverified as plain DCP.

Performance (measured on the 2-core dev box, see docs/benchmarks.md): each tensor item is
encoded with `item_encoder`: torch.save's exact bytes, with torch's own zip CRC pass
(~4 GiB/s) replaced by the zlib-ng pass that the manifest needs anyway. Tensors under
`item_encoder.SMALL_ITEM_BYTES` skip the encoder (its Python work per zip record costs more
than torch's CRC of a small record): their torch.save bytes come from a template per tensor
signature (`item_encoder.small_item_bytes`: torch.save's per-call work, ~0.4 ms, is most of a
small tensor's save), written and CRC'd once. Where the encoder is
unavailable torch.save runs straight into the shard stream through `_CrcSink` (identical
bytes to torch.save into a BytesIO, which is what plain DCP writes), instead of into a
BytesIO that is then copied.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import math
import pickle
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptlib._runtime import progress
from ckptlib._torch import dcp_shims
from ckptlib.format.items import item_encoder
from ckptlib.format.items.block_checks import _CrcSink, block_size_for
from ckptlib.format.native import plan_codec
from ckptlib.format.native.aliases import alias_key
from ckptlib.format.native.manifest import METADATA_MARKER, METADATA_NAME, FileRecord
from ckptlib.format.native.stream_transforms import Transforms
from ckptlib.storage.base import Storage

if TYPE_CHECKING:
    from ckptlib.format.write.transaction import SaveTransaction


def _shard_file_name(prefix: str) -> str:
    return f"{prefix}0.distcp"


def _tensor_for_save(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()  # a view would otherwise save its whole storage
    return tensor


def write_shard(stream, payloads: Iterable[Any], planned_bytes: int) -> FileRecord:
    """Write the items `payloads` yields (torch.save'd objects as BytesIO or bytes, tensors)
    back to back into `stream`, checksumming them in the same pass; the shard's FileRecord.
    `planned_bytes` (the tensors' bytes) sets the checksum block size."""
    sink = _CrcSink(stream, block_size_for(planned_bytes))
    progress.add_total(planned_bytes)
    items: list[tuple[int, int, int]] = []
    offset = 0
    for data in payloads:
        sink.item_crc = 0
        if isinstance(data, io.BytesIO):
            sink.write(data.getbuffer())
        elif not isinstance(data, torch.Tensor):
            sink.write(data)  # an item's bytes, encoded elsewhere
        else:
            tensor = _tensor_for_save(data)
            encoded = None
            if tensor.numel() * tensor.element_size() < item_encoder.SMALL_ITEM_BYTES:
                sink.write(item_encoder.small_item_bytes(tensor))
            elif (encoded := item_encoder.encode(tensor, sink.pos, sink.block_size)) is not None:
                sink.write_encoded(encoded)
            else:  # straight into the stream: identical bytes to torch.save into a BytesIO
                torch.save(tensor, sink)
            del tensor, encoded
        del data  # never hold this item while the next one is resolved
        length = sink.pos - offset
        sink.end_item(length)
        progress.advance(length)
        items.append((offset, length, sink.item_crc))
        offset = sink.pos
    sink.end_file()
    if not items:  # a rank with nothing to save still writes its (empty) shard file
        return FileRecord(size=0, crc32=0, items=[])
    return FileRecord(size=offset, crc32=sink.file_crc, items=items, block_size=sink.block_size, blocks=sink.blocks)


class ShardBackend(Protocol):
    """Where a rank's shard file is encoded and written: in this process (`InProcessShards`),
    or in a writer process (`ckptlib.saving.writer_process`, async saves with async_mode="process").
    Returns the shard's FileRecord; the transaction knows the shard as unfinished meanwhile."""

    def write_shard(
        self, transaction: SaveTransaction, name: str, payloads: Iterable[Any], planned_bytes: int
    ) -> FileRecord: ...


class InProcessShards:
    """Encodes and writes the shard in the calling thread (`write_shard`)."""

    def write_shard(
        self, transaction: SaveTransaction, name: str, payloads: Iterable[Any], planned_bytes: int
    ) -> FileRecord:
        with transaction.open_shard(name) as stream:
            return write_shard(stream, payloads, planned_bytes)


class _Checksummed:
    """A write-only stream that forwards to `stream` and keeps the size and CRC-32 of what passed."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.size = 0
        self.crc = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.stream.write(data)


class _MetadataPickler(pickle.Pickler):
    """`pickle.dump` of `.metadata`, byte for byte, from compactly decoded storage records.

    A record decoded from a rank's write results used to get a `__dict__` of its own whose
    keys were that rank's decoded field names (one string object per rank), and the pickle
    shows it: the first record of each rank spells its keys out, the others refer back to
    them. Decoded records now keep their values inline (~170 bytes less each, issue 25.5);
    this pickler gives each one the state it would have had, with its rank's key objects
    (`record_keys`: shard file name -> decoded names). Everything else pickles as usual."""

    def __init__(self, file, record_keys: dict[str, tuple[str, ...]]) -> None:
        super().__init__(file)  # pickle.dump's default protocol, as before
        self._keys = {name: {key: key for key in keys} for name, keys in record_keys.items()}
        self._cls = dcp_shims.storage_info_cls()

    def reducer_override(self, obj):
        if type(obj) is not self._cls:
            return NotImplemented
        keys = self._keys.get(getattr(obj, "relative_path", None))
        if keys is None:
            return NotImplemented
        getstate = getattr(obj, "__getstate__", None)  # Python 3.10: only where the class defines one
        state = getstate() if getstate is not None else vars(obj)
        return copyreg.__newobj__, (type(obj),), {keys.get(k, k): v for k, v in state.items()}, None, None


class CkptWriter(StorageWriter):
    """Writes one shard file per rank through `storage` and records item checksums, for a
    `SaveTransaction` (`format.transaction`), which owns the save: the writer calls its
    `prepare()` on the coordinator before any rank writes (inside DCP's planning round), opens
    every shard through it, and calls its `commit(file_records, metadata)` on the coordinator
    after `.metadata` is written (inside DCP's final round), so neither costs a collective of
    its own; DCP raises their errors on every rank. After `finish`, the coordinator's
    `file_records` holds every file of the checkpoint. `backend` encodes and writes the
    shard (default: in this thread, `InProcessShards`).
    """

    save_id: str | None = None  # also for a writer built without __init__ (a test's, a subclass's)

    def __init__(
        self,
        storage: Storage,
        *,
        transaction: SaveTransaction,
        backend: ShardBackend | None = None,
        transforms: Transforms | None = None,
        save_id: str | None = None,
    ):
        super().__init__()
        self.storage = storage
        self.transaction = transaction
        self.backend = backend if backend is not None else InProcessShards()
        self.transforms = transforms or Transforms()  # DCP stream extensions every item goes through
        self.save_id = save_id  # recorded in `.metadata`'s StorageMeta when given (DCP's FileSystemWriter does)
        self.is_coordinator = False
        self.file_records: dict[str, FileRecord] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.file_records = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = self.transaction.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan_codec.compact_save_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.transaction.prepare()
        return [
            dataclasses.replace(plan_codec.compact_save_plan(plan), storage_data=f"__{i}_")
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = plan_codec.WriteResults()
        results.info_cls = dcp_shims.storage_info_cls()
        try:
            self._write_shard(_shard_file_name(plan.storage_data), plan, planner, results)
        except BaseException as exc:
            if not self.transaction.self_cleaning:
                raise
            # Carried to the coordinator's `finish` by DCP's gather, which then cleans up
            # after every rank stopped writing (see SaveTransaction.self_cleaning).
            results.failure = self.transaction.portable_failure(exc)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_shard(self, name: str, plan: SavePlan, planner: SavePlanner, results: list) -> None:
        storage_info = dcp_shims.storage_info_cls()
        ordered: list[WriteItem] = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        ordered += [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        planned = sum(
            math.prod(wi.tensor_data.chunk.sizes) * wi.tensor_data.properties.dtype.itemsize  # this rank's chunk
            for wi in ordered
            if wi.tensor_data is not None
        )
        slots: list[tuple[int, list[str]]] = []  # per item: its stored item in the shard, its extensions
        record = self.backend.write_shard(self.transaction, name, self._payloads(ordered, planner, slots), planned)
        for item, (slot, descriptors) in zip(ordered, slots):
            offset, length, _crc = record.items[slot]
            info = storage_info(name, offset, length)
            if descriptors:
                info.transform_descriptors = descriptors
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        self.file_records[name] = record
        results.shard = (name, record)  # carried to the coordinator's `finish` by DCP's gather

    def _payloads(self, ordered: list[WriteItem], planner: SavePlanner, slots: list) -> Iterator[Any]:
        """The items to store, resolved one at a time (never more than one held while the planner
        resolves the next); each item's slot is appended to `slots`. A tensor whose memory an
        earlier item of this shard holds (a tied weight) is not stored again: it takes that
        item's slot. With extensions, each item is yielded as its transformed bytes."""
        written: dict[tuple, tuple[Any, tuple[int, list[str]]]] = {}  # memory -> (its storage, slot)
        stored = 0  # items yielded so far: the next one's index in the shard's record
        for item in ordered:
            data = planner.resolve_data(item)
            memory = None if isinstance(data, io.BytesIO) else alias_key(data)
            twin = written.get(memory) if memory is not None else None
            if twin is not None and twin[0]() is data.untyped_storage():
                slots.append(twin[1])
                del data
                continue
            storage = None if memory is None else weakref.ref(data.untyped_storage())
            descriptors: list[str] = []
            if self.transforms.extensions:
                data, descriptors = self._encoded(data)
            slot = (stored, descriptors)
            slots.append(slot)
            if storage is not None:
                written[memory] = (storage, slot)
            stored += 1
            yield data
            del data

    def _encoded(self, data: Any) -> tuple[bytes, list[str]]:
        """One item's bytes as the extensions transform them, and their descriptors."""
        buffer = io.BytesIO()
        stream, descriptors = self.transforms.encoder(buffer)
        if isinstance(data, io.BytesIO):
            stream.write(data.getbuffer())
        else:
            torch.save(_tensor_for_save(data), stream)
        stream.close()
        return buffer.getvalue(), descriptors

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: `.metadata` from every rank's write results, then the commit. The
        results' wrappers are dropped as they are read and `.metadata` is pickled straight into
        its file (the same bytes as `pickle.dumps`: the pickler flushes each 64 KiB frame), so
        the coordinator never holds the results, the storage records and the whole pickle at
        once (issue 25.5)."""
        failures = [
            (rank, fail) for rank, per_rank in enumerate(results) if (fail := getattr(per_rank, "failure", None))
        ]
        if failures:
            self.transaction.fail(failures)  # raises: every rank's write stopped, the save is removed
        with self.transaction.cleaning_up_on_failure():
            records: dict[str, FileRecord] = {}
            storage_data = {}
            record_keys: dict[str, tuple[str, ...]] = {}
            for per_rank in results:
                name, record = per_rank.shard
                records[name] = record
                for wr in per_rank:
                    storage_data[wr.index] = wr.storage_data
                if isinstance(per_rank, plan_codec.WriteResults):
                    if per_rank.info_names:
                        record_keys[name] = per_rank.info_names
                    per_rank.clear()  # its records are in storage_data now
            metadata.storage_data = storage_data
            metadata.storage_meta = self.storage_meta()
            with self.storage.open_writer(METADATA_NAME) as stream:
                sink = _Checksummed(stream)
                (_MetadataPickler(sink, record_keys) if record_keys else pickle.Pickler(sink)).dump(metadata)
            records[METADATA_NAME] = FileRecord(size=sink.size, crc32=sink.crc, items=[(0, sink.size, sink.crc)])
            self.file_records = records
            self.transaction.commit(records, metadata)

    def storage_meta(self) -> StorageMeta | None:
        meta = StorageMeta(checkpoint_id=self.storage.uri)
        if self.save_id is not None:
            meta.save_id = self.save_id
        # An attribute, not a constructor argument: torch versions whose StorageMeta lacks the
        # `modules` field still pickle and unpickle it (in __dict__), and plain dcp.load ignores it.
        meta.modules = [*(getattr(meta, "modules", None) or []), METADATA_MARKER]
        return meta

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True
