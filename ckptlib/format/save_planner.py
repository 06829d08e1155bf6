"""The save planner of every ckptlib save: DCP's default planner with a global-plan check
that stays near-linear in the number of chunks.

DCP checks the global plan for overlapping chunks with a sweep along each tensor's largest
dimension (torch 2.13; older releases compare every pair of chunks). A row-sharded (FSDP)
weight with more columns than rows, such as a (4096, 11008) projection, has every chunk
spanning that whole dimension, so the sweep compares every pair: O(ranks^2) per tensor on
the coordinator, minutes at thousands of ranks (docs/benchmarks.md, "Growth past this
machine"). `CkptSavePlanner` builds the global plan with DCP's own steps (dedup of
replicated items, `create_default_global_save_plan`, the planner_data merge: the same in
every torch of the window) and checks it with `structure.find_overlap`, which sweeps along
the dimension with the most distinct offsets. A plan that passes is used as built; any other
plan (or an unusual one: zero-size or rank-mismatched chunks) goes to DCP's own
`create_global_plan`, so what DCP refuses fails with DCP's own error, word for word.

Cost per tensor (issue 13: 10,000 tensors): the local plan asks DCP for the write item of the
first DTensor of each signature (mesh, placements, global shape, dtype, flags) and reuses its
chunk for the others, instead of DCP's per-tensor shard arithmetic; the global plan rewrites
index hints without `dataclasses.replace` (the same items and Metadata as DCP's
`create_default_global_save_plan`, which it falls back to for anything unusual).
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .._torch import dcp_shims, probes
from .aliases import alias_groups, colocate_aliases
from .plan_codec import KNOWN_FIELDS, new_dataclass, placements_key, write_item_fields
from .structure import find_overlap


def _item_like(template: WriteItem, fqn: str) -> WriteItem:
    """`template`'s write item for another tensor of the same signature: fresh dataclasses,
    shared (immutable) torch.Size objects."""
    data = template.tensor_data
    chunk = new_dataclass(ChunkStorageMetadata, dict(data.chunk.__dict__))
    properties = new_dataclass(TensorProperties, dict(data.properties.__dict__))
    return new_dataclass(
        WriteItem,
        write_item_fields(
            new_dataclass(MetadataIndex, {"fqn": fqn, "offset": template.index.offset, "index": None}),
            template.type,
            new_dataclass(TensorWriteData, {"chunk": chunk, "properties": properties, "size": data.size}),
        ),
    )


def local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """DCP's `create_default_local_save_plan`, with one DCP call per DTensor signature."""
    dtensor = probes.dtensor_cls()
    if not KNOWN_FIELDS or dtensor is None:
        return create_default_local_save_plan(state_dict, is_coordinator)
    templates: dict[Any, WriteItem] = {}
    in_mesh: dict[int, bool] = {}
    items: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if type(obj) is not dtensor:
            items += dcp_shims.create_write_items(fqn, obj)
            continue
        mesh = obj.device_mesh
        if in_mesh.setdefault(id(mesh), mesh.get_coordinate() is not None) is False:
            continue
        local = obj.to_local()
        if type(local) is not torch.Tensor:  # a tensor subclass may plan its own items
            items += dcp_shims.create_write_items(fqn, obj)
            continue
        key = (
            id(mesh),
            placements_key(obj.placements),
            tuple(obj.shape),
            local.dtype,
            local.layout,
            local.requires_grad,
            local.is_pinned(),
        )
        template = templates.get(key)
        if template is not None:
            items.append(_item_like(template, fqn))
            continue
        made = dcp_shims.create_write_items(fqn, obj)
        if len(made) == 1 and type(made[0]) is WriteItem and type(made[0].tensor_data) is TensorWriteData:
            templates[key] = made[0]
        items += made
    return SavePlan(items)


def global_save_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """DCP's `create_default_global_save_plan` (index hints rewritten) without a
    `dataclasses.replace` per item; DCP's own function for items it would refuse or that the
    fast path does not know."""
    md: dict[str, Any] = {}
    new_plans = []
    for plan in all_plans:
        new_items = []
        for item in plan.items:
            if not KNOWN_FIELDS or type(item) is not WriteItem or type(item.index) is not MetadataIndex:
                return create_default_global_save_plan(all_plans)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    return create_default_global_save_plan(all_plans)
                md[fqn] = BytesStorageMetadata()
                new_items.append(item)
                continue
            data = item.tensor_data
            if data is None or data.chunk is None or (item.type != WriteItemType.SHARD and fqn in md):
                return create_default_global_save_plan(all_plans)
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            elif not isinstance(tensor_md, TensorStorageMetadata):
                return create_default_global_save_plan(all_plans)
            index = new_dataclass(MetadataIndex, {**item.index.__dict__, "index": len(tensor_md.chunks)})
            new_items.append(new_dataclass(WriteItem, {**item.__dict__, "index": index}))
            tensor_md.chunks.append(data.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def chunks_tile_exactly(metadata: Metadata) -> bool:
    """True if DCP's global-plan check (`_validate_global_plan`) surely passes: every chunk of
    every tensor lies inside it with positive sizes, no two overlap, and together they hold
    exactly its elements (newer DCP checks the volume only across ranks, torch 2.8's for one
    rank too: a plan either would refuse goes to DCP). False means "let DCP check"."""
    for md in metadata.state_dict_metadata.values():
        if not isinstance(md, TensorStorageMetadata) or len(md.size) == 0:
            continue  # objects and 0-d tensors: DCP checks nothing either
        size = tuple(md.size)
        boxes = []
        volume = 0
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size):
                return False
            if any(s <= 0 or o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size)):
                return False
            boxes.append((offsets, sizes))
            volume += math.prod(sizes)
        if volume != math.prod(size):
            return False
        if find_overlap(boxes) is not None:
            return False
    return True


class CkptSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose local and global plans cost little per tensor and whose global
    plan is checked in near-linear time (see the module)."""

    def create_local_plan(self) -> SavePlan:
        # Tied tensors: every rank holds the same (its model's structure), the coordinator's decide.
        self.aliases = alias_groups(self.state_dict) if self.is_coordinator else {}
        plan = local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deduped = dcp_shims.dedup_save_plans(all_plans, getattr(self, "dedup_save_to_lowest_rank", False))
        deduped = colocate_aliases(all_plans, deduped, getattr(self, "aliases", {}))
        global_plan, metadata = global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[plan.planner_data for plan in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if not chunks_tile_exactly(metadata):
            return super().create_global_plan(all_plans)
        self.global_plan = global_plan
        self.metadata = metadata
        return global_plan, metadata


__all__ = ["CkptSavePlanner", "chunks_tile_exactly", "global_save_plan", "local_save_plan"]
