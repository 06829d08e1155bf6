"""Checkpoints ckptlib did not write: detect their format and read them as DCP sources.

Formats (``detect_format`` returns one of these names):

``ckptlib``
    A directory committed by ``ckptlib.save`` (``ckptlib.json`` manifest, item checksums).
``dcp``
    A plain ``torch.distributed.checkpoint`` directory (``.metadata`` + ``__{r}_{i}.distcp``)
    written by any torch since 2.0, ShardedTensor- or DTensor-based. No checksums.
``torch_save``
    One monolithic ``torch.save`` file holding a *full* (unsharded) state dict: either a
    model state dict (a mapping whose values are all tensors, e.g. ``pytorch_model.bin``),
    which is placed under ``prefix`` (default ``"model"``), or a nested mapping such as
    ``{"model": {...}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}`` (what
    ``dcp_to_torch_save`` and ``ckptlib.convert(..., to="torch")`` write), keyed as is.
    Optimizer state must be keyed by parameter FQN (``get_optimizer_state_dict``); a raw
    ``optimizer.state_dict()`` keyed by integer ids loads nothing silently: its keys do not
    match, so a strict load raises MissingKeysError. Point at the file, or at a directory
    holding exactly one ``*.pt``/``*.pth``/``*.bin``/``*.ckpt`` file.
``v0``
    The per-rank format older trainers wrote (see ``V0_FORMAT`` below).
``safetensors``
    ``model.safetensors`` (or any single ``*.safetensors`` file), or shards listed by
    ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). Keys are flat
    parameter FQNs; they are placed under ``prefix`` (default ``"model"``), so
    ``proj.weight`` loads as the ``"model"`` entry's ``proj.weight``.

Every reader is a DCP ``StorageReader`` whose ``Metadata`` describes the source's tensors
as chunks, so ``dcp.load``'s planner reshards them onto any world size and any placement.
Each rank reads only the chunks its plan names: ``torch.save`` and v0 files are opened with
``torch.load(mmap=True, weights_only=True)`` (pages are touched only where a rank copies),
safetensors shards with ranged reads of just the rows a rank needs.

Keys: sources are flattened with DCP's own rules (``compat.flatten_state_dict``) and the
original nesting is kept in ``Metadata.planner_data``, exactly like a DCP save, so a
nested state loads by the same keys, and conversions can rebuild the nesting.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import struct
import warnings
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import compat
from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    NotACheckpointError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedError,
)
from ..storage import LocalStorage, Storage, check_relative, open_storage
from .dcp_io import CkptReader, PlannedReader
from .layout import CheckpointInfo, classify, open_checkpoint
from .safetensors_header import (
    MAX_HEADER_BYTES,
    header_length,
    parse_json_object,
    safetensors_dtype,
    safetensors_name,
    validate_header,
    validate_index,
)

FORMATS = ("ckptlib", "dcp", "torch_save", "v0", "safetensors")
DEFAULT_PREFIX = "model"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_V0_RE = re.compile(r"^rank_(\d+)\.pt$")
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # pickled torch magic number (pre-1.6 files)

V0_FORMAT = """\
v0: the per-rank checkpoint format of older trainers.

A directory holding one file per rank, ``rank_{r}.pt`` for r = 0 .. N-1, nothing else
required. Each file is a ``torch.save`` (loadable with ``weights_only=True``) of::

    {
      "world_size": N,                    # int, the same in every file
      "rank": r,                          # int, equal to the r in the file name
      "tensors": TREE,                    # this rank's pieces of the state's tensors
      "objects": {...},                   # non-tensor state (nested dicts of plain values)
    }

TREE is a mapping whose values are either a *shard record* or another TREE (nesting, like
the state dict: ``{"model": {"proj.weight": record}}``); flat dotted keys
(``{"model.proj.weight": record}``) are equally valid. A shard record is a mapping with
exactly the keys::

    {"local": Tensor, "global_shape": [int, ...], "offsets": [int, ...]}

