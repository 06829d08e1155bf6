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
import pickle
import re
import zlib
from collections import defaultdict
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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
from .manifest import METADATA_MARKER, METADATA_NAME, FileRecord, Manifest, check_name
from .safe_pickle import safe_loads

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


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()  # a view would otherwise save its whole storage
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getbuffer()


class CkptWriter(StorageWriter):
    """Writes one shard file per rank through `storage` and records item checksums."""

    def __init__(self, storage: Storage):
        super().__init__()
        self.storage = storage
        self.is_coordinator = False
        self.file_records: dict[str, FileRecord] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.file_records = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
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
        with self.storage.open_writer(name) as stream:
            for item in ordered:
                data = planner.resolve_data(item)
                blob = data.getbuffer() if isinstance(data, io.BytesIO) else _tensor_bytes(data)
                length = len(blob)
                crc = zlib.crc32(blob)
                file_crc = zlib.crc32(blob, file_crc)
                stream.write(blob)
                items.append((offset, length, crc))
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, offset, length))
                )
                offset += length
        self.file_records[name] = FileRecord(size=offset, crc32=file_crc, items=items)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        self.storage.write(METADATA_NAME, blob)
        self.file_records[METADATA_NAME] = FileRecord(size=len(blob), crc32=zlib.crc32(blob), items=[(0, len(blob), zlib.crc32(blob))])

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


def _coalesce(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (offset, length) spans, sorted, that lie within _COALESCE_GAP of each other."""
    merged: list[list[int]] = []
    for off, length in sorted(spans):
        if merged and off <= merged[-1][0] + merged[-1][1] + _COALESCE_GAP:
            end = max(merged[-1][0] + merged[-1][1], off + length)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([off, length])
    return [(a, b) for a, b in merged]


class CkptReader(StorageReader):
    """Reads exactly the byte ranges this rank's load plan needs and verifies their CRCs."""

    def __init__(self, storage: Storage, metadata: Metadata, manifest: Manifest | None, *, verify: bool = True):
        super().__init__()
        self.storage = storage
        self.metadata = metadata
        self.manifest = manifest
        self.verify = verify and manifest is not None
        self.storage_data: dict[MetadataIndex, Any] = metadata.storage_data
        self.bytes_read = 0
        self.rank = 0

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
        if zlib.crc32(data) != expected[1]:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch in item at offset {off} (length {len(data)}){whose(name)}", path=where
            )

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

        for name, reqs in by_file.items():
            where = f"{self.storage.uri}/{name}"
            crcs = self._item_crcs(name) if self.verify else None
            spans = _coalesce([(info.offset, info.length) for _, info in reqs])
            blobs: dict[tuple[int, int], memoryview] = {}
            for off, length in spans:
                try:
                    blobs[(off, length)] = memoryview(self.storage.read(name, off, length))
                except FileNotFoundError as exc:
                    raise CheckpointCorruptError(f"{where}: shard file is missing{whose(name)}", path=where) from exc
                except EOFError as exc:
                    raise CheckpointCorruptError(
                        f"{where}: shard file is truncated{whose(name)}: {exc}", path=where
                    ) from exc
                self.bytes_read += length
            for req, info in reqs:
                span = next(s for s in spans if s[0] <= info.offset and info.offset + info.length <= s[0] + s[1])
                start = info.offset - span[0]
                data = blobs[span][start : start + info.length]
                self._check_item(name, crcs, info.offset, data)
                if req.type == LoadItemType.BYTE_IO:
                    try:
                        planner.load_bytes(req, io.BytesIO(data.tobytes()))
                    except UnsafeCheckpointError as exc:
                        if exc.path is None:
                            exc.path = where
                            exc.message = f"{where}{whose(name)}: {exc.message}"
                            exc.args = (exc.message,)
                        raise
                    continue
                try:
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise CheckpointCorruptError(
                        f"{where}: cannot decode tensor {req.storage_index.fqn} at offset {info.offset}"
                        f"{whose(name)}: {exc}",
                        path=where,
                    ) from exc
                for dim, (start_d, len_d) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, start_d, len_d)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CheckpointCorruptError(
                        f"{where}: {req.storage_index.fqn}: stored chunk has shape {tuple(tensor.size())}, "
                        f"expected {tuple(target.size())}",
                        path=where,
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor objects are unpickled with weights_only."""

    def __init__(self, *, trusted: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.trusted = trusted

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
