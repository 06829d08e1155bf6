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
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from .. import compat
from .structure import find_overlap


def chunks_tile_exactly(metadata: Metadata, *, ranks: int) -> bool:
    """True if DCP's global-plan check (`_validate_global_plan`) surely passes: every chunk of
    every tensor lies inside it with positive sizes, no two overlap, and (with more than one
    rank, as DCP checks) together they hold exactly its elements. False means "let DCP check"."""
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
        if ranks > 1 and volume != math.prod(size):
            return False
        if find_overlap(boxes) is not None:
            return False
    return True


class CkptSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose global plan is checked in near-linear time (see the module)."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deduped = compat.dedup_save_plans(all_plans, getattr(self, "dedup_save_to_lowest_rank", False))
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[plan.planner_data for plan in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if not chunks_tile_exactly(metadata, ranks=len(global_plan)):
            return super().create_global_plan(all_plans)
        self.global_plan = global_plan
        self.metadata = metadata
        return global_plan, metadata


__all__ = ["CkptSavePlanner", "chunks_tile_exactly"]
