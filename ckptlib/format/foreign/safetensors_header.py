"""Parse and validate safetensors headers as strictly as the safetensors library does.

A safetensors file is an 8-byte little-endian header length N, N bytes of a UTF-8 JSON
object, then the data section. Every rule the library's ``Metadata::validate`` and
``read_metadata`` enforce is enforced here, so a crafted header is a CheckpointCorruptError
naming the file and the key, never a raw TypeError or a silent misread:

- N is at most 100 MB and fits in the file; the header is a JSON object with no duplicate keys;
- ``__metadata__``, if present, maps strings to strings;
- every other entry is an object with ``dtype`` (a known name), ``shape`` (a list of
  non-negative integers) and ``data_offsets`` (two integers ``[begin, end]``, begin <= end);
- ``end - begin`` is exactly ``prod(shape) * itemsize``;
- sorted by offsets, the tensors tile the data section from 0 to the end of the file with
  no gap and no overlap.

A sharded index (``*.safetensors.index.json``) must be a JSON object whose ``weight_map``
maps tensor names to file names (strings) that stay inside the checkpoint directory.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from ckptlib.errors import CheckpointCorruptError, UnsupportedError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE

# safetensors dtype name -> (torch dtype attribute, bytes per element)
DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "C64": ("complex64", 8),
}
# Names the safetensors library knows but torch has no dtype for (sub-byte floats).
_KNOWN_UNSUPPORTED = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"})
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


def safetensors_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a safetensors dtype name stands for (None if unknown or unavailable)."""
    attr = DTYPES.get(name, (None, 0))[0] if isinstance(name, str) else None
    value = getattr(torch, attr, None) if attr else None
    return value if isinstance(value, torch.dtype) else None


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors dtype name of a torch dtype (None if safetensors cannot encode it)."""
    for name, (attr, _) in DTYPES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    return None


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def parse_json_object(raw: bytes, where: str, what: str) -> dict:
    """`raw` as a JSON object with no duplicate keys at any level, else CheckpointCorruptError."""
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointCorruptError(f"{where}: {what} has the key {exc.args[0]!r} twice", path=where) from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: unreadable {what} ({type(exc).__name__}: {exc})", path=where) from exc
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{where}: {what} is not a JSON object", path=where)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(where: str, key: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype name, shape, begin, end) of one tensor entry, every field checked."""

    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: tensor {key!r}: {why}", path=where)

    if not isinstance(entry, dict):
        raise bad(f"entry is a {type(entry).__name__}, not an object")
    missing = [f for f in _ENTRY_FIELDS if f not in entry]
    if missing:
        raise bad(f"entry lacks {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in DTYPES:
        if dtype in _KNOWN_UNSUPPORTED:
            raise UnsupportedError(f"{where}: tensor {key!r} has dtype {dtype}, which torch cannot hold", path=where)
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if safetensors_dtype(dtype) is None:
        raise UnsupportedError(f"{where}: tensor {key!r} has dtype {dtype}, which this torch cannot hold", path=where)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not two non-negative integers [begin, end]")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets [{begin}, {end}] end before they begin")
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != nbytes:
        raise bad(f"data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype} {shape} needs {nbytes}")
    return dtype, tuple(shape), begin, end


def validate_header(header: dict, where: str, data_bytes: int) -> dict[str, dict]:
    """The tensor entries of a parsed header, checked against each other and against a
    data section of `data_bytes` bytes (the file size minus 8 minus the header length)."""
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointCorruptError(f"{where}: __metadata__ must map strings to strings", path=where)
    tensors: dict[str, dict] = {}
    spans = []
    for key, raw in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(where, key, raw)
        tensors[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
        spans.append((begin, end, key))
    spans.sort()
    position, previous = 0, None
    for begin, end, key in spans:
        if begin != position:
            if begin > position:
                why = (
                    f"a gap of {begin - position} bytes before it (data_offsets start at {begin}, expected {position})"
                )
            else:
                why = f"it overlaps {previous!r} (data_offsets start at {begin}, before {position})"
            raise CheckpointCorruptError(f"{where}: tensor {key!r}: {why}", path=where)
        position, previous = end, key
    if position > data_bytes:
        raise CheckpointCorruptError(
            f"{where}: tensor {previous!r}: data_offsets end at {position}, past the {data_bytes}-byte data "
            f"section (truncated file?)",
            path=where,
        )
    if position < data_bytes:
        after = f"after tensor {previous!r}" if previous is not None else "and no tensor"
        raise CheckpointCorruptError(
            f"{where}: {data_bytes - position} bytes of the data section {after} belong to no tensor", path=where
        )
    return tensors


def header_length(prefix: bytes, where: str, size: int) -> int:
    """The header length N from a file's first 8 bytes, checked against the bound and the file size."""
    if size < 8 or len(prefix) < 8:
        raise CheckpointCorruptError(f"{where}: {size} bytes, too short for a safetensors file", path=where)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(
            f"{where}: safetensors header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", path=where
        )
    if n > size - 8:
        raise CheckpointCorruptError(
            f"{where}: safetensors header length {n} exceeds the file ({size} bytes)", path=where
        )
    return n


def validate_index(index: dict, where: str) -> dict[str, str]:
    """The ``weight_map`` of a parsed sharded-safetensors index (tensor name -> file name)."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointCorruptError(f"{where}: malformed safetensors index: no weight_map object", path=where)
    for key, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointCorruptError(
                f"{where}: malformed safetensors index: weight_map[{key!r}] is {file!r}, not a file name", path=where
            )
    return weight_map


__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "header_length",
    "parse_json_object",
    "safetensors_dtype",
    "safetensors_name",
    "validate_header",
    "validate_index",
]
