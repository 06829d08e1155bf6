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

import dataclasses
import io
import math
import pickle
import weakref
import zlib
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._torch import dcp_shims
from ..storage import Storage
from . import item_encoder, plan_codec
from .aliases import alias_key
from .block_checks import _CrcSink, block_size_for
from .manifest import METADATA_MARKER, METADATA_NAME, FileRecord
from .stream_transforms import Transforms

if TYPE_CHECKING:
    from .transaction import SaveTransaction


def _shard_file_name(prefix: str) -> str:
    return f"{prefix}0.distcp"


def _tensor_for_save(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()  # a view would otherwise save its whole storage
    return tensor


class CkptWriter(StorageWriter):
    """Writes one shard file per rank through `storage` and records item checksums, for a
    `SaveTransaction` (`format.transaction`), which owns the save: the writer calls its
    `prepare()` on the coordinator before any rank writes (inside DCP's planning round), opens
    every shard through it, and calls its `commit(file_records, metadata)` on the coordinator
    after `.metadata` is written (inside DCP's final round), so neither costs a collective of
    its own; DCP raises their errors on every rank. After `finish`, the coordinator's
    `file_records` holds every file of the checkpoint.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        transaction: SaveTransaction,
        transforms: Transforms | None = None,
        save_id: str | None = None,
    ):
        super().__init__()
        self.storage = storage
        self.transaction = transaction
        self.transforms = transforms or Transforms()
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
        name = _shard_file_name(plan.storage_data)
        results = plan_codec.WriteResults()
        results.info_cls = dcp_shims.storage_info_cls()
        try:
            self._write_shard(name, plan, planner, results)
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
        # Aliased tensors (tied weights) are stored once: memory -> (its storage, the record written).
        written: dict[tuple, tuple[Any, Any]] = {}
        with self.transaction.open_shard(name) as stream:
            sink = _CrcSink(stream, block_size_for(planned))
            for item in ordered:
                data = planner.resolve_data(item)
                memory = None if isinstance(data, io.BytesIO) else alias_key(data)
                twin = written.get(memory) if memory is not None else None
                if twin is not None and twin[0]() is data.untyped_storage():
                    results.append(WriteResult(index=item.index, size_in_bytes=twin[1].length, storage_data=twin[1]))
                    del data
                    continue
                storage_ref = None if memory is None else weakref.ref(data.untyped_storage())
                sink.item_crc = 0
                descriptors = self._write_item(sink, data)
                del data  # never hold this item while the planner resolves the next one
                length = sink.pos - offset
                sink.end_item(length)
                items.append((offset, length, sink.item_crc))
                info = storage_info(name, offset, length)
                if descriptors:
                    info.transform_descriptors = descriptors
                if storage_ref is not None:
                    written[memory] = (storage_ref, info)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
                offset = sink.pos
            sink.end_file()
            file_crc = sink.file_crc
        if items:
            record = FileRecord(
                size=offset, crc32=file_crc, items=items, block_size=sink.block_size, blocks=sink.blocks
            )
        else:  # a rank with nothing to save still wrote its (empty) shard file
            record = FileRecord(size=0, crc32=0, items=[])
        self.file_records[name] = record
        results.shard = (name, record)  # carried to the coordinator's `finish` by DCP's gather

    def _write_item(self, sink: _CrcSink, data: Any) -> list[str]:
        """Write one item (a BytesIO of a pickled object, or a tensor) at the sink's position;
        return the DCP extension descriptors it was stored with."""
        if self.transforms.extensions:
            stream, descriptors = self.transforms.encoder(sink)
            if isinstance(data, io.BytesIO):
                stream.write(data.getbuffer())
            else:
                torch.save(_tensor_for_save(data), stream)
            stream.close()
            return descriptors
        if isinstance(data, io.BytesIO):
            sink.write(data.getbuffer())
            return []
        tensor = _tensor_for_save(data)
        encoded = None
        if tensor.numel() * tensor.element_size() < item_encoder.SMALL_ITEM_BYTES:
            sink.write(item_encoder.small_item_bytes(tensor))
        elif (encoded := item_encoder.encode(tensor, sink.pos, sink.block_size)) is not None:
            sink.write_encoded(encoded)
        else:  # straight into the stream: identical bytes to torch.save into a BytesIO
            torch.save(tensor, sink)
        return []

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        failures = [
            (rank, failure) for rank, per_rank in enumerate(results) if (failure := getattr(per_rank, "failure", None))
        ]
        if failures:
            self.transaction.fail(failures)  # raises: every rank's write stopped, the save is removed
        with self.transaction.cleaning_up_on_failure():
            records: dict[str, FileRecord] = {}
            storage_data = {}
            for per_rank in results:
                name, record = per_rank.shard
                records[name] = record
                for wr in per_rank:
                    storage_data[wr.index] = wr.storage_data
            metadata.storage_data = storage_data
            metadata.storage_meta = self.storage_meta()
            blob = pickle.dumps(metadata)
            self.storage.write(METADATA_NAME, blob, durable=False)  # `commit` syncs it with the shards
            records[METADATA_NAME] = FileRecord(
                size=len(blob), crc32=zlib.crc32(blob), items=[(0, len(blob), zlib.crc32(blob))]
            )
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
