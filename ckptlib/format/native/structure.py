"""Structure checks of DCP's `.metadata`: chunks cover every tensor exactly once, every chunk
and object has a storage record inside the directory and its file, and every record matches
an item of the manifest. `open_checkpoint` runs them (cheaply) before every load, so a
crafted or damaged `.metadata` cannot make a load read outside its files or leave part of a
tensor silently unloaded; `verify` reports them as `Problem`s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ckptlib.errors import UnsafeCheckpointError
from ckptlib.format.native.file_names import describe_file
from ckptlib.format.native.manifest import METADATA_NAME, Manifest, check_name

KINDS = ("corrupt", "missing", "unsafe", "incomplete", "note")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One finding of `verify`: `file` (relative to the checkpoint, None for the checkpoint as a
    whole) and what is wrong with it. `kind` is one of corrupt, missing, unsafe (a name that
    escapes the directory, a pickle that would run code), incomplete (a save that never
    committed) or note (nothing is damaged, but something could not be checked)."""

    file: str | None
    message: str
    kind: str = "corrupt"

    @property
    def is_error(self) -> bool:
        return self.kind != "note"

    def text(self) -> str:
        return f"{describe_file(self.file)}: {self.message}" if self.file else self.message

    def line(self, uri: str) -> str:
        """One line naming the file by its full location, for `ckpt verify`."""
        where = f"{uri.rstrip('/')}/{describe_file(self.file)}" if self.file else uri
        return f"{'' if self.is_error else 'note: '}{where}: {self.message}"


def _box_overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    return all(max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]))


def find_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[Any, Any] | None:
    """Two (offsets, sizes) chunks that share an element, or None. Sweeps along the dimension
    with the most distinct offsets, so row-, column- and grid-sharded tensors stay near
    O(n log n) (a grid of a x b chunks: O(n min(a, b)))."""
    boxes = [b for b in boxes if all(s > 0 for s in b[1])]
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    boxes.sort(key=lambda b: b[0][dim])
    for i, a in enumerate(boxes):
        end = a[0][dim] + a[1][dim]
        for j in range(i + 1, len(boxes)):  # indices, not boxes[i + 1:]: a copy per chunk is O(n^2)
            b = boxes[j]
            if b[0][dim] >= end:
                break
            if _box_overlap(a, b):
                return a, b
    return None


def _ints(values: Any) -> tuple[int, ...]:
    """`values` (a torch.Size, or whatever a crafted file holds) as a tuple of Python ints."""
    return tuple(values) if type(values) is torch.Size else tuple(int(v) for v in values)


def _layout(md: TensorStorageMetadata) -> tuple | None:
    """(size, ((offsets, sizes) of each chunk)) of a well-formed tensor entry, or None."""
    try:
        return _ints(md.size), tuple((_ints(c.offsets), _ints(c.sizes)) for c in md.chunks or ())
    except (AttributeError, TypeError, ValueError):
        return None


def _chunk_problems(
    fqn: str, md: TensorStorageMetadata, keys: dict, exhaustive: bool, layouts: dict | None = None
) -> list[Problem]:
    """Problems of one tensor's chunks; `keys` maps (fqn, offsets) of every storage record to
    its stored length (None when the record is malformed).

    `layouts` remembers the shapes whose chunks were found to tile them (inside, no gap, no
    overlap): a sharded state repeats a few layouts across thousands of tensors, so only the
    storage records are looked up for the others (rank 0 runs this before every load)."""
    layout = _layout(md) if layouts is not None else None
    counts = None if layout is None else layouts.get((exhaustive, layout))  # type: ignore[union-attr]
    if counts is not None:
        return _record_problems(fqn, md, keys, layout[1], counts)  # type: ignore[index]
    problems = _all_chunk_problems(fqn, md, keys, exhaustive)
    if layout is not None and not problems:
        layouts[(exhaustive, layout)] = tuple(math.prod(sz) for _, sz in layout[1])  # type: ignore[index]
    return problems


