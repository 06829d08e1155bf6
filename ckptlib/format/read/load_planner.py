"""The load planner of every ckptlib load: DCP's default planner with safe unpickling."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ckptlib._torch import dcp_shims, probes
from ckptlib.format.native.plan_codec import KNOWN_FIELDS, new_dataclass, placements_key
from ckptlib.format.native.safe_pickle import load_object
from ckptlib.format.read import chunk_index


def _read_item_like(template: ReadItem, fqn: str) -> ReadItem:
    """`template` (a read of another tensor with the same layout, saved and loaded) for `fqn`."""
    dest, storage = template.dest_index, template.storage_index
    return new_dataclass(
        ReadItem,
        {
            **template.__dict__,
            "dest_index": new_dataclass(MetadataIndex, {"fqn": fqn, "offset": dest.offset, "index": dest.index}),
            "storage_index": new_dataclass(
                MetadataIndex, {"fqn": fqn, "offset": storage.offset, "index": storage.index}
            ),
        },
    )


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """DCP's `create_default_local_load_plan`, asked once per layout: DTensors with the same
    mesh, placements and shape whose saved chunks this rank reads are the same reuse its read
    items (DCP's per-tensor shard arithmetic was a third of a 10,000-tensor load). A DTensor's
    reads cost the saved chunks it reads, not every chunk of the tensor (`chunk_index`: the
    same read items as DCP's). Every other value, and every error, is DCP's own, key by key."""
    dtensor = probes.dtensor_cls()
    if not KNOWN_FIELDS or dtensor is None:
        return create_default_local_load_plan(state_dict, metadata, strict)
    stored = metadata.state_dict_metadata
    templates: dict[Any, list[ReadItem]] = {}
    in_mesh: dict[int, bool] = {}
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = stored.get(fqn)
        key = None
        if type(obj) is dtensor and isinstance(md, TensorStorageMetadata) and md.size == obj.size():
            mesh = obj.device_mesh
            if in_mesh.setdefault(id(mesh), mesh.get_coordinate() is not None) is False:
                continue
            if type(obj.to_local()) is torch.Tensor:
                local = obj.__create_chunk_list__()
                picked = chunk_index.candidates(md, local)
                chunks = tuple((i, tuple(md.chunks[i].offsets), tuple(md.chunks[i].sizes)) for i in picked)
                key = (id(mesh), placements_key(obj.placements), tuple(obj.shape), chunks)
                if key in templates:
                    items += [_read_item_like(item, fqn) for item in templates[key]]
                    continue
                made = chunk_index.read_items(fqn, md, local, picked)
                if all(type(item) is ReadItem for item in made):
                    templates[key] = made
                items += made
                continue
        made = create_default_local_load_plan({fqn: obj}, metadata, strict).items
        if key is not None and all(type(item) is ReadItem for item in made):
            templates[key] = made
        items += made
    return LoadPlan(items)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor objects are unpickled with weights_only."""

    def __init__(self, *, trusted: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.trusted = trusted

    def create_local_plan(self):
        # DCP takes a rank that asks for fewer keys than the checkpoint holds for a reader of
        # a pre-2.4 checkpoint and re-flattens its state the 2.3 way, which then misses
        # keys such as "optim.param_groups". A rank whose shard of a parameter is empty asks
        # for fewer keys legitimately (FSDP1 gives it no optimizer state for that parameter):
        # when every key this rank asks for is in the checkpoint, plan with those keys.
        if self.flatten_state_dict and self.metadata is not None:
            if set(self.state_dict) <= set(self.metadata.state_dict_metadata):
                return local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        if self.trusted:
            return super().load_bytes(read_item, value)
        obj = load_object(value.getvalue(), f"object {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            dcp_shims.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