``local`` is the rank's piece of the full tensor of shape ``global_shape``, starting at
``offsets`` (one per dimension; a 0-dim tensor has ``[]`` for both). Pieces may be split
along any dimensions and be uneven; a rank may hold no piece of a tensor, or an empty one;
replicated tensors appear on several ranks with the same offsets (the lowest rank's copy
is read). The pieces of a tensor, over all ranks, must cover it exactly once (checked on
open: a gap or an overlap is CheckpointCorruptError), and agree on dtype and global shape.

``objects`` are read from rank 0's file only (they are replicated state, e.g. optimizer
hyper-parameters or a step counter) and are flattened with DCP's rules under the key
names given. The flattened key of a tensor is its TREE path joined by ".".
"""


# --------------------------------------------------------------------------- locating files


@dataclasses.dataclass(frozen=True)
class _Where:
    """A directory storage and the file names in it that make up the source."""

    root: Storage
    names: tuple[str, ...]


def _as_storage(storage_or_path: Storage | str | os.PathLike) -> Storage:
    if isinstance(storage_or_path, (str, os.PathLike)):
        return open_storage(storage_or_path)
    return storage_or_path


def _is_file(storage: Storage) -> bool:
    is_file = getattr(storage, "is_file", None)
    return bool(is_file is not None and is_file())


def _split_file(storage: Storage) -> tuple[Storage, str]:
    """(the directory holding it, its name) for a storage rooted at a local file."""
    path = storage.local_path()
    assert path is not None
    parent, name = os.path.split(path)
    return LocalStorage(parent, fsync=False), name


def _size(root: Storage, name: str) -> int | None:
    """A file's size, or None when it is absent (no directory walk for local files)."""
    path = root.local_path(name)
    if path is not None:
        try:
            return os.path.getsize(path) if os.path.isfile(path) else None
        except OSError:
            return None
    return root.list(name).get(name)


def _head(root: Storage, name: str, size: int, n: int = 24) -> bytes:
    try:
        return root.read(name, 0, min(n, size))
    except (FileNotFoundError, EOFError):
        return b""


def _looks_like_torch_save(head: bytes) -> bool:
    return head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC)


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(size - 8, MAX_HEADER_BYTES) and head[8:9] == b"{"


def _v0_rank(name: str) -> int:
    match = _V0_RE.match(name)
    assert match is not None
    return int(match.group(1))


def _not_a_checkpoint(uri: str, listing: Iterable[str] = ()) -> NotACheckpointError:
    shown = sorted(listing)
    found = (", found: " + ", ".join(shown[:10]) + (" ..." if len(shown) > 10 else "")) if shown else ""
    return NotACheckpointError(
        f"{uri} is not a checkpoint in any format ckptlib reads (ckptlib, DCP .metadata, a torch.save "
        f"file, v0 rank_<r>.pt files, safetensors){found}",
        path=uri,
    )