def _record_problems(fqn: str, md: TensorStorageMetadata, keys: dict, chunks: tuple, counts: tuple) -> list[Problem]:
    """The storage-record checks of `_all_chunk_problems`, for chunks known to tile their tensor."""
    itemsize = _itemsize(md)
    problems = []
    for (off, sz), count in zip(chunks, counts):
        length = keys.get((fqn, off), _MISSING)
        if length is _MISSING:
            problems.append(
                Problem(METADATA_NAME, f"tensor {fqn!r}: chunk at offsets {list(off)} has no storage record")
            )
        elif itemsize and isinstance(length, int) and count * itemsize > length:
            problems.append(_too_large(fqn, off, sz, count * itemsize, length))
    return problems


_MISSING = object()


def _what(fqn: Any) -> str:
    return f"the storage record of {fqn!r}"


def _itemsize(md: TensorStorageMetadata) -> int:
    itemsize = getattr(getattr(getattr(md, "properties", None), "dtype", None), "itemsize", 0)
    return itemsize if isinstance(itemsize, int) and itemsize > 0 else 0


def _too_large(fqn: str, off: tuple, sz: tuple, needed: int, stored: int) -> Problem:
    # Checked before anything is allocated for it: a chunk's bytes are stored in its item,
    # so a shape whose bytes exceed the item is a lie (a (10^7, 10^6) shape: 40 TB).
    return Problem(
        METADATA_NAME,
        f"tensor {fqn!r}: chunk at offsets {list(off)} with sizes {list(sz)} needs "
        f"{needed} bytes, but its stored item holds {stored}",
    )


def _all_chunk_problems(fqn: str, md: TensorStorageMetadata, keys: dict, exhaustive: bool) -> list[Problem]:
    problems = []
    try:
        size = tuple(int(d) for d in md.size)
    except (TypeError, ValueError):
        return [Problem(METADATA_NAME, f"tensor {fqn!r} has an invalid size {md.size!r}")]
    total = math.prod(size)
    itemsize = _itemsize(md)
    boxes = []
    outside = False
    for chunk in md.chunks or []:
        try:
            off = tuple(int(o) for o in chunk.offsets)
            sz = tuple(int(s) for s in chunk.sizes)
        except (AttributeError, TypeError, ValueError):
            problems.append(Problem(METADATA_NAME, f"tensor {fqn!r} has a malformed chunk {chunk!r}"))
            outside = True
            continue
        if (
            len(off) != len(size)
            or len(sz) != len(size)
            or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size))
        ):
            problems.append(
                Problem(
                    METADATA_NAME,
                    f"tensor {fqn!r} of shape {list(size)}: chunk at offsets {list(off)} with sizes {list(sz)} "
                    "lies outside the tensor",
                )
            )
            outside = True
            continue
        if (fqn, off) not in keys:
            problems.append(
                Problem(METADATA_NAME, f"tensor {fqn!r}: chunk at offsets {list(off)} has no storage record")
            )
        elif itemsize and isinstance(keys[(fqn, off)], int) and math.prod(sz) * itemsize > keys[(fqn, off)]:
            problems.append(_too_large(fqn, off, sz, math.prod(sz) * itemsize, keys[(fqn, off)]))
        boxes.append((off, sz))
    if outside:
        return problems
    covered = sum(math.prod(sz) for _, sz in boxes)
    overlap = find_overlap(boxes) if exhaustive else None
    if overlap is not None:
        (a_off, a_sz), (b_off, b_sz) = overlap
        problems.append(
            Problem(
                METADATA_NAME,
                f"tensor {fqn!r} of shape {list(size)}: chunks at offsets {list(a_off)} (sizes {list(a_sz)}) and "
                f"{list(b_off)} (sizes {list(b_sz)}) overlap",
            )
        )
    elif covered < total:
        problems.append(
            Problem(
                METADATA_NAME,
                f"tensor {fqn!r} of shape {list(size)}: the saved chunks cover {covered} of its {total} elements "
                "(a gap: part of the tensor was never saved)",
            )
        )
    elif covered > total:
        problems.append(
            Problem(
                METADATA_NAME,
                f"tensor {fqn!r} of shape {list(size)}: the saved chunks hold {covered} elements for {total} "
                "(chunks overlap)",
            )
        )
    return problems


