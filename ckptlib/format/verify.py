"""Offline integrity checks of one checkpoint: `verify(storage) -> list[Problem]`, `summarize`.

`verify` reads every byte of a checkpoint through the `Storage` protocol (so it works the
same on local disk and S3) and reports, per file:

- the manifest: present, parseable, self-checksum, file names inside the directory, item
  records inside their files, one shard per saved rank;
- every file: present, the size and whole-file CRC-32 the manifest records, and the CRC-32
  of every item (one pass over each file, in bounded memory);
- `.metadata` (restricted unpickling only): every tensor's saved chunks cover it exactly (no
  gap, no overlap; zero-size chunks are fine: pytorch/pytorch#108869), every chunk and object
  has a storage record, every storage record names a file inside the directory, lies within
  that file and matches an item record of the manifest.

A plain DCP checkpoint (no manifest) gets the structural checks and a note that it carries no
checksums. A ckptlib checkpoint that lost its manifest (its `.metadata` is marked) is damaged.

`structure_problems` is also what `open_checkpoint` runs (cheaply) before every load, so a
crafted or damaged `.metadata` cannot make a load read outside its files or leave part of a
tensor silently unloaded.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import zlib
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from ..storage import Storage, open_storage
from .checksum import crc32, crc32_combine
from .dcp_io import describe_file, is_ckptlib_metadata
from .manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, FileRecord, Manifest, check_name
from .safe_pickle import safe_loads

# Bytes read at a time while checksumming a file (memory stays bounded for huge shards).
READ_CHUNK = 16 << 20
# At most this many problems are listed per file; the rest are counted in one line.
MAX_PER_FILE = 20

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


def _as_storage(storage: Storage | str | os.PathLike) -> Storage:
    return open_storage(storage) if isinstance(storage, (str, os.PathLike)) else storage


def _message_without_where(exc: CheckpointError, where: str) -> str:
    text = str(exc)
    for prefix in (f"{where}: ", f"{where}:"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _cap(problems: list[Problem]) -> list[Problem]:
    """Keep the first MAX_PER_FILE problems of each (file, kind); count the rest."""
    out: list[Problem] = []
    seen: dict[tuple[str | None, str], int] = {}
    for p in problems:
        key = (p.file, p.kind)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= MAX_PER_FILE:
            out.append(p)
    for (file, kind), count in seen.items():
        if count > MAX_PER_FILE:
            out.append(Problem(file, f"... and {count - MAX_PER_FILE} more problems like these", kind))
    return out


# --------------------------------------------------------------------------- structure


def _box_overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    return all(max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]))


def _find_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[Any, Any] | None:
    """Two chunks that share an element, or None. Sweeps along the dimension with the most
    distinct offsets, so row-, column- and grid-sharded tensors stay near O(n log n)."""
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
        for b in boxes[i + 1 :]:
            if b[0][dim] >= end:
                break
            if _box_overlap(a, b):
                return a, b
    return None


def _chunk_problems(fqn: str, md: TensorStorageMetadata, keys: set, exhaustive: bool) -> list[Problem]:
    problems = []
    try:
        size = tuple(int(d) for d in md.size)
    except (TypeError, ValueError):
        return [Problem(METADATA_NAME, f"tensor {fqn!r} has an invalid size {md.size!r}")]
    total = math.prod(size)
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
        boxes.append((off, sz))
    if outside:
        return problems
    covered = sum(math.prod(sz) for _, sz in boxes)
    overlap = _find_overlap(boxes) if exhaustive else None
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
    items = {name: {(o, n) for o, n, _ in rec.items} for name, rec in manifest.files.items()} if manifest else None
    reported_files: set[str] = set()
    keys: set[tuple[str | None, tuple[int, ...] | None]] = set()
    for index, info in storage_data.items():
        fqn = getattr(index, "fqn", None)
        offset = getattr(index, "offset", None)
        try:
            keys.add((fqn, None if offset is None else tuple(int(o) for o in offset)))
        except (TypeError, ValueError):
            problems.append(Problem(METADATA_NAME, f"storage record key {index!r} is malformed"))
        name = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        what = f"the storage record of {fqn!r}"
        try:
            check_name(name, METADATA_NAME, "file name")
        except UnsafeCheckpointError:
            problems.append(
                Problem(METADATA_NAME, f"{what} names file {name!r}, which escapes the checkpoint directory", "unsafe")
            )
            continue
        if not isinstance(off, int) or not isinstance(length, int) or off < 0 or length < 0:
            problems.append(Problem(METADATA_NAME, f"{what} has offset {off!r} and length {length!r}"))
            continue
        if getattr(info, "transform_descriptors", None):
            problems.append(
                Problem(name, f"{what} is stored with DCP extensions {list(info.transform_descriptors)}, "
                        "which ckptlib does not read", "note")
            )
        if items is not None:
            recs = items.get(name)
            if recs is None:
                if name not in reported_files:
                    reported_files.add(name)
                    problems.append(Problem(name, ".metadata stores data in it, but the manifest does not list it", "missing"))
                continue
            if (off, length) not in recs:
                problems.append(
                    Problem(name, f"{what} at offset {off} (length {length}) matches no item record of the manifest")
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
                Problem(name, f"{what} at offset {off} (length {length}) runs past the end of the file ({size} bytes)")
            )
    for fqn, md in sdm.items():
        if isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in keys:
                problems.append(Problem(METADATA_NAME, f"object {fqn!r} has no storage record"))
        elif isinstance(md, TensorStorageMetadata):
            problems.extend(_chunk_problems(fqn, md, keys, exhaustive))
        else:
            problems.append(Problem(METADATA_NAME, f"entry {fqn!r} is a {type(md).__name__}, not tensor or object metadata"))
    orphans = sorted({str(fqn) for fqn, _ in keys if fqn not in sdm})
    if orphans:
        shown = ", ".join(repr(f) for f in orphans[:5]) + (f" ... ({len(orphans)} in all)" if len(orphans) > 5 else "")
        problems.append(Problem(METADATA_NAME, f"storage records for keys that .metadata does not describe: {shown}"))
    return problems


# --------------------------------------------------------------------------- checksums


def _checksum_problems(
    storage: Storage, name: str, record: FileRecord, read_chunk: int, on_bytes: Callable[[int], None] | None = None
) -> list[Problem]:
    """Read `name` once, in `read_chunk` pieces, and compare the whole-file, item and block
    CRCs. Each byte is checksummed once: the pieces between item and block boundaries are,
    and their CRCs are combined (without zlib-ng: one running CRC per level instead)."""
    items = list(record.items)  # sorted, inside the file, not overlapping (FileRecord.problem)
    bs = record.block_size
    whole = 0
    got = [0] * len(items)
    blocks = [0] * len(record.blocks)
    cuts = sorted({b for off, length, _ in items for b in (off, off + length)})

    def fold(crc: int, piece: memoryview, piece_crc: int | None) -> int:
        return crc32(piece, crc) if piece_crc is None else crc32_combine(crc, piece_crc, piece.nbytes)

    k = 0  # the item at or after the current position
    pos = 0
    try:
        while pos < record.size:
            n = min(read_chunk, record.size - pos)
            data = memoryview(storage.read(name, pos, n))
            end = pos + n
            a = pos
            while a < end:
                b = end
                if bs:
                    b = min(b, (a // bs + 1) * bs)
                i = bisect.bisect_right(cuts, a)
                if i < len(cuts):
                    b = min(b, cuts[i])
                piece = data[a - pos : b - pos]
                piece_crc = crc32(piece) if crc32_combine is not None else None
                whole = fold(whole, piece, piece_crc)
                while k < len(items) and items[k][0] + items[k][1] <= a:
                    k += 1
                if k < len(items) and items[k][0] <= a:
                    got[k] = fold(got[k], piece, piece_crc)
                if bs:
                    blocks[a // bs] = fold(blocks[a // bs], piece, piece_crc)
                a = b
            pos = end
            if on_bytes is not None:
                on_bytes(n)
    except FileNotFoundError:
        return [Problem(name, "disappeared while it was being verified", "missing")]
    except EOFError as exc:
        return [Problem(name, f"is shorter than its listed size ({exc})")]
    bad = [(off, length) for (off, length, crc), actual in zip(items, got) if crc != actual]
    problems = [Problem(name, f"checksum mismatch in item at offset {off} (length {length})") for off, length in bad]
    if whole != record.crc32 and not bad:
        problems.append(
            Problem(name, f"checksum mismatch (whole file: crc32 {whole:08x}, the manifest says {record.crc32:08x})")
        )
    if not problems:
        problems = [
            Problem(name, f"checksum mismatch in file block {j} (bytes {j * bs}..{min((j + 1) * bs, record.size)})")
            for j, (want, actual) in enumerate(zip(record.blocks, blocks))
            if want != actual
        ]
    return problems


# --------------------------------------------------------------------------- entry points


def _open_listing(storage: Storage) -> dict[str, int]:
    """The checkpoint's listing, or the error that says it is no checkpoint at all."""
    from .layout import classify, not_a_checkpoint_error

    listing = storage.list() if storage.exists() else {}
    kind = classify(storage, listing)
    error = not_a_checkpoint_error(storage, kind)
    if error is not None:
        raise error
    return listing