def _detect(storage: Storage) -> tuple[str, _Where]:
    uri = storage.uri
    if _is_file(storage):
        root, name = _split_file(storage)
        size = _size(root, name) or 0
        head = _head(root, name, size)
        if name.endswith(".index.json"):
            return "safetensors", _Where(root, (name,))
        if name.endswith(".safetensors") or _looks_like_safetensors(head, size):
            return "safetensors", _Where(root, (name,))
        if _V0_RE.match(name) and _looks_like_torch_save(head):
            raise NotACheckpointError(
                f"{uri} looks like one rank's file of a v0 per-rank checkpoint; pass the directory "
                "that holds all rank_<r>.pt files",
                path=uri,
            )
        if _looks_like_torch_save(head):
            return "torch_save", _Where(root, (name,))
        raise _not_a_checkpoint(uri)
    if not storage.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {uri}: the path does not exist", path=uri)
    listing = storage.list()
    kind = classify(storage, listing)
    if kind == "committed":
        return "ckptlib", _Where(storage, ())
    if kind == "dcp":
        return "dcp", _Where(storage, ())
    if kind == "incomplete":
        open_checkpoint(storage)  # raises CheckpointIncompleteError with its usual message
        raise CheckpointIncompleteError(f"{uri} is an uncommitted checkpoint", path=uri)  # pragma: no cover
    top = {name: size for name, size in listing.items() if "/" not in name}
    if SAFETENSORS_INDEX in top:
        return "safetensors", _Where(storage, (SAFETENSORS_INDEX,))
    if SAFETENSORS_FILE in top:
        return "safetensors", _Where(storage, (SAFETENSORS_FILE,))
    indexes = [n for n in top if n.endswith(".safetensors.index.json")]
    singles = [n for n in top if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return "safetensors", _Where(storage, (indexes[0],))
    if not indexes and len(singles) == 1:
        return "safetensors", _Where(storage, (singles[0],))
    ranks = sorted((n for n in top if _V0_RE.match(n)), key=_v0_rank)
    if ranks:
        return "v0", _Where(storage, tuple(ranks))
    saves = [n for n in top if n.endswith(TORCH_SAVE_SUFFIXES) and _looks_like_torch_save(_head(storage, n, top[n]))]
    if len(saves) == 1:
        return "torch_save", _Where(storage, (saves[0],))
    if len(saves) > 1 or len(indexes) > 1 or len(singles) > 1:
        many = saves if len(saves) > 1 else (indexes if len(indexes) > 1 else singles)
        raise NotACheckpointError(
            f"{uri} holds several candidate checkpoint files ({', '.join(sorted(many))}); pass one file",
            path=uri,
        )
    raise _not_a_checkpoint(uri, top)


def detect_format(uri: Storage | str | os.PathLike) -> str:
    """The format of the checkpoint at `uri`: one of FORMATS.

    Raises CheckpointNotFoundError (no such path), CheckpointIncompleteError (a ckptlib or DCP
    save that never finished) or NotACheckpointError (anything else), each naming the path.
    """
    return _detect(_as_storage(uri))[0]


# --------------------------------------------------------------------------- metadata helpers


@dataclasses.dataclass
class SourceInfo(CheckpointInfo):
    """What `inspect_checkpoint` found: CheckpointInfo plus the source's own facts.

    `metadata.storage_data` holds the locators the reader needs, so this object (small,
    picklable) is all another rank needs to build the same reader.
    """

    saved_world_size: int | None = None
    files: tuple[str, ...] = ()
    file_root: str | None = None  # the directory the files are in, when the uri names a file
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def world_size(self) -> int | None:  # type: ignore[override]
        return self.saved_world_size


@dataclasses.dataclass(frozen=True)
class _TensorLoc:
    """A tensor stored whole (torch_save) or one rank's piece (v0): file + path inside it."""

    file: str
    path: tuple


@dataclasses.dataclass(frozen=True)
class _SafetensorsLoc:
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclasses.dataclass(frozen=True)
class _ObjectLoc:
    value: Any


def _tensor_md(dtype: torch.dtype, size: Iterable[int], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )


def _new_metadata(sdm: dict, planner_data: dict, storage_data: dict) -> Metadata:
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data)


def _check_plain_tensor(value: torch.Tensor, where: str, fqn: str) -> None:
    dtensor = compat.dtensor_cls()
    if (dtensor is not None and isinstance(value, dtensor)) or value.layout != torch.strided:
        raise UnsupportedError(
            f"{where}: {fqn} is a {type(value).__name__} with layout {value.layout}; only plain dense "
            "tensors are read from this format",
            path=where,
        )


def _add_objects(objects: dict, prefix_path: tuple, sdm: dict, planner_data: dict, storage_data: dict, where: str):
    """Flatten a tree of plain values with DCP's rules and record every leaf as a bytes item."""
    flat, mappings = compat.flatten_state_dict(objects)
    for fqn, value in flat.items():
        full = ".".join(map(str, prefix_path + (fqn,))) if prefix_path else fqn
        if isinstance(value, torch.Tensor):
            raise CheckpointCorruptError(f"{where}: objects entry {full} is a tensor", path=where)
        if full in sdm:
            raise CheckpointCorruptError(f"{where}: key {full} appears twice", path=where)
        sdm[full] = BytesStorageMetadata()
        planner_data[full] = prefix_path + tuple(mappings[fqn])
        storage_data[MetadataIndex(full)] = _ObjectLoc(value)


# --------------------------------------------------------------------------- loading torch.save files