def structure_problems(
    metadata: Any, manifest: Manifest | None, sizes: dict[str, int], *, exhaustive: bool = True
) -> list[Problem]:
    """What is inconsistent in `.metadata` (and between it and the manifest and the files).

    `sizes`: the directory listing (name -> bytes); with a manifest its recorded sizes are used
    instead. `exhaustive=False` skips the pairwise overlap search (load time): chunks are then
    only checked to lie inside their tensor and to hold exactly as many elements as it.
    """
    sdm = getattr(metadata, "state_dict_metadata", None)
    storage_data = getattr(metadata, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage_data, dict):
        return [Problem(METADATA_NAME, "holds no state_dict_metadata / storage_data mappings")]
    problems: list[Problem] = []
    # name -> {offset: length} of its item records (their offsets are distinct: FileRecord.problem)
    items = {name: {o: n for o, n, _ in rec.items} for name, rec in manifest.files.items()} if manifest else None
    reported_files: set[str] = set()
    keys: dict[tuple[str | None, tuple[int, ...] | None], int | None] = {}
    safe_names: set[str] = set()  # checked once each: thousands of records name a few files
    for index, info in storage_data.items():
        fqn = getattr(index, "fqn", None)
        offset = getattr(index, "offset", None)
        name = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        transformed = bool(getattr(info, "transform_descriptors", None))
        try:
            # A transformed (compressed) item may hold fewer bytes than its chunk: not comparable.
            keys[(fqn, None if offset is None else _ints(offset))] = (
                length if isinstance(length, int) and not isinstance(length, bool) and not transformed else None
            )
        except (TypeError, ValueError):
            problems.append(Problem(METADATA_NAME, f"storage record key {index!r} is malformed"))
        if type(name) is not str or name not in safe_names:
            try:
                check_name(name, METADATA_NAME, "file name")
            except UnsafeCheckpointError:
                problems.append(
                    Problem(
                        METADATA_NAME,
                        f"{_what(fqn)} names file {name!r}, which escapes the checkpoint directory",
                        "unsafe",
                    )
                )
                continue
            safe_names.add(name)
        if not isinstance(off, int) or not isinstance(length, int) or off < 0 or length < 0:
            problems.append(Problem(METADATA_NAME, f"{_what(fqn)} has offset {off!r} and length {length!r}"))
            continue
        if items is not None:
            recs = items.get(name)
            if recs is None:
                if name not in reported_files:
                    reported_files.add(name)
                    problems.append(
                        Problem(name, ".metadata stores data in it, but the manifest does not list it", "missing")
                    )
                continue
            if recs.get(off) != length:
                problems.append(
                    Problem(
                        name,
                        f"{_what(fqn)} at offset {off} (length {length}) matches no item record of the manifest",
                    )
                )
            size = manifest.files[name].size  # type: ignore[union-attr]
        else:
            size = sizes.get(name)
            if size is None:
                if name not in reported_files:
                    reported_files.add(name)
                    problems.append(Problem(name, "is missing (.metadata stores data in it)", "missing"))
                continue
        if off + length > size:
            problems.append(
                Problem(
                    name,
                    f"{_what(fqn)} at offset {off} (length {length}) runs past the end of the file ({size} bytes)",
                )
            )
    layouts: dict = {}
    for fqn, md in sdm.items():
        if isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in keys:
                problems.append(Problem(METADATA_NAME, f"object {fqn!r} has no storage record"))
        elif isinstance(md, TensorStorageMetadata):
            problems.extend(_chunk_problems(fqn, md, keys, exhaustive, layouts))
        else:
            problems.append(
                Problem(METADATA_NAME, f"entry {fqn!r} is a {type(md).__name__}, not tensor or object metadata")
            )
    orphans = sorted({str(fqn) for fqn, _ in keys if fqn not in sdm})
    if orphans:
        shown = ", ".join(repr(f) for f in orphans[:5]) + (f" ... ({len(orphans)} in all)" if len(orphans) > 5 else "")
        problems.append(Problem(METADATA_NAME, f"storage records for keys that .metadata does not describe: {shown}"))
    return problems


__all__ = ["KINDS", "Problem", "find_overlap", "structure_problems"]