def verify(
    storage: Storage | str | os.PathLike,
    *,
    read_chunk: int = READ_CHUNK,
    on_start: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every problem of the checkpoint at `storage`; no problem with `is_error` means intact.

    `on_start(total_bytes)` is called once the manifest is read, then `on_bytes(n)` as data
    is checksummed (a progress bar).

    Raises CheckpointNotFoundError / NotACheckpointError when there is no checkpoint there
    at all (a missing path, an empty directory, a file, unrelated files).
    """
    storage = _as_storage(storage)
    uri = storage.uri
    listing = _open_listing(storage)
    problems: list[Problem] = []

    manifest: Manifest | None = None
    if MANIFEST_NAME in listing:
        where = f"{uri}/{MANIFEST_NAME}"
        try:
            manifest = Manifest.from_bytes(storage.read(MANIFEST_NAME), where)
        except CheckpointError as exc:
            kind = "unsafe" if isinstance(exc, UnsafeCheckpointError) else "corrupt"
            problems.append(Problem(MANIFEST_NAME, _message_without_where(exc, where), kind))

    metadata: Metadata | None = None
    if METADATA_NAME not in listing:
        problems.append(Problem(METADATA_NAME, "is missing", "missing"))
    else:
        where = f"{uri}/{METADATA_NAME}"
        blob = storage.read(METADATA_NAME)
        record = manifest.files.get(METADATA_NAME) if manifest is not None else None
        crc = zlib.crc32(blob)
        if manifest is not None and record is None:
            problems.append(Problem(METADATA_NAME, "is not listed in the manifest"))
        elif record is not None and (len(blob) != record.size or crc != record.crc32):
            problems.append(
                Problem(
                    METADATA_NAME,
                    f"checksum mismatch ({len(blob)} bytes, crc32 {crc:08x}; the manifest says {record.size} bytes, "
                    f"crc32 {record.crc32:08x})",
                )
            )
        else:
            try:
                loaded = safe_loads(blob, where)
                if not isinstance(loaded, Metadata):
                    raise CheckpointCorruptError(f"{where}: holds {type(loaded).__name__}, not DCP Metadata", path=where)
                metadata = loaded
            except CheckpointError as exc:
                kind = "unsafe" if isinstance(exc, UnsafeCheckpointError) else "corrupt"
                problems.append(Problem(METADATA_NAME, _message_without_where(exc, where), kind))

    if MANIFEST_NAME not in listing:
        if PENDING_NAME in listing:
            problems.append(
                Problem(MANIFEST_NAME, f"is missing: a save started here ({PENDING_NAME}) but never committed", "incomplete")
            )
        elif metadata is not None and is_ckptlib_metadata(metadata):
            problems.append(
                Problem(
                    MANIFEST_NAME,
                    "is missing: .metadata says ckptlib wrote this checkpoint, so its manifest was deleted or a save "
                    "or deletion was interrupted; without it the files cannot be verified",
                    "missing",
                )
            )
        else:
            problems.append(
                Problem(None, f"plain DCP checkpoint (no {MANIFEST_NAME}): it carries no checksums to verify; "
                        "only its structure was checked", "note")
            )

    if manifest is not None:
        if on_start is not None:
            on_start(sum(r.size for n, r in manifest.files.items() if n != METADATA_NAME))
        problems.extend(_manifest_problems(manifest))
        for name, record in sorted(manifest.files.items()):
            if name == METADATA_NAME:
                continue  # checked above
            if name not in listing:
                problems.append(Problem(name, "is missing", "missing"))
            elif listing[name] != record.size:
                problems.append(
                    Problem(name, f"has {listing[name]} bytes, the manifest says {record.size} (truncated or overwritten)")
                )
            else:
                problems.extend(_checksum_problems(storage, name, record, read_chunk, on_bytes))
        for name in sorted(listing):
            if name not in manifest.files and name not in (MANIFEST_NAME, PENDING_NAME):
                problems.append(Problem(name, "is not listed in the manifest (not part of the checkpoint)", "note"))
        if PENDING_NAME in listing:
            problems.append(
                Problem(PENDING_NAME, "was left behind by a commit interrupted after the manifest was written; "
                        "harmless", "note")
            )

    if metadata is not None:
        problems.extend(structure_problems(metadata, manifest, listing, exhaustive=True))
    return _cap(problems)


def _manifest_problems(manifest: Manifest) -> list[Problem]:
    from .layout import shard_rank

    problems = []
    ranks = set()
    for name in manifest.files:
        rank = shard_rank(name)
        if rank is None:
            continue
        ranks.add(rank)
        if rank >= manifest.world_size:
            problems.append(
                Problem(MANIFEST_NAME, f"lists {name}, a shard of rank {rank}, but says the world size was "
                        f"{manifest.world_size}")
            )
    missing = sorted(set(range(manifest.world_size)) - ranks)
    if missing:
        problems.append(
            Problem(MANIFEST_NAME, f"lists no shard file for rank(s) {', '.join(map(str, missing))} of the "
                    f"{manifest.world_size} that saved")
        )
    return problems


@dataclasses.dataclass
class Summary:
    """What `ckpt inspect` shows: see `to_json` for the exact JSON keys."""

    uri: str
    format: str
    step: int | None
    world_size: int | None
    torch_version: str | None
    total_bytes: int
    tensors: list[dict[str, Any]]
    objects: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "torch_version": self.torch_version,
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
        }


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def summarize(storage: Storage | str | os.PathLike) -> Summary:
    """Describe the checkpoint at `storage` from its manifest and `.metadata` only (no shard is
    read, and a damaged shard does not prevent it); raises the errors `open_checkpoint` raises."""
    from .layout import open_checkpoint

    storage = _as_storage(storage)
    info = open_checkpoint(storage, verify=True, check_files=False)
    tensors, objects = [], []
    for key, md in sorted(info.metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            tensors.append(
                {
                    "key": key,
                    "shape": [int(d) for d in md.size],
                    "dtype": _dtype_name(md.properties.dtype),
                    "chunks": len(md.chunks),
                }
            )
        else:
            objects.append(key)
    if info.manifest is not None:
        total = info.manifest.total_bytes
        torch_version = info.manifest.torch_version or None
    else:
        listing = storage.list()
        names = {METADATA_NAME} | {getattr(i, "relative_path", None) for i in info.metadata.storage_data.values()}
        total = sum(listing.get(n, 0) for n in names if isinstance(n, str))
        torch_version = None
    return Summary(
        uri=storage.uri,
        format=info.kind,
        step=info.step,
        world_size=info.world_size,
        torch_version=torch_version,
        total_bytes=total,
        tensors=tensors,
        objects=objects,
    )


__all__ = ["Problem", "Summary", "structure_problems", "summarize", "verify"]
