"""`ckpt verify` and `ckpt inspect` of safetensors: one file, a directory holding
`model.safetensors`, or shards listed by `model.safetensors.index.json` (ckptlib's own
exports and Hugging Face's model directories alike).

Every header is checked as a load checks it (`safetensors_header`: bounds, dtypes, offsets
that tile the data section), every file the index maps a tensor to must exist and hold it,
no tensor may be in two files, and every data byte is read. An index without a `metadata`
object is damage too (transformers' `from_pretrained` fails on it); a `total_size` that
differs from the tensors' bytes, and a `*.safetensors` file the index does not list, are
notes. An export ckptlib wrote (`ckptlib_export.json`) must be complete and hold every file
its record lists.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from ckptlib.errors import (
    CheckpointCorruptError,
    NotACheckpointError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedError,
)
from ckptlib.format.foreign.foreign import file_size
from ckptlib.format.foreign.safetensors import SAFETENSORS_FILE, SAFETENSORS_INDEX, read_safetensors_header
from ckptlib.format.foreign.safetensors_header import parse_json_object, safetensors_dtype, validate_index
from ckptlib.format.native.structure import Problem
from ckptlib.format.output import EXPORT_RECORD
from ckptlib.format.verify import READ_CHUNK, Summary
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage, check_relative, root_is_file
from ckptlib.storage.local import LocalStorage


def locate(storage: Storage) -> tuple[Storage, str]:
    """(the directory, the file to start from: an index or one .safetensors file)."""
    if root_is_file(storage):
        path = storage.local_path()
        assert path is not None
        return LocalStorage(os.path.dirname(path), fsync=False), os.path.basename(path)
    top = {n for n in storage.list() if "/" not in n}
    for name in (SAFETENSORS_INDEX, SAFETENSORS_FILE):
        if name in top:
            return storage, name
    indexes = sorted(n for n in top if n.endswith(".safetensors.index.json"))
    singles = sorted(n for n in top if n.endswith(".safetensors"))
    if len(indexes) == 1 or (not indexes and len(singles) == 1):
        return storage, (indexes or singles)[0]
    raise NotACheckpointError(f"{storage.uri} holds no single safetensors model or index", path=storage.uri)


def _index_files(root: Storage, first: str, problems: list[Problem]) -> dict[str, list[str]] | None:
    """{file: the tensors the index maps to it} (None when the index is unreadable)."""
    where = f"{root.uri}/{first}"
    try:
        index = parse_json_object(root.read(first), where, "safetensors index")
        weight_map = validate_index(index, where)
    except CheckpointCorruptError as exc:
        problems.append(Problem(first, str(exc).removeprefix(f"{where}: ")))
        return None
    if not isinstance(index.get("metadata"), dict):
        problems.append(Problem(first, "has no metadata object (transformers' from_pretrained fails on it)"))
    files: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        try:
            check_relative(file, root.uri)
        except StorageError:
            problems.append(
                Problem(first, f"weight_map[{key!r}] names {file!r}, which escapes the directory", "unsafe")
            )
            continue
        files.setdefault(file, []).append(key)
    for file in sorted(files):
        if file_size(root, file) is None:
            problems.append(Problem(file, f"is missing: {first} maps {len(files[file])} tensors to it", "missing"))
    return files


def _read_all(root: Storage, name: str, size: int, read_chunk: int, on_bytes: Callable[[int], None] | None) -> None:
    pos = 0
    while pos < size:
        n = min(read_chunk, size - pos)
        root.read(name, pos, n)
        pos += n
        if on_bytes is not None:
            on_bytes(n)


def _record_problems(root: Storage, listing: set[str]) -> list[Problem]:
    if EXPORT_RECORD not in listing:
        return []
    try:
        record = json.loads(root.read(EXPORT_RECORD))
        files = record["files"]
        complete = record["complete"]
    except (ValueError, KeyError, TypeError):
        return [Problem(EXPORT_RECORD, "is unreadable (not ckptlib's export record)")]
    problems = [] if complete is True else [Problem(EXPORT_RECORD, "says the export never finished", "incomplete")]
    for name in files if isinstance(files, list) else []:
        if isinstance(name, str) and name not in listing:
            problems.append(Problem(name, f"is missing: {EXPORT_RECORD} lists it", "missing"))
    return problems


def verify_safetensors(
    storage: Storage | str | os.PathLike,
    *,
    read_chunk: int = READ_CHUNK,
    on_start: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every problem of the safetensors model at `storage` (see the module docstring)."""
    root, first = locate(as_storage(storage))
    problems: list[Problem] = []
    listing = {n for n in root.list() if "/" not in n} if not root_is_file(as_storage(storage)) else {first}
    if first.endswith(".index.json"):
        files = _index_files(root, first, problems)
        if files is None:
            return problems
        for extra in sorted(n for n in listing if n.endswith(".safetensors") and n not in files):
            problems.append(Problem(extra, f"is not listed in {first}", "note"))
        problems += _record_problems(root, listing)
    else:
        files = {first: []}
    sizes = {f: file_size(root, f) for f in files}
    if on_start is not None:
        on_start(sum(s for s in sizes.values() if s))
    seen: dict[str, str] = {}
    total = 0
    for file, expected in sorted(files.items()):
        if sizes[file] is None:
            continue
        try:
            header, _ = read_safetensors_header(root, file, sizes[file])
        except (CheckpointCorruptError, UnsupportedError, UnsafeCheckpointError) as exc:
            problems.append(Problem(file, str(exc).removeprefix(f"{root.uri}/{file}: ")))
            continue
        for key in sorted(set(expected) - set(header)):
            problems.append(Problem(file, f"lacks tensor {key!r}, which {first} maps to it"))
        for key in header:
            if key in seen:
                problems.append(Problem(file, f"tensor {key!r} is also in {seen[key]}"))
            seen[key] = file
            begin, end = header[key]["data_offsets"]
            total += end - begin
        try:
            _read_all(root, file, sizes[file], read_chunk, on_bytes)
        except (FileNotFoundError, EOFError) as exc:
            problems.append(Problem(file, f"cannot be read to its end ({exc})", "missing"))
    if first.endswith(".index.json") and not any(p.is_error for p in problems):  # the sizes of intact files only
        declared = json.loads(root.read(first)).get("metadata")
        size = declared.get("total_size") if isinstance(declared, dict) else None
        if isinstance(size, int) and size != total:
            problems.append(Problem(first, f"says total_size {size}, the tensors hold {total} bytes", "note"))
    return problems


