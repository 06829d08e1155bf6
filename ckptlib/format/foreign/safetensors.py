"""safetensors: ``model.safetensors`` or shards listed by ``model.safetensors.index.json``,
read as a DCP source with ranged reads of just the rows a rank needs, and written from any
source (header first, computed from the metadata, then tensors appended)."""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptlib.errors import CheckpointCorruptError, StorageError, UnsafeCheckpointError, UnsupportedError
from ckptlib.format.foreign.foreign import (
    SafetensorsLoc,
    SourceFiles,
    SourceInfo,
    file_size,
    new_metadata,
    tensor_metadata,
)
from ckptlib.format.foreign.safetensors_header import (
    MAX_HEADER_BYTES,
    header_length,
    parse_json_object,
    safetensors_dtype,
    safetensors_name,
    validate_header,
    validate_index,
)
from ckptlib.format.foreign.shard_files import (
    EXPORT_MARK,
    ShardEntry,
    element_size,
    planned_entries,
    write_shards,
    write_tensor_bytes,
)
from ckptlib.storage.base import Storage, check_relative

if TYPE_CHECKING:
    from ckptlib.format.streaming import SourceValues

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_ALIGN = 8


def looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(size - 8, MAX_HEADER_BYTES) and head[8:9] == b"{"


def read_safetensors_header(root: Storage, name: str, size: int | None = None) -> tuple[dict, int]:
    """The validated tensor entries of a safetensors file and the offset its data starts at
    (see safetensors_header for the rules; CheckpointCorruptError naming the file and key)."""
    where = f"{root.uri}/{name}"
    try:
        if size is None:
            size = file_size(root, name)
            if size is None:
                raise FileNotFoundError(where)
        n = header_length(root.read(name, 0, 8) if size >= 8 else b"", where, size)
        header = parse_json_object(root.read(name, 8, n), where, "safetensors header")
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except EOFError as exc:
        raise CheckpointCorruptError(f"{where} is truncated ({exc})", path=where) from exc
    return validate_header(header, where, size - 8 - n), 8 + n