def _torch_load(root: Storage, name: str, *, trusted: bool, notes: list[str] | None = None) -> Any:
    """torch.load a file memory-mapped (local) or from its bytes (remote), weights_only unless trusted."""
    where = f"{root.uri}/{name}"
    path = root.local_path(name)
    try:
        if path is not None:
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=not trusted)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                if notes is not None:
                    notes.append(f"{where}: legacy (pre-zip) torch.save format, read into memory (no mmap)")
                return torch.load(path, map_location="cpu", weights_only=not trusted)
        if notes is not None:
            notes.append(f"{where}: not a local file, read whole into memory")
        return torch.load(io.BytesIO(root.read(name)), map_location="cpu", weights_only=not trusted)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except Exception as exc:
        if type(exc).__name__ == "UnpicklingError" or "Weights only load failed" in str(exc):
            raise UnsafeCheckpointError(
                f"{where}: torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}); "
                "pass trusted=True only if you trust this file's author",
                path=where,
            ) from exc
        raise CheckpointCorruptError(
            f"{where}: cannot be read by torch.load ({type(exc).__name__}: {exc})", path=where
        ) from exc


def _is_model_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _inspect_torch_save(where_: _Where, uri: str, *, prefix: str | None, trusted: bool) -> SourceInfo:
    root, name = where_.root, where_.names[0]
    where = f"{root.uri}/{name}"
    notes: list[str] = []
    obj = _torch_load(root, name, trusted=trusted, notes=notes)
    if not isinstance(obj, dict):
        raise NotACheckpointError(
            f"{where}: a torch.save file of a {type(obj).__name__}, not a state dict (a mapping)", path=where
        )
    base: tuple = ()
    if _is_model_state_dict(obj) and prefix:
        base = (prefix,)
        notes.append(f"{where}: a flat model state dict, loaded as the {prefix!r} entry")
    sdm: dict = {}
    planner_data: dict = {}
    storage_data: dict = {}
    flat, mappings = compat.flatten_state_dict({prefix: obj} if base else obj)
    for fqn, value in flat.items():
        path = tuple(mappings[fqn])
        if isinstance(value, torch.Tensor):
            _check_plain_tensor(value, where, fqn)
            chunks = [((0,) * value.dim(), tuple(value.shape))] if value.numel() else []
            sdm[fqn] = _tensor_md(value.dtype, value.shape, chunks)
            for offsets, _ in chunks:
                storage_data[MetadataIndex(fqn, offsets)] = _TensorLoc(name, path[len(base):])
        else:
            sdm[fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(fqn)] = _ObjectLoc(value)
        planner_data[fqn] = path
    return SourceInfo(
        uri=uri, kind="torch_save", manifest=None,
        metadata=_new_metadata(sdm, planner_data, storage_data),
        saved_world_size=None, files=(name,), notes=notes,
    )


# --------------------------------------------------------------------------- v0


def _is_shard_record(value: Any) -> bool:
    return isinstance(value, dict) and "local" in value and "global_shape" in value and "offsets" in value


def _walk_records(tree: Any, path: tuple, where: str):
    if not isinstance(tree, dict):
        raise CheckpointCorruptError(f"{where}: tensors entry {'.'.join(map(str, path))} is not a mapping", path=where)
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointCorruptError(f"{where}: tensors key {key!r} is not a string", path=where)
        if _is_shard_record(value):
            yield path + (key,), value
        else:
            yield from _walk_records(value, path + (key,), where)


def _int_list(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _check_coverage(fqn: str, shape: tuple[int, ...], chunks: list[tuple[tuple, tuple, str]], uri: str) -> None:
    """The distinct pieces must tile the tensor: no partial overlap, total volume = numel."""
    for i, (oa, sa, fa) in enumerate(chunks):
        for ob, sb, fb in chunks[i + 1 :]:
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb)):
                raise CheckpointCorruptError(
                    f"{uri}: v0 pieces of {fqn} overlap: offsets {list(oa)} size {list(sa)} in {fa} and "
                    f"offsets {list(ob)} size {list(sb)} in {fb}",
                    path=uri,
                )
    covered = sum(math.prod(s) for _, s, _ in chunks)
    if covered != math.prod(shape):
        raise CheckpointCorruptError(
            f"{uri}: v0 pieces of {fqn} cover {covered} of its {math.prod(shape)} elements "
            f"(global shape {list(shape)}): a rank's piece is missing",
            path=uri,
        )


