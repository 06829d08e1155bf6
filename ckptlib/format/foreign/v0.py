"""The per-rank ("v0") checkpoint format of older trainers, read as a DCP source (see V0_FORMAT)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptlib.errors import CheckpointCorruptError
from ckptlib.format.foreign.foreign import (
    SourceFiles,
    SourceInfo,
    TensorLoc,
    add_objects,
    check_plain_tensor,
    file_size,
    new_metadata,
    tensor_metadata,
)
from ckptlib.format.foreign.torch_save import torch_load

V0_RE = re.compile(r"^rank_(\d+)\.pt$")

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


def v0_rank(name: str) -> int:
    match = V0_RE.match(name)
    assert match is not None
    return int(match.group(1))


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


def inspect(where_: SourceFiles, uri: str, *, trusted: bool) -> SourceInfo:
    root = where_.root
    found = {v0_rank(n): n for n in where_.names}
    first = min(found)
    notes: list[str] = []
    docs: dict[int, Any] = {}

    def _doc(rank: int) -> dict:
        name = found[rank]
        where = f"{root.uri}/{name}"
        doc = torch_load(root, name, trusted=trusted, notes=notes)
        if not isinstance(doc, dict) or not {"world_size", "rank", "tensors"} <= set(doc):
            raise CheckpointCorruptError(
                f"{where}: not a v0 rank file (needs world_size, rank, tensors; "
                "see ckptlib.format.foreign.v0.V0_FORMAT)",
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
            file_size(root, f"rank_{rank}.pt")  # a directory or FIFO there: NotARegularFileError naming it
            raise CheckpointCorruptError(
                f"{missing} is missing: this v0 checkpoint was written by {world} rank{'s' if world != 1 else ''} "
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
            check_plain_tensor(local, where, fqn)
            if (
                local.dim() != len(shape)
                or len(offsets) != len(shape)
                or any(o < 0 or o + n > g for o, n, g in zip(offsets, local.shape, shape))
            ):
                raise CheckpointCorruptError(
                    f"{where}: {fqn}: piece of shape {list(local.shape)} at offsets {list(offsets)} does not fit "
                    f"global shape {list(shape)}",
                    path=where,
                )
            entry = pieces.setdefault(
                fqn, {"dtype": local.dtype, "shape": shape, "path": path, "chunks": {}, "src": name}
            )
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
                entry["chunks"][key] = TensorLoc(name, ("tensors",) + path)
        if rank == 0:
            objects = doc.get("objects") or {}
            if not isinstance(objects, dict):
                raise CheckpointCorruptError(
                    f"{where}: objects is a {type(objects).__name__}, not a mapping", path=where
                )
            rank0_objects = objects
        del doc

    sdm: dict = {}
    planner_data: dict = {}
    storage_data: dict = {}
    for fqn, entry in pieces.items():
        chunks = [(o, s, loc.file) for (o, s), loc in entry["chunks"].items()]
        _check_coverage(fqn, entry["shape"], chunks, uri)
        sdm[fqn] = tensor_metadata(entry["dtype"], entry["shape"], [(o, s) for o, s, _ in chunks])
        planner_data[fqn] = entry["path"]
        for (offsets, _), loc in entry["chunks"].items():
            storage_data[MetadataIndex(fqn, offsets)] = loc
    add_objects(rank0_objects, (), sdm, planner_data, storage_data, f"{root.uri}/{found[0]}")
    return SourceInfo(
        uri=uri,
        kind="v0",
        manifest=None,
        metadata=new_metadata(sdm, planner_data, storage_data),
        saved_world_size=world,
        files=tuple(found[r] for r in range(world)),
        notes=notes,
    )