def inspect(where_: SourceFiles, uri: str, *, prefix: str | None) -> SourceInfo:
    root, first = where_.root, where_.names[0]
    files: dict[str, list[str]] = {}
    if first.endswith(".index.json"):
        where = f"{root.uri}/{first}"
        try:
            raw = root.read(first)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
        weight_map = validate_index(parse_json_object(raw, where, "safetensors index"), where)
        base = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        for key, file in weight_map.items():
            try:
                rel = base + check_relative(file, root.uri)
            except StorageError as exc:
                raise UnsafeCheckpointError(
                    f"{where}: weight_map[{key!r}] names {file!r}, which escapes {root.uri}", path=where
                ) from exc
            if rel not in files and file_size(root, rel) is None:
                missing = f"{root.uri}/{rel}"
                raise CheckpointCorruptError(
                    f"{missing} is missing: {first} maps {key} (and maybe more) to it", path=missing
                )
            files.setdefault(rel, []).append(key)
    else:
        files[first] = []
    sdm: dict = {}
    planner_data: dict = {}
    storage_data: dict = {}
    for file, expected in files.items():
        header, data_start = read_safetensors_header(root, file)
        absent = [k for k in expected if k not in header]
        if absent:
            raise CheckpointCorruptError(
                f"{root.uri}/{file}: lacks {', '.join(absent[:5])}, which {first} maps to it", path=f"{root.uri}/{file}"
            )
        for key, entry in header.items():
            fqn = f"{prefix}.{key}" if prefix else key
            if fqn in sdm:
                raise CheckpointCorruptError(f"{root.uri}/{file}: tensor {key} is also in another shard", path=uri)
            dtype = safetensors_dtype(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = entry["data_offsets"]
            chunks = [((0,) * len(shape), shape)] if math.prod(shape) else []
            sdm[fqn] = tensor_metadata(dtype, shape, chunks)  # type: ignore[arg-type]
            planner_data[fqn] = (prefix, key) if prefix else (key,)
            for offsets, _ in chunks:
                storage_data[MetadataIndex(fqn, offsets)] = SafetensorsLoc(
                    file, entry["dtype"], shape, data_start + begin, data_start + end
                )
    return SourceInfo(
        uri=uri,
        kind="safetensors",
        manifest=None,
        metadata=new_metadata(sdm, planner_data, storage_data),
        saved_world_size=None,
        files=tuple(files),
    )


def read_piece(root: Storage, loc: SafetensorsLoc, offsets, lengths) -> tuple[torch.Tensor, int]:
    """The [offsets, offsets + lengths) piece of a tensor and the bytes read for it: one ranged
    read of just its rows."""
    dtype = safetensors_dtype(loc.dtype)
    assert dtype is not None
    if not loc.shape:
        rows, row_bytes, first = 1, loc.end - loc.begin, 0
        tail: tuple[int, ...] = ()
    else:
        first, rows = offsets[0], lengths[0]
        tail = loc.shape[1:]
        row_bytes = math.prod(tail) * torch.empty((), dtype=dtype).element_size()
    nbytes = rows * row_bytes
    if nbytes == 0:
        return torch.empty(tuple(lengths), dtype=dtype), 0
    where = f"{root.uri}/{loc.file}"
    try:
        data = root.read(loc.file, loc.begin + first * row_bytes, nbytes)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except EOFError as exc:
        raise CheckpointCorruptError(f"{where} is truncated ({exc})", path=where) from exc
    with warnings.catch_warnings():  # read-only bytes: the view is only copied from, never written
        warnings.filterwarnings("ignore", message=".*not writable.*")
        value = torch.frombuffer(data, dtype=dtype)
    value = value.reshape((rows,) + tail) if loc.shape else value.reshape(())
    for dim in range(1, len(loc.shape)):
        value = value.narrow(dim, offsets[dim], lengths[dim])
    return value, nbytes


def safetensors_plan(source: SourceValues, prefix: str | None) -> tuple[dict[str, str], list[str]]:
    """({safetensors name: source fqn}, skipped fqns): the tensors under `prefix`, prefix stripped."""
    names: dict[str, str] = {}
    skipped: list[str] = []
    for fqn in source.tensor_keys:
        if prefix and not fqn.startswith(prefix + "."):
            skipped.append(fqn)
            continue
        name = fqn[len(prefix) + 1 :] if prefix else fqn
        names[name] = fqn
    skipped += source.object_keys
    return names, skipped


def _header(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """(header bytes incl. length prefix, [(name, begin, end)]) for entries (name, dtype, shape, nbytes)."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    spans = []
    for name, dtype, shape, nbytes in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans.append((name, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % SAFETENSORS_ALIGN)
    return struct.pack("<Q", len(text)) + text, spans


def write_safetensors(
    directory: str,
    source: SourceValues,
    names: dict[str, str],
    *,
    single_file: str | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
    on_file: Callable[[str], None] | None = None,
    mark: bool = False,
) -> list[str]:
    """Write `names` (safetensors name -> source fqn) as model.safetensors (or `single_file`),
    or as shards of at most `max_shard_bytes` plus model.safetensors.index.json (Hugging
    Face's layout). `dtype` casts floating-point tensors. Each file is written to a temporary
    name and renamed; `on_file(name)` is called before each file is started; `mark` adds
    EXPORT_MARK to each file's metadata. Returns the file names written."""
    entries = planned_entries(source, names, dtype)
    for e in entries:
        if safetensors_name(e.dtype) is None:
            raise UnsupportedError(f"{e.fqn}: dtype {e.dtype} has no safetensors encoding")
    # Largest element size first keeps every tensor aligned to its element size.
    entries.sort(key=lambda e: (-element_size(e.dtype), e.name))

    def write_file(tmp: str, group: list[ShardEntry]) -> None:
        header, _ = _header(
            [(e.name, safetensors_name(e.dtype), e.shape, e.nbytes) for e in group],
            {EXPORT_MARK: "1"} if mark else None,
        )
        with open(tmp, "wb") as f:
            f.write(header)
            for e in group:
                tensor = source.tensor(e.fqn)
                if e.nbytes:
                    write_tensor_bytes(f, tensor, e.dtype)
                del tensor
                if on_tensor is not None:
                    on_tensor(e.fqn, e.nbytes)
            f.flush()
            os.fsync(f.fileno())

    return write_shards(
        directory,
        entries,
        "model",
        "safetensors",
        write_file,
        single_file=single_file,
        max_shard_bytes=max_shard_bytes,
        on_file=on_file,
    )
