"""What each rank of a load at world size M asks a checkpoint for, from its `.metadata` alone
(`ckpt plan`): the DCP read items of every rank's local load plan, as `dcp.load` would make
them for a state parallelized as a given layout, without building the state or a process group.

A key's destination on a rank is the part of the tensor that rank holds (torch.chunk
arithmetic, as FSDP2, FSDP1's sharded state dicts and DTensor's `Shard` cut): nested levels of
(dim, parts, index), e.g. ``fsdp2+tp``: the TP level on the ``tp`` mesh dim, then FSDP's
dim 0 over ``dp`` on the TP-local part. The saved chunks are then matched by DCP's own
resharding (`create_read_items_for_chunk_list`), so the items are exactly DCP's.

What is sharded (from the checkpoint): an optimizer's states live under ``<optim>.state.<fqn>``,
so ``<fqn>`` is a parameter; a model tensor is a parameter when some optimizer has state for
it or it was saved in several chunks (sharded), or, in a checkpoint without optimizer state (a
model-only file), always; other tensors (buffers, scalar optimizer states such as ``step``,
per-rank state) are whole on every rank. TP layouts need the model's
TP plan (a `TrainingSpec`'s ``tp_plan``, see `tp_dims`). Per-rank state (``ckptlib.RankLocal``:
``<name>.rank<k>.*``) is read as its default policy does (a rank that existed restores its
own, new ranks start fresh), or with ``rank_state="merge"`` every rank reads every saved rank's
(``ckptlib.MergeSamplerProgress``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlib.errors import CheckpointError

LAYOUTS = ("plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "fsdp1", "fsdp1-flat")
_RANK_KEY = re.compile(r"rank(\d+)$")

Level = tuple[int, int, int]  # (dim, parts, index): take chunk `index` of `parts` along `dim`


class PlanError(CheckpointError):
    """A load cannot be planned as asked (a layout at a world size it cannot run at, a TP layout
    without the model's TP plan, a state the checkpoint cannot serve)."""


@dataclasses.dataclass(frozen=True)
class KeyKind:
    """How a flat checkpoint key is held by the loading state."""

    param: str | None = None  # the parameter FQN a sharded tensor belongs to (None: whole on every rank)
    rank_local: tuple[str, int] | None = None  # (entry, saved rank) of per-rank state


def _paths(metadata: Metadata) -> dict[str, tuple]:
    data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(data.get(key) or key.split(".", 1)) for key in metadata.state_dict_metadata}


def classify(metadata: Metadata, params: set[str] | None = None) -> dict[str, KeyKind]:
    """{flat key: KeyKind} (see the module). `params`: the model's parameter FQNs, when known
    (a spec's model), instead of guessing them from the checkpoint."""
    sdm = metadata.state_dict_metadata
    paths = _paths(metadata)
    tensors = {k for k, md in sdm.items() if isinstance(md, TensorStorageMetadata)}
    optimized = {p[2] for k, p in paths.items() if len(p) >= 4 and p[1] == "state" and k in tensors}
    shapes = {p[1]: tuple(sdm[k].size) for k, p in paths.items() if len(p) == 2 and k in tensors}
    out: dict[str, KeyKind] = {}
    for key, md in sdm.items():
        path = paths[key]
        found = _RANK_KEY.match(str(path[1])) if len(path) > 2 else None
        if found:
            out[key] = KeyKind(rank_local=(str(path[0]), int(found.group(1))))
            continue
        if not isinstance(md, TensorStorageMetadata) or not len(md.size):
            out[key] = KeyKind()
            continue
        if len(path) >= 4 and path[1] == "state":  # an optimizer state of parameter path[2]
            fqn = str(path[2])
            sharded = fqn in params if params is not None else True
            # sharded like its parameter only if it has the parameter's shape (Adam's moments; not `step`)
            same = shapes.get(fqn, tuple(md.size)) == tuple(md.size)
            out[key] = KeyKind(param=fqn if sharded and same else None)
            continue
        fqn = str(path[-1]) if len(path) == 2 else None
        if fqn is None:
            out[key] = KeyKind()
        elif params is not None:
            out[key] = KeyKind(param=fqn if fqn in params else None)
        else:  # without optimizer state (a model-only file), every model tensor counts as a parameter
            guess = fqn in optimized or len(md.chunks) > 1 or not optimized
            out[key] = KeyKind(param=fqn if guess else None)
    return out


def supports(layout: str, world_size: int) -> bool:
    if layout in ("hsdp", "fsdp2+tp"):
        return world_size >= 4 and world_size % 2 == 0
    return world_size >= 1


def _tp_levels(layout: str, rank: int, world: int, tp_dim: int | None) -> list[Level]:
    if tp_dim is None:
        return []
    if layout == "tp":
        return [(tp_dim, world, rank)]
    half = world // 2
    return [(tp_dim, half, rank % half)]


