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
  that file and matches an item record of the manifest; no chunk needs more bytes than its
  stored item holds (checked before anything is allocated for it);
- every tensor item's own header (a metadata-only torch.load, a few KiB an item): the shape
  and dtype it holds are the ones `.metadata` declares for its chunk.

A plain DCP checkpoint (no manifest) gets the structural checks and a note that it carries no
checksums. A ckptlib checkpoint that lost its manifest (its `.metadata` is marked) is damaged.

`structure_problems` is also what `open_checkpoint` runs (cheaply) before every load, so a
crafted or damaged `.metadata` cannot make a load read outside its files or leave part of a
tensor silently unloaded.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import math
import os
import zlib
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckptlib.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from ckptlib.format.items.checksum import crc32, crc32_combine
from ckptlib.format.items.ranged_io import _RangeReader
from ckptlib.format.native.file_names import item_name, shard_rank
from ckptlib.format.native.layout import classify, is_ckptlib_metadata, not_a_checkpoint_error, open_checkpoint
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, FileRecord, Manifest
from ckptlib.format.native.safe_pickle import safe_loads
from ckptlib.format.native.stream_transforms import Transforms, decoded_limit, descriptors_of
from ckptlib.format.native.structure import Problem, structure_problems
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage, list_top

# Bytes read at a time while checksumming a file (memory stays bounded for huge shards).
READ_CHUNK = 16 << 20
# At most this many problems are listed per file; the rest are counted in one line.
MAX_PER_FILE = 20


def _message_without_where(exc: CheckpointError, where: str) -> str:
    text = str(exc)
    for prefix in (f"{where}: ", f"{where}:"):
        if text.startswith(prefix):
            return text[len(prefix) :]
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


# --------------------------------------------------------------------------- checksums


