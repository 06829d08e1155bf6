"""safetensors: ``model.safetensors`` or shards listed by ``model.safetensors.index.json``,
read as a DCP source with ranged reads of just the rows a rank needs, and written from any
source (header first, computed from the metadata, then tensors appended)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CheckpointCorruptError, UnsupportedError
from ..storage import Storage, check_relative
from .foreign import SafetensorsLoc, SourceFiles, SourceInfo, file_size, new_metadata, tensor_metadata

if TYPE_CHECKING:
    from .streaming import SourceValues

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_ALIGN = 8
_MAX_SAFETENSORS_HEADER = 100 << 20


def looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(size - 8, _MAX_SAFETENSORS_HEADER) and head[8:9] == b"{"


_ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
    "I64": "int64", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}


def safetensors_dtype(name: str) -> torch.dtype | None:
    attr = _ST_DTYPES.get(name)
    value = getattr(torch, attr, None) if attr else None
    return value if isinstance(value, torch.dtype) else None


def safetensors_name(dtype: torch.dtype) -> str | None:
    for name, attr in _ST_DTYPES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    return None


def read_safetensors_header(root: Storage, name: str, size: int | None = None) -> tuple[dict, int]:
    """The header of a safetensors file (tensor entries only) and the offset its data starts at."""
    where = f"{root.uri}/{name}"
    try:
        if size is None:
            size = file_size(root, name)
            if size is None:
                raise FileNotFoundError(where)
        if size < 8:
            raise CheckpointCorruptError(f"{where}: {size} bytes, too short for a safetensors file", path=where)
        (n,) = struct.unpack("<Q", root.read(name, 0, 8))
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise CheckpointCorruptError(
                f"{where}: safetensors header length {n} exceeds the file ({size} bytes)", path=where
            )
        header = json.loads(root.read(name, 8, n).decode("utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except (UnicodeDecodeError, json.JSONDecodeError, EOFError) as exc:
        raise CheckpointCorruptError(f"{where}: unreadable safetensors header ({exc})", path=where) from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{where}: safetensors header is not a JSON object", path=where)
    header.pop("__metadata__", None)
    data_start = 8 + n
    for key, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed header entry for {key}", path=where) from exc
        dtype = safetensors_dtype(dtype_name)
        if dtype is None:
            raise UnsupportedError(f"{where}: {key} has dtype {dtype_name}, which this torch cannot hold", path=where)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (0 <= begin <= end and end - begin == nbytes and data_start + end <= size):
            raise CheckpointCorruptError(
                f"{where}: {key}: data_offsets [{begin}, {end}] do not fit {dtype_name} {shape} "
                f"in a {size}-byte file",
                path=where,
            )
    return header, data_start


def inspect(where_: SourceFiles, uri: str, *, prefix: str | None) -> SourceInfo:
    root, first = where_.root, where_.names[0]
    files: dict[str, list[str]] = {}
    if first.endswith(".index.json"):
        where = f"{root.uri}/{first}"
        try:
            index = json.loads(root.read(first).decode("utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed safetensors index ({exc})", path=where) from exc
        base = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        for key, file in weight_map.items():
            rel = base + check_relative(str(file), root.uri)
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
        uri=uri, kind="safetensors", manifest=None, metadata=new_metadata(sdm, planner_data, storage_data),
        saved_world_size=None, files=tuple(files),
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


def _header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """(header bytes incl. length prefix, [(name, begin, end)]) for entries (name, dtype, shape, nbytes)."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
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
    on_tensor: Callable[[str, int], None] | None = None,
) -> list[str]:
    """Write `names` (safetensors name -> source fqn) as model.safetensors (or `single_file`),
    or as shards of at most `max_shard_bytes` plus model.safetensors.index.json. Each file is
    written to a temporary name and renamed; returns the file names written."""
    entries = []
    for name, fqn in names.items():
        md = source.tensor_meta(fqn)
        dtype = safetensors_name(md.properties.dtype)
        if dtype is None:
            raise UnsupportedError(f"{fqn}: dtype {md.properties.dtype} has no safetensors encoding")
        entries.append((name, dtype, tuple(md.size), source.nbytes(fqn)))
    # Largest element size first keeps every tensor aligned to its element size.
    def itemsize(entry) -> int:
        return torch.empty((), dtype=source.tensor_meta(names[entry[0]]).properties.dtype).element_size()

    entries.sort(key=lambda e: (-itemsize(e), e[0]))
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        if max_shard_bytes and groups[-1] and size + entry[3] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[3]
    if len(groups) == 1:
        files = [single_file or "model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    os.makedirs(directory, exist_ok=True)
    written = []
    for file, group in zip(files, groups):
        final = os.path.join(directory, file)
        tmp = f"{final}.tmp-{os.getpid()}"
        header, _ = _header(group)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                for name, _, _, nbytes in group:
                    tensor = source.tensor(names[name]).contiguous()
                    if nbytes:
                        f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                    del tensor
                    if on_tensor is not None:
                        on_tensor(names[name], nbytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        written.append(file)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(e[3] for e in entries)},
            "weight_map": {name: file for file, group in zip(files, groups) for name, *_ in group},
        }
        final = os.path.join(directory, "model.safetensors.index.json")
        with open(final + ".tmp", "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
        os.replace(final + ".tmp", final)
        written.append("model.safetensors.index.json")
    return written