def levels(layout: str, rank: int, world: int, kind: KeyKind, tp_dims: Mapping[str, int | None]) -> list[Level]:
    """The chunking of one sharded tensor on `rank` (see the module); [] for a whole tensor."""
    if kind.param is None or layout in ("plain", "ddp"):
        return []
    if layout in ("fsdp2", "fsdp1", "fsdp1-flat"):
        return [(0, world, rank)]
    if layout == "hsdp":
        half = world // 2
        return [(0, half, rank % half)]
    tp = _tp_levels(layout, rank, world, tp_dims.get(kind.param))
    if layout == "tp":
        return tp
    return tp + [(0, 2, rank // (world // 2))]  # fsdp2+tp: FSDP over dp on the TP-local part


def local_chunk(size: Sequence[int], nested: Sequence[Level]) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of a tensor of `size` after `nested` chunkings (torch.chunk: parts of
    ceil(n / parts), the last ones short or empty)."""
    offsets, sizes = [0] * len(size), list(size)
    for dim, parts, index in nested:
        step = -(-sizes[dim] // parts) if sizes[dim] else 0
        start = min(index * step, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(step, sizes[dim] - start))
    return offsets, sizes


def tp_dims(model: torch.nn.Module, plan: Mapping[str, Any]) -> dict[str, int | None]:
    """{parameter FQN: the dim its TP style shards} from a `parallelize_module` plan: column-wise
    layers shard their outputs (Linear weight and bias dim 0, Embedding dim 1), row-wise layers
    their inputs (Linear weight dim 1, bias whole; Embedding dim 0). Keys may use `*` for a part."""
    modules = dict(model.named_modules())
    out: dict[str, int | None] = {}
    for pattern, style in plan.items():
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        kind = type(style).__name__
        if kind not in ("ColwiseParallel", "RowwiseParallel"):
            continue
        for name, module in modules.items():
            if not matcher.match(name):
                continue
            embedding = isinstance(module, torch.nn.Embedding)
            for pname, _ in module.named_parameters(recurse=False):
                if kind == "ColwiseParallel":
                    dim = 1 if embedding else 0
                else:
                    dim = 0 if embedding else (1 if pname == "weight" else None)
                out[f"{name}.{pname}" if name else pname] = dim
    return out


def _byte_item(key: str) -> ReadItem:
    index = MetadataIndex(key)
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))


def rank_plans(
    metadata: Metadata,
    world: int,
    layout: str,
    *,
    saved_world: int | None,
    params: set[str] | None = None,
    tp_plan_dims: Mapping[str, int | None] | None = None,
    rank_state: str = "keep",
    only: Sequence[str] | None = None,
) -> tuple[list[LoadPlan], list[int]]:
    """Every rank's local load plan at `layout` on `world` ranks, and the bytes of each rank's
    part of the state (what it loads into)."""
    if layout not in LAYOUTS:
        raise PlanError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if not supports(layout, world):
        raise PlanError(
            f"layout {layout} cannot run on {world} rank{'s' if world != 1 else ''} "
            "(2-D layouts need an even world size from 4)"
        )
    if layout in ("tp", "fsdp2+tp") and tp_plan_dims is None:
        raise PlanError(f"layout {layout} needs the model's TP plan to know which dims it shards: pass --spec")
    if rank_state not in ("keep", "merge"):
        raise PlanError(f"rank_state must be 'keep' or 'merge', got {rank_state!r}")
    kinds = classify(metadata, params)
    paths = _paths(metadata)
    sdm = metadata.state_dict_metadata
    saved = saved_world if saved_world is not None else world
    plans, state_bytes = [], []
    for rank in range(world):
        items: list[ReadItem] = []
        held = 0
        for key, md in sdm.items():
            if only is not None and str(paths[key][0]) not in only:
                continue
            kind = kinds[key]
            if kind.rank_local is not None and not _reads_rank(kind.rank_local[1], rank, world, saved, rank_state):
                continue
            if isinstance(md, BytesStorageMetadata):
                items.append(_byte_item(key))
                continue
            offsets, sizes = local_chunk(md.size, levels(layout, rank, world, kind, tp_plan_dims or {}))
            nbytes = md.properties.dtype.itemsize
            for n in sizes:
                nbytes *= n
            held += nbytes
            if nbytes:
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items += create_read_items_for_chunk_list(key, md, [chunk])
        plans.append(LoadPlan(items))
        state_bytes.append(held)
    return plans, state_bytes


def _reads_rank(saved_rank: int, rank: int, world: int, saved: int, rank_state: str) -> bool:
    if saved == world:
        return saved_rank == rank
    if rank_state == "merge":
        return True
    return saved_rank == rank  # KeepExistingRanks: its own if it existed, else a fresh start


__all__ = ["LAYOUTS", "KeyKind", "PlanError", "classify", "levels", "local_chunk", "rank_plans", "supports", "tp_dims"]