def _inspect_v0(where_: _Where, uri: str, *, trusted: bool) -> SourceInfo:
    root = where_.root
    found = {_v0_rank(n): n for n in where_.names}
    first = min(found)
    notes: list[str] = []
    docs: dict[int, Any] = {}

    def _doc(rank: int) -> dict:
        name = found[rank]
        where = f"{root.uri}/{name}"
        doc = _torch_load(root, name, trusted=trusted, notes=notes)
        if not isinstance(doc, dict) or not {"world_size", "rank", "tensors"} <= set(doc):
            raise CheckpointCorruptError(
                f"{where}: not a v0 rank file (needs world_size, rank, tensors; see ckptlib.format.legacy.V0_FORMAT)",
                path=where,
            )
        if doc["rank"] != rank:
            raise CheckpointCorruptError(f"{where}: says rank {doc['rank']!r}, its name says rank {rank}", path=where)
        return doc

    docs[first] = _doc(first)
    world = docs[first]["world_size"]
    if not isinstance(world, int) or world < 1:
        raise CheckpointCorruptError(f"{root.uri}/{found[first]}: world_size {world!r} is not a positive int", path=uri)
    for rank in range(world):
        if rank not in found:
            missing = f"{root.uri}/rank_{rank}.pt"
            raise CheckpointCorruptError(
                f"{missing} is missing: this v0 checkpoint was written by {world} ranks "
                f"({found[first]} says world_size={world}) and rank {rank}'s file is not there",
                path=missing,
            )
    extra = sorted(r for r in found if r >= world)
    if extra:
        raise CheckpointCorruptError(
            f"{root.uri}: {', '.join(found[r] for r in extra)} beyond world_size={world} recorded in {found[first]}",
            path=uri,
        )

    pieces: dict[str, dict[str, Any]] = {}
    rank0_objects: dict = {}
    for rank in range(world):
        doc = docs.pop(rank, None) or _doc(rank)
        name = found[rank]
        where = f"{root.uri}/{name}"
        if doc["world_size"] != world:
            raise CheckpointCorruptError(
                f"{where}: says world_size={doc['world_size']!r}, {found[first]} says {world}", path=where
            )
        for path, rec in _walk_records(doc["tensors"], (), where):
            fqn = ".".join(path)
            local, shape, offsets = rec["local"], _int_list(rec["global_shape"]), _int_list(rec["offsets"])
            if not isinstance(local, torch.Tensor) or shape is None or offsets is None:
                raise CheckpointCorruptError(f"{where}: {fqn}: malformed shard record", path=where)
            _check_plain_tensor(local, where, fqn)
            if local.dim() != len(shape) or len(offsets) != len(shape) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, local.shape, shape)
            ):
                raise CheckpointCorruptError(
                    f"{where}: {fqn}: piece of shape {list(local.shape)} at offsets {list(offsets)} does not fit "
                    f"global shape {list(shape)}",
                    path=where,
                )
            entry = pieces.setdefault(fqn, {"dtype": local.dtype, "shape": shape, "path": path, "chunks": {}, "src": name})
            if entry["dtype"] != local.dtype or entry["shape"] != shape:
                raise CheckpointCorruptError(
                    f"{where}: {fqn} is {local.dtype} {list(shape)} here but {entry['dtype']} "
                    f"{list(entry['shape'])} in {entry['src']}",
                    path=where,
                )
            if local.numel() == 0:
                continue
            key = (offsets, tuple(local.shape))
            if key not in entry["chunks"]:  # a replicated piece: the lowest rank's copy is read
                entry["chunks"][key] = _TensorLoc(name, ("tensors",) + path)
        if rank == 0:
            objects = doc.get("objects") or {}
            if not isinstance(objects, dict):
                raise CheckpointCorruptError(f"{where}: objects is a {type(objects).__name__}, not a mapping", path=where)
            rank0_objects = objects
        del doc

    sdm: dict = {}
    planner_data: dict = {}
    storage_data: dict = {}
    for fqn, entry in pieces.items():
        chunks = [(o, s, loc.file) for (o, s), loc in entry["chunks"].items()]
        _check_coverage(fqn, entry["shape"], chunks, uri)
        sdm[fqn] = _tensor_md(entry["dtype"], entry["shape"], [(o, s) for o, s, _ in chunks])
        planner_data[fqn] = entry["path"]
        for (offsets, _), loc in entry["chunks"].items():
            storage_data[MetadataIndex(fqn, offsets)] = loc
    _add_objects(rank0_objects, (), sdm, planner_data, storage_data, f"{root.uri}/{found[0]}")
    return SourceInfo(
        uri=uri, kind="v0", manifest=None, metadata=_new_metadata(sdm, planner_data, storage_data),
        saved_world_size=world, files=tuple(found[r] for r in range(world)), notes=notes,
    )


