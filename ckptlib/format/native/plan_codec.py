"""Compact pickling of what DCP sends between ranks: save and load plans, write results.

DCP gathers every rank's plan on the coordinator, scatters the global plans back and gathers
the write results, each with `pickle` over its dataclasses (WriteItem, MetadataIndex,
torch.Size, ChunkStorageMetadata, ...): ~30 objects an item. At 10,000 tensors over 2 ranks
that pickling was a third of a save's time. The classes here are DCP's plan types (and a
list) whose `__reduce__` sends each item as one tuple of builtins, with the few shared
objects (TensorProperties, dtypes) sent once; unpickling builds the same DCP objects again, so
planners and storage code never see a difference. Items of a shape the codec does not know
(a torch whose dataclasses gained fields, BYTE_IO items, subclasses) travel as themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


#: WriteItem's `bytes_io_data` (torch 2.8+); torch 2.7's WriteItem has only the other three.
WRITE_ITEM_HAS_BYTES_IO = "bytes_io_data" in _field_names(WriteItem)

# The codec covers exactly these fields; a torch whose classes differ sends items as themselves.
KNOWN_FIELDS = (
    _field_names(WriteItem) - {"bytes_io_data"} == {"index", "type", "tensor_data"}
    and _field_names(TensorWriteData) == {"chunk", "properties", "size"}
    and _field_names(ChunkStorageMetadata) == {"offsets", "sizes"}
    and _field_names(MetadataIndex) == {"fqn", "offset", "index"}
    and _field_names(ReadItem) == {"type", "dest_index", "dest_offsets", "storage_index", "storage_offsets", "lengths"}
    and _field_names(WriteResult) == {"index", "size_in_bytes", "storage_data"}
)


def write_item_fields(index: Any, kind: Any, tensor_data: Any) -> dict[str, Any]:
    """A tensor WriteItem's fields in this torch's field set."""
    if WRITE_ITEM_HAS_BYTES_IO:
        return {"index": index, "type": kind, "bytes_io_data": None, "tensor_data": tensor_data}
    return {"index": index, "type": kind, "tensor_data": tensor_data}


def new_dataclass(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of a (frozen) dataclass from its field values, without its __init__.

    Set one by one, in the order given (the fields' order at every call site): CPython then
    keeps the values inline, without a `__dict__` per object (280 against 136 bytes for a
    MetadataIndex; the coordinator decodes several such objects per chunk of every rank)."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        _set(obj, name, value)
    return obj


_set = object.__setattr__


def placements_key(placements: Any) -> tuple:
    """DTensor placements as a dict key that tells their types apart: in some torch releases
    `Shard(0) == _StridedShard(0, split_factor=2)` holds although their chunks differ."""
    return tuple((type(p), p, repr(p)) for p in placements)


def _size(values: tuple[int, ...] | None) -> torch.Size | None:
    return None if values is None else torch.Size(values)


def _index_tuple(index: Any) -> tuple | None:
    if type(index) is not MetadataIndex or (index.offset is not None and type(index.offset) is not torch.Size):
        return None
    return (index.fqn, None if index.offset is None else tuple(index.offset), index.index)


def _index(fqn: str, offset: tuple[int, ...] | None, hint: int | None) -> MetadataIndex:
    return new_dataclass(MetadataIndex, {"fqn": fqn, "offset": _size(offset), "index": hint})


def _plan_fields(plan: Any) -> dict[str, Any]:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "items"}


def _same_plan(a: Any, b: Any) -> bool:
    """Dataclass equality that ignores the compact subclass (a CompactSavePlan equals a SavePlan)."""
    return dataclasses.fields(a) == dataclasses.fields(b) and all(
        getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a)
    )


def _properties_key(properties: Any) -> Any:
    """Equal TensorProperties are sent once: their fields (dtype, layout, flags) are the key."""
    key = (type(properties), tuple(sorted(vars(properties).items())))
    try:
        hash(key)
    except TypeError:
        return id(properties)
    return key


# ---------------------------------------------------------------- save plans


def _encode_write_item(item: Any, properties: list[Any], seen: dict[Any, int]) -> Any:
    if type(item) is not WriteItem or type(item.type) is not WriteItemType:
        return item
    if getattr(item, "bytes_io_data", None) is not None:
        return item
    data = item.tensor_data
    index = _index_tuple(item.index)
    if index is None or type(data) is not TensorWriteData or type(data.chunk) is not ChunkStorageMetadata:
        return item
    chunk = data.chunk
    if (
        type(chunk.offsets) is not torch.Size
        or type(chunk.sizes) is not torch.Size
        or type(data.size) is not torch.Size
    ):
        return item
    key = _properties_key(data.properties)
    slot = seen.get(key)
    if slot is None:
        slot = seen[key] = len(properties)
        properties.append(data.properties)
    return (*index, item.type.value, tuple(chunk.offsets), tuple(chunk.sizes), slot, tuple(data.size))


def _decode_write_item(entry: Any, properties: list[Any]) -> Any:
    if not isinstance(entry, tuple):
        return entry
    fqn, offset, hint, kind, offsets, sizes, slot, size = entry
    chunk = new_dataclass(ChunkStorageMetadata, {"offsets": torch.Size(offsets), "sizes": torch.Size(sizes)})
    data = new_dataclass(TensorWriteData, {"chunk": chunk, "properties": properties[slot], "size": torch.Size(size)})
    return new_dataclass(WriteItem, write_item_fields(_index(fqn, offset, hint), WriteItemType(kind), data))


def _decode_save_plan(cls: type, entries: list[Any], properties: list[Any], fields: dict[str, Any]) -> SavePlan:
    return cls(items=[_decode_write_item(e, properties) for e in entries], **fields)


class CompactSavePlan(SavePlan):
    """A SavePlan that pickles its items as tuples (see the module)."""

    __eq__ = _same_plan
    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        properties: list[Any] = []
        seen: dict[Any, int] = {}
        entries = [_encode_write_item(item, properties, seen) if KNOWN_FIELDS else item for item in self.items]
        return _decode_save_plan, (CompactSavePlan, entries, properties, _plan_fields(self))


def compact_save_plan(plan: SavePlan) -> SavePlan:
    """`plan` as a CompactSavePlan (plans of a SavePlan subclass other than SavePlan stay as they are)."""
    if type(plan) is not SavePlan:
        return plan
    return CompactSavePlan(items=plan.items, **_plan_fields(plan))


# ---------------------------------------------------------------- load plans


def _encode_read_item(item: Any) -> Any:
    if type(item) is not ReadItem or type(item.type) is not LoadItemType:
        return item
    dest, storage = _index_tuple(item.dest_index), _index_tuple(item.storage_index)
    sizes = (item.dest_offsets, item.storage_offsets, item.lengths)
    if dest is None or storage is None or any(type(s) is not torch.Size for s in sizes):
        return item
    return (item.type.value, *dest, *storage, *(tuple(s) for s in sizes))


def _decode_read_item(entry: Any) -> Any:
    if not isinstance(entry, tuple):
        return entry
    kind, dfqn, doff, dhint, sfqn, soff, shint, dest_offsets, storage_offsets, lengths = entry
    return new_dataclass(
        ReadItem,
        {
            "type": LoadItemType(kind),
            "dest_index": _index(dfqn, doff, dhint),
            "dest_offsets": torch.Size(dest_offsets),
            "storage_index": _index(sfqn, soff, shint),
            "storage_offsets": torch.Size(storage_offsets),
            "lengths": torch.Size(lengths),
        },
    )


def _decode_load_plan(cls: type, entries: list[Any], fields: dict[str, Any]) -> LoadPlan:
    return cls(items=[_decode_read_item(e) for e in entries], **fields)


class CompactLoadPlan(LoadPlan):
    """A LoadPlan that pickles its items as tuples (see the module)."""

    __eq__ = _same_plan
    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        entries = [_encode_read_item(item) if KNOWN_FIELDS else item for item in self.items]
        return _decode_load_plan, (CompactLoadPlan, entries, _plan_fields(self))


def compact_load_plan(plan: LoadPlan) -> LoadPlan:
    """`plan` as a CompactLoadPlan (plans of a LoadPlan subclass other than LoadPlan stay as they are)."""
    if type(plan) is not LoadPlan:
        return plan
    return CompactLoadPlan(items=plan.items, **_plan_fields(plan))


# ---------------------------------------------------------------- write results


def _decode_results(entries: list[Any], info_cls: type | None, names: tuple[str, ...], attrs: dict) -> "WriteResults":
    out = WriteResults()
    for entry in entries:
        if isinstance(entry, tuple):
            fqn, offset, hint, nbytes, values = entry
            info = object.__new__(info_cls)  # type: ignore[call-overload]
            for name, value in zip(names, values):
                _set(info, name, value)
            entry = object.__new__(WriteResult)
            _set(entry, "index", _index(fqn, offset, hint))
            _set(entry, "size_in_bytes", nbytes)
            _set(entry, "storage_data", info)
        out.append(entry)
    out.__dict__.update(attrs)
    out.info_names = names  # decoded here, as the keys of each record's __dict__ were before
    return out


class WriteResults(list):
    """One rank's WriteResults; pickles each as a tuple when its storage record is of `info_cls`
    (one dataclass for the whole list: its field values as a tuple, the names sent once), and
    keeps the attributes set on it (the shard's record)."""

    info_cls: type | None = None
    # The storage records' field names as this list's pickle carried them (decoded objects, not
    # the interned names): `.metadata` must pickle records with these very key objects (see
    # `dcp_writer._MetadataPickler`).
    info_names: tuple[str, ...] = ()

    def __reduce__(self):
        cls = self.info_cls
        names = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
        entries: list[Any] = []
        for result in self:
            index = _index_tuple(result.index) if KNOWN_FIELDS and type(result) is WriteResult else None
            info = result.storage_data
            # the values alone, when the record holds exactly its fields, in their order (what
            # `.metadata` pickles is its __dict__, so the decoded one must be built the same way)
            if index is None or not names or type(info) is not cls or tuple(vars(info)) != names:
                entries.append(result)
            else:
                entries.append((*index, result.size_in_bytes, tuple(vars(info).values())))
        return _decode_results, (entries, cls, names, dict(self.__dict__))


__all__ = [
    "KNOWN_FIELDS",
    "CompactLoadPlan",
    "CompactSavePlan",
    "WriteResults",
    "compact_load_plan",
    "compact_save_plan",
    "new_dataclass",
    "placements_key",
    "write_item_fields",
]
