"""The save planner of every ckptlib save: DCP's default planner with a global-plan check
that stays near-linear in the number of chunks.

DCP checks the global plan for overlapping chunks with a sweep along each tensor's largest
dimension (torch 2.13; older releases compare every pair of chunks). A row-sharded (FSDP)
weight with more columns than rows, such as a (4096, 11008) projection, has every chunk
spanning that whole dimension, so the sweep compares every pair: O(ranks^2) per tensor on
the coordinator, minutes at thousands of ranks (docs/history/benchmarks-rounds.md, "Growth past
this machine"). `CkptSavePlanner` builds the global plan with DCP's own steps (dedup of
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

import copy
import dataclasses
import math
import time
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

from ckptlib._torch import dcp_shims, probes
from ckptlib.errors import CheckpointError
from ckptlib.format.native.aliases import alias_groups, colocate_aliases
from ckptlib.format.native.plan_codec import KNOWN_FIELDS, new_dataclass, placements_key, write_item_fields
from ckptlib.format.native.structure import find_overlap
from ckptlib.format.write.plan_agreement import check_coverage, check_plans
from ckptlib.format.write.plan_cache import PlanReuse, PlanTiming


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
    `dataclasses.replace` per item: the hints are set on the gathered items themselves, which
    nothing else holds (a new item and index per chunk of every rank was ~500 bytes a chunk
    on the coordinator, issue 25.5); DCP's own function for items it would refuse or that the
    fast path does not know."""
    md: dict[str, Any] = {}
    for plan in all_plans:
        for item in plan.items:
            if not KNOWN_FIELDS or type(item) is not WriteItem or type(item.index) is not MetadataIndex:
                return create_default_global_save_plan(all_plans)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    return create_default_global_save_plan(all_plans)
                md[fqn] = BytesStorageMetadata()
                continue
            data = item.tensor_data
            if data is None or data.chunk is None or (item.type != WriteItemType.SHARD and fqn in md):
                return create_default_global_save_plan(all_plans)
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            elif not isinstance(tensor_md, TensorStorageMetadata):
                return create_default_global_save_plan(all_plans)
            # the hint is excluded from MetadataIndex's hash and equality: setting it keeps dict keys valid
            object.__setattr__(item.index, "index", len(tensor_md.chunks))
            tensor_md.chunks.append(data.chunk)
    return list(all_plans), Metadata(md)


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
    plan is checked in near-linear time (see the module).

    `reuse` (a `plan_cache.PlanReuse` whose agreement round ran): on a hit every rank skips
    its local plan and sends an empty one, the coordinator skips the global plan (empty plans
    back, a copy of the cached `.metadata` skeleton) and every rank writes its cached final
    plan; on a miss it plans as without a cache and records the plans for `reuse.install`.
    `timing` holds this rank's planning seconds (its own work, not the collectives' waits).
    """

    def __init__(self, *args: Any, reuse: PlanReuse | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reuse = reuse
        self.timing = reuse.timing if reuse is not None else PlanTiming()

    def _reusing(self) -> bool:
        return self.reuse is not None and self.reuse.hit

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        started = time.perf_counter()
        flat = self.reuse.flattened(state_dict) if self.reuse is not None and self.flatten_state_dict else None
        if flat is None:
            if self._reusing():
                raise CheckpointError("internal error: the plan cache agreed on a state other than the one saved")
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        else:  # flattened in the agreement round already: the same call, without flattening again
            self.flatten_state_dict = False
            try:
                super().set_up_planner(flat[0], storage_meta, is_coordinator)
            finally:
                self.flatten_state_dict = True
            self.mappings = flat[1]
        if self.reuse is not None:
            self.reuse.is_coordinator = self.is_coordinator
        self.timing.planning_s += time.perf_counter() - started

    def create_local_plan(self) -> SavePlan:
        started = time.perf_counter()
        if self._reusing():
            plan = SavePlan([])  # nothing to send: every rank writes its cached plan
        else:
            # Tied tensors: every rank holds the same (its model's structure), the coordinator's decide.
            self.aliases = alias_groups(self.state_dict) if self.is_coordinator else {}
            plan = local_save_plan(self.state_dict, self.is_coordinator)
            if self.flatten_state_dict:
                plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        self.timing.planning_s += time.perf_counter() - started
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        started = time.perf_counter()
        try:
            if self._reusing():
                if any(plan.items for plan in all_plans):
                    raise CheckpointError("internal error: a rank planned a save the plan cache agreed to reuse")
                metadata = self.reuse.reused()[1]  # type: ignore[union-attr]
                if metadata is None:
                    raise CheckpointError("internal error: the plan cache holds no metadata on the coordinator")
                self.metadata = metadata
                return [SavePlan([]) for _ in all_plans], metadata
            global_plan, metadata = self._global_plan(all_plans)
            if self.reuse is not None:  # pristine: the writer's finish fills in the one it is given
                self.reuse.skeleton = copy.copy(metadata)
            self.metadata = metadata
            return global_plan, metadata
        finally:
            self.timing.global_plan_s = time.perf_counter() - started
            self.timing.planning_s += self.timing.global_plan_s

    def _global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        check_plans(all_plans)  # ranks that disagree on a key: one error before anything is written
        deduped = dcp_shims.dedup_save_plans(all_plans, getattr(self, "dedup_save_to_lowest_rank", False))
        deduped = colocate_aliases(all_plans, deduped, getattr(self, "aliases", {}))
        global_plan, metadata = global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[plan.planner_data for plan in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if not chunks_tile_exactly(metadata):
            check_coverage(all_plans, metadata)
            global_plan, metadata = super().create_global_plan(all_plans)
        # Not kept (DCP's planner keeps `global_plan`): nothing after the scatter reads it,
        # and on the coordinator it is an item per chunk of every rank (issue 25.5).
        self.global_plan = []
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        started = time.perf_counter()
        if self._reusing():
            cached = self.reuse.reused()[0]  # type: ignore[union-attr]
            if cached.storage_data != new_plan.storage_data:
                raise CheckpointError("internal error: the plan cache's plan is another rank's")
            new_plan = cached
        elif self.reuse is not None:
            self.reuse.final_plan = new_plan
        self.plan = new_plan
        self.timing.planning_s += time.perf_counter() - started
        return new_plan


__all__ = ["CkptSavePlanner", "chunks_tile_exactly", "global_save_plan", "local_save_plan"]