# --------------------------------------------------------------------------- safetensors

def read_safetensors_header(root: Storage, name: str, size: int | None = None) -> tuple[dict, int]:
    """The validated tensor entries of a safetensors file and the offset its data starts at
    (see safetensors_header for the rules; CheckpointCorruptError naming the file and key)."""
    where = f"{root.uri}/{name}"
    try:
        if size is None:
            size = _size(root, name)
            if size is None:
                raise FileNotFoundError(where)
        n = header_length(root.read(name, 0, 8) if size >= 8 else b"", where, size)
        header = parse_json_object(root.read(name, 8, n), where, "safetensors header")
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except EOFError as exc:
        raise CheckpointCorruptError(f"{where} is truncated ({exc})", path=where) from exc
    return validate_header(header, where, size - 8 - n), 8 + n


def _inspect_safetensors(where_: _Where, uri: str, *, prefix: str | None) -> SourceInfo:
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
            if rel not in files and _size(root, rel) is None:
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
            sdm[fqn] = _tensor_md(dtype, shape, chunks)  # type: ignore[arg-type]
            planner_data[fqn] = (prefix, key) if prefix else (key,)
            for offsets, _ in chunks:
                storage_data[MetadataIndex(fqn, offsets)] = _SafetensorsLoc(
                    file, entry["dtype"], shape, data_start + begin, data_start + end
                )
    return SourceInfo(
        uri=uri, kind="safetensors", manifest=None, metadata=_new_metadata(sdm, planner_data, storage_data),
        saved_world_size=None, files=tuple(files),
    )


# --------------------------------------------------------------------------- the reader