def _checksum_problems(
    storage: Storage,
    name: str,
    record: FileRecord,
    read_chunk: int,
    on_bytes: Callable[[int], None] | None = None,
    storage_data: dict | None = None,
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
        storage.read(name, 0, 0)  # a FIFO or device in its place fails here, even when empty
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
    except CheckpointError as exc:
        return [Problem(name, _message_without_where(exc, f"{storage.uri.rstrip('/')}/{name}"))]
    except EOFError as exc:
        return [Problem(name, f"is shorter than its listed size ({exc})")]
    bad = [(off, length) for (off, length, crc), actual in zip(items, got) if crc != actual]
    problems = [
        Problem(name, f"checksum mismatch in {item_name(storage_data, name, off)} at offset {off} (length {length})")
        for off, length in bad
    ]
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


def _read_at_most(storage: Storage, name: str, limit: int) -> bytes:
    """The file's bytes, or its first `limit` + 1 when it is larger (enough to tell)."""
    try:
        return storage.read(name, 0, limit + 1)
    except EOFError:
        return storage.read(name)


def _open_listing(storage: Storage) -> dict[str, int]:
    """The checkpoint's listing, or the error that says it is no checkpoint at all: told from
    the files directly in it (a checkpoint's all are), so a large directory that is none is
    refused without walking the tree below it."""
    kind = classify(storage, list_top(storage))
    error = not_a_checkpoint_error(storage, kind)
    if error is not None:
        raise error
    return storage.list()


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
    storage = as_storage(storage)
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
        record = manifest.files.get(METADATA_NAME) if manifest is not None else None
        try:
            # With a manifest, never more than it records (a larger file fails the CRC anyway).
            blob = storage.read(METADATA_NAME) if record is None else _read_at_most(storage, METADATA_NAME, record.size)
        except CheckpointError as exc:
            blob = None
            problems.append(Problem(METADATA_NAME, _message_without_where(exc, where)))
        except FileNotFoundError:
            blob = None
            problems.append(Problem(METADATA_NAME, "disappeared while it was being verified", "missing"))
        crc = zlib.crc32(blob) if blob is not None else 0
        if blob is None:
            pass
        elif manifest is not None and record is None:
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
                    raise CheckpointCorruptError(
                        f"{where}: holds {type(loaded).__name__}, not DCP Metadata", path=where
                    )
                metadata = loaded
            except CheckpointError as exc:
                kind = "unsafe" if isinstance(exc, UnsafeCheckpointError) else "corrupt"
                problems.append(Problem(METADATA_NAME, _message_without_where(exc, where), kind))

    if MANIFEST_NAME not in listing:
        if PENDING_NAME in listing:
            problems.append(
                Problem(
                    MANIFEST_NAME, f"is missing: a save started here ({PENDING_NAME}) but never committed", "incomplete"
                )
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
                Problem(
                    None,
                    f"plain DCP checkpoint (no {MANIFEST_NAME}): it carries no checksums to verify; "
                    "only its structure was checked",
                    "note",
                )
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
                    Problem(
                        name, f"has {listing[name]} bytes, the manifest says {record.size} (truncated or overwritten)"
                    )
                )
            else:
                stored = metadata.storage_data if metadata is not None else None
                problems.extend(_checksum_problems(storage, name, record, read_chunk, on_bytes, stored))
        for name in sorted(listing):
            if name not in manifest.files and name not in (MANIFEST_NAME, PENDING_NAME):
                problems.append(Problem(name, "is not listed in the manifest (not part of the checkpoint)", "note"))
        if PENDING_NAME in listing:
            problems.append(
                Problem(
                    PENDING_NAME,
                    "was left behind by a commit interrupted after the manifest was written; harmless",
                    "note",
                )
            )

    if metadata is not None:
        structure = structure_problems(metadata, manifest, listing, exhaustive=True)
        problems.extend(structure)
        if not any(p.is_error for p in structure):
            # Files already reported damaged are not decoded again (one finding per damage).
            damaged = {p.file for p in problems if p.is_error and p.file is not None}
            problems.extend(_declared_item_problems(storage, metadata, damaged))
    return _cap(problems)


class _StoredItem(_RangeReader):
    """Bytes [base, base + size) of a checkpoint file, read through the Storage on demand."""

    def __init__(self, storage: Storage, name: str, base: int, size: int):
        super().__init__(size)
        self._storage, self._name, self._base = storage, name, base

    def _fill(self, view: memoryview, pos: int) -> int:
        data = self._storage.read(self._name, self._base + pos, view.nbytes)
        view[: len(data)] = data
        return len(data)


def _declared_item_problems(storage: Storage, metadata: Metadata, skip: set[str]) -> list[Problem]:
    """Every stored tensor item's own shape and dtype against what `.metadata` declares for its
    chunk (CRCs only prove the bytes are the ones written, not that `.metadata` describes
    them). Read from each item's header: a metadata-only torch.load, a few KiB an item.
    Files in `skip` (already reported damaged) are not decoded."""
    declared: dict[tuple[str, tuple[int, ...]], tuple[Any, tuple[int, ...]]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                declared[(fqn, tuple(int(o) for o in chunk.offsets))] = (
                    md.properties.dtype,
                    tuple(int(s) for s in chunk.sizes),
                )
    problems: list[Problem] = []
    transforms = Transforms()
    undecodable: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for index, info in metadata.storage_data.items():
        key = (index.fqn, tuple(int(o) for o in index.offset)) if index.offset is not None else None
        want = declared.get(key) if key is not None else None
        if want is None:
            continue
        name, off, length = info.relative_path, info.offset, info.length
        if name in skip:
            continue
        where = f"item of {index.fqn!r} at offset {off} (length {length})"
        descriptors = descriptors_of(info)
        if descriptors and (why := transforms.unknown(descriptors)) is not None:
            undecodable.setdefault((name, descriptors), [why]).append(index.fqn)
            continue
        try:
            item: Any = _StoredItem(storage, name, off, length)
            if descriptors:  # stored through DCP extensions (zstd): undone first
                raw = memoryview(storage.read(name, off, length))
                limit = decoded_limit(math.prod(want[1]) * want[0].itemsize)
                item = io.BytesIO(transforms.decode(raw, descriptors, limit, f"{storage.uri}/{name}"))
            stored = torch.load(item, map_location="meta", weights_only=True)
        except FileNotFoundError:
            problems.append(Problem(name, "disappeared while it was being verified", "missing"))
            continue
        except Exception as exc:  # noqa: BLE001 - any failure to decode is a finding
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            problems.append(Problem(name, f"{where} cannot be decoded as a tensor ({type(exc).__name__}: {first})"))
            continue
        if not isinstance(stored, torch.Tensor):
            problems.append(Problem(name, f"{where} holds a {type(stored).__name__}, .metadata declares a tensor"))
        elif (stored.dtype, tuple(stored.shape)) != want:
            problems.append(
                Problem(
                    name,
                    f"{where} holds a tensor of shape {list(stored.shape)} and dtype {_dtype_name(stored.dtype)}, "
                    f".metadata declares shape {list(want[1])} and dtype {_dtype_name(want[0])}",
                )
            )
    for (name, descriptors), (why, *fqns) in undecodable.items():
        problems.append(
            Problem(
                name,
                f"{len(fqns)} item(s) are stored with DCP extension(s) {list(descriptors)}, which ckptlib cannot "
                f"decode ({why}): unsupported, not damaged; their contents were not checked (a load raises "
                "UnsupportedError; ckptlib.dcp.reader(uri, extension_registry=...) reads them)",
                "note",
            )
        )
    return problems


def _manifest_problems(manifest: Manifest) -> list[Problem]:

    problems = []
    ranks = set()
    for name in manifest.files:
        rank = shard_rank(name)
        if rank is None:
            continue
        ranks.add(rank)
        if rank >= manifest.world_size:
            problems.append(
                Problem(
                    MANIFEST_NAME,
                    f"lists {name}, a shard of rank {rank}, but says the world size was {manifest.world_size}",
                )
            )
    # Never range(world_size): a crafted world size (10^12) must not build a set that large.
    present = sum(1 for r in ranks if r < manifest.world_size)
    if present < manifest.world_size:
        shown = [r for r in range(min(manifest.world_size, len(ranks) + 20)) if r not in ranks][:20]
        more = manifest.world_size - present - len(shown)
        problems.append(
            Problem(
                MANIFEST_NAME,
                f"lists no shard file for rank(s) {', '.join(map(str, shown))}"
                f"{f' and {more} more' if more > 0 else ''} of the {manifest.world_size} that saved",
            )
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
    return text[len("torch.") :] if text.startswith("torch.") else text


def summarize(storage: Storage | str | os.PathLike) -> Summary:
    """Describe the checkpoint at `storage` from its manifest and `.metadata` only (no shard is
    read, and a damaged shard does not prevent it); raises the errors `open_checkpoint` raises."""

    storage = as_storage(storage)
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