def summarize_safetensors(storage: Storage | str | os.PathLike) -> Summary:
    """What `ckpt inspect` shows of a safetensors model (headers only; raises on damage)."""
    storage = as_storage(storage)
    root, first = locate(storage)
    files = [first]
    if first.endswith(".index.json"):
        where = f"{root.uri}/{first}"
        files = sorted(
            set(validate_index(parse_json_object(root.read(first), where, "safetensors index"), where).values())
        )
    tensors = []
    total = 0
    for file in files:
        header, _ = read_safetensors_header(root, file)
        total += file_size(root, file) or 0
        for key, entry in header.items():
            shape = list(entry["shape"])
            dtype = str(safetensors_dtype(entry["dtype"])).removeprefix("torch.")
            tensors.append({"key": key, "shape": shape, "dtype": dtype, "chunks": 1})
    step = None
    if not root_is_file(storage) and file_size(root, EXPORT_RECORD) is not None:
        try:
            value = json.loads(root.read(EXPORT_RECORD)).get("step")
            step = value if isinstance(value, int) else None
        except ValueError:
            step = None
    return Summary(
        uri=storage.uri,
        format="safetensors",
        step=step,
        world_size=None,
        torch_version=None,
        total_bytes=total,
        tensors=sorted(tensors, key=lambda t: t["key"]),
        objects=[],
    )


__all__ = ["locate", "summarize_safetensors", "verify_safetensors"]