class LegacyReader(PlannedReader):
    """Serves DCP read items from a torch_save, v0 or safetensors source (see SourceInfo)."""

    def __init__(self, root: Storage, info: SourceInfo, *, trusted: bool = False):
        super().__init__(info.metadata)
        self.root = root
        self.info = info
        self.trusted = trusted
        self._opened: dict[str, Any] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_opened"] = {}  # mmapped files are reopened where the reader lands
        return state

    def reset(self, checkpoint_id=None) -> None:
        self._opened = {}

    def _open(self, name: str) -> Any:
        if name not in self._opened:
            self._opened[name] = _torch_load(self.root, name, trusted=self.trusted)
        return self._opened[name]

    def _piece(self, loc: Any, offsets: torch.Size, lengths: torch.Size, fqn: str) -> torch.Tensor:
        if isinstance(loc, _TensorLoc):
            value: Any = self._open(loc.file)
            try:
                for key in loc.path:
                    value = value[key]
                if isinstance(value, dict) and "local" in value:
                    value = value["local"]
            except (KeyError, IndexError, TypeError) as exc:
                where = f"{self.root.uri}/{loc.file}"
                raise CheckpointCorruptError(
                    f"{where}: {fqn} is no longer in the file (changed since it was opened?)", path=where
                ) from exc
            if not isinstance(value, torch.Tensor):
                where = f"{self.root.uri}/{loc.file}"
                raise CheckpointCorruptError(f"{where}: {fqn} is not a tensor any more", path=where)
            for dim, (start, length) in enumerate(zip(offsets, lengths)):
                value = value.narrow(dim, start, length)
            self.bytes_read += value.numel() * value.element_size()
            return value
        assert isinstance(loc, _SafetensorsLoc)
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
            return torch.empty(tuple(lengths), dtype=dtype)
        where = f"{self.root.uri}/{loc.file}"
        try:
            data = self.root.read(loc.file, loc.begin + first * row_bytes, nbytes)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
        except EOFError as exc:
            raise CheckpointCorruptError(f"{where} is truncated ({exc})", path=where) from exc
        self.bytes_read += nbytes
        with warnings.catch_warnings():  # read-only bytes: the view is only copied from, never written
            warnings.filterwarnings("ignore", message=".*not writable.*")
            value = torch.frombuffer(data, dtype=dtype)
        value = value.reshape((rows,) + tail) if loc.shape else value.reshape(())
        for dim in range(1, len(loc.shape)):
            value = value.narrow(dim, offsets[dim], lengths[dim])
        return value

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        try:
            for req in plan.items:
                loc = self.storage_data[req.storage_index]
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(loc.value, buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                piece = self._piece(loc, req.storage_offsets, req.lengths, fqn)
                target = planner.resolve_tensor(req).detach()
                if target.size() != piece.size():
                    raise CheckpointCorruptError(
                        f"{self.info.uri}: {fqn}: stored piece has shape {tuple(piece.size())}, "
                        f"expected {tuple(target.size())}",
                        path=self.info.uri,
                    )
                target.copy_(piece)
                planner.commit_tensor(req, target)
        finally:
            self._opened = {}  # drop the mappings: touched pages are released with them
        fut: Future = Future()
        fut.set_result(None)
        return fut


# --------------------------------------------------------------------------- entry points


def inspect_checkpoint(
    storage_or_path: Storage | str | os.PathLike,
    *,
    verify: bool = True,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
) -> CheckpointInfo:
    """Detect the format at `storage_or_path` and describe it (run on one rank, broadcast the result).

    ckptlib and plain DCP directories give `open_checkpoint`'s CheckpointInfo (kind "ckptlib"
    or "dcp"); the other formats a SourceInfo whose kind is the format name.
    """
    storage = _as_storage(storage_or_path)
    fmt, where_ = _detect(storage)
    if fmt in ("ckptlib", "dcp"):
        return open_checkpoint(storage, verify=verify)
    if fmt == "torch_save":
        info = _inspect_torch_save(where_, storage.uri, prefix=prefix, trusted=trusted)
    elif fmt == "v0":
        info = _inspect_v0(where_, storage.uri, trusted=trusted)
    else:
        info = _inspect_safetensors(where_, storage.uri, prefix=prefix)
    if where_.root is not storage:
        info.file_root = where_.root.uri
    return info


def open_reader(
    storage_or_path: Storage | str | os.PathLike,
    *,
    info: CheckpointInfo | None = None,
    verify: bool = True,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
) -> tuple[StorageReader, CheckpointInfo]:
    """A DCP StorageReader for any format `detect_format` knows, and what the checkpoint is.

    Pass `info` (from `inspect_checkpoint` on rank 0, broadcast) to skip inspecting again:
    building a reader from it does no I/O. `verify` applies to ckptlib checkpoints (item
    checksums); `trusted` lets torch.save/v0 files unpickle arbitrary objects.
    """
    storage = _as_storage(storage_or_path)
    if info is None:
        info = inspect_checkpoint(storage, verify=verify, prefix=prefix, trusted=trusted)
    if not isinstance(info, SourceInfo):
        if _is_file(storage):
            raise NotACheckpointError(f"{storage.uri} is a file, not a checkpoint directory", path=storage.uri)
        return CkptReader(storage, info.metadata, info.manifest, verify=verify), info
    root = storage
    if info.file_root is not None:
        if not _is_file(storage):
            raise StorageError(f"{storage.uri}: expected the file this checkpoint info was made from", path=storage.uri)
        root, _ = _split_file(storage)
    return LegacyReader(root, info, trusted=trusted), info


__all__ = [
    "DEFAULT_PREFIX", "FORMATS", "LegacyReader", "SourceInfo", "V0_FORMAT", "detect_format",
    "inspect_checkpoint", "open_reader", "read_safetensors_header", "safetensors_dtype", "safetensors_name",
]
