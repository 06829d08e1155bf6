"""Aliased (tied) tensors in a state dict: two keys whose values are the same memory, such as
a language model's output head tied to its input embedding (`lm_head.weight` is
`embed_tokens.weight`).

A save stores such a tensor's bytes once: both keys stay in `.metadata` (so plain `dcp.load`
and loads asking for either name work), their storage records naming the same bytes
(`CkptWriter`, which finds aliases by the memory it writes; `colocate_aliases` keeps a
replicated alias on the rank that writes its twin). A load whose checkpoint holds one name
of an alias pair fills the other through it (`satisfied_by_alias`): a tied model loads
transformers' own `save_pretrained` output, which stores only `embed_tokens.weight`.

Identity is by storage, never by address alone: two values alias when they are views of one
storage object with the same offset, shape, strides and dtype (DTensors: their local tensors,
and the same mesh, placements and global shape). Storage objects stay the same Python object
while any tensor uses them, so a freed tensor's address reused by another is never an alias.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint.planner import SavePlan

from ckptlib._torch import probes
from ckptlib.format.native.plan_codec import placements_key


def alias_key(value: Any) -> tuple | None:
    """What makes two values the same memory (None: not a tensor that can alias)."""
    extra: tuple = ()
    if type(value) in (torch.Tensor, torch.nn.Parameter):  # first: what a writer resolves items to
        local = value
    elif type(value) is probes.dtensor_cls():
        with torch.no_grad():
            local = value.to_local()
        extra = (tuple(value.shape), placements_key(value.placements), id(value.device_mesh))
    else:
        return None
    if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.device.type == "meta":
        return None
    storage = local.untyped_storage()
    return (
        id(storage),
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
        str(local.device),
        *extra,
    )


def alias_groups(flat: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """{key: every key aliasing it, itself included, in `flat`'s order} for keys with aliases.
    `flat` maps keys to values and keeps them alive while this runs."""
    by_memory: dict[tuple, list[str]] = {}
    for key, value in flat.items():
        found = alias_key(value)
        if found is not None:
            by_memory.setdefault(found, []).append(key)
    groups: dict[str, tuple[str, ...]] = {}
    for keys in by_memory.values():
        if len(keys) > 1:
            for key in keys:
                groups[key] = tuple(keys)
    return groups


def satisfied_by_alias(missing: Iterable[str], flat: Mapping[str, Any], saved: Iterable[str]) -> dict[str, str]:
    """{missing key: the saved key that fills it} for requested keys the checkpoint lacks whose
    value aliases a requested key it holds."""
    missing = list(missing)
    if not missing:
        return {}
    groups = alias_groups(flat)
    saved_keys = set(saved)
    found = {}
    for key in missing:
        source = next((k for k in groups.get(key, ()) if k != key and k in saved_keys), None)
        if source is not None:
            found[key] = source
    return found


def colocate_aliases(before: list[SavePlan], after: list[SavePlan], groups: Mapping[str, tuple[str, ...]]) -> list:
    """`after` (plans whose replicated items DCP's dedup spread over ranks) with every item of an
    alias moved to the plan that writes the same chunk of the first key of its group, where that
    rank had planned it too (it holds the same memory), so the writer stores it once."""
    if not groups:
        return after
    planned = [{(item.index.fqn, tuple(item.index.offset or ())) for item in plan.items} for plan in before]
    writer_of: dict[tuple, int] = {}
    for rank, plan in enumerate(after):
        for item in plan.items:
            writer_of[(item.index.fqn, tuple(item.index.offset or ()))] = rank
    moves: dict[int, list] = {}
    kept: list[list] = [[] for _ in after]
    for rank, plan in enumerate(after):
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset or ()))
            group = groups.get(key[0])
            target = writer_of.get((group[0], key[1])) if group and group[0] != key[0] else None
            if target is not None and target != rank and key in planned[target]:
                moves.setdefault(target, []).append(item)
            else:
                kept[rank].append(item)
    if not moves:
        return after
    return [dataclasses.replace(plan, items=kept[r] + moves.get(r, [])) for r, plan in enumerate(after)]


__all__ = ["alias_groups", "alias_key", "colocate_aliases", "satisfied_by_alias"]
